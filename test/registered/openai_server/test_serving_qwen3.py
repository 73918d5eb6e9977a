"""End to end on a tiny Qwen3 checkpoint made by make_checkpoint: prompt logprobs over chunked
prefill equal the ModelRunner's own, continuous batching keeps greedy outputs identical to
one-at-a-time serving, and so does retraction when the KV pool is too small."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from server_helpers import read_log, servers_running, session_runs, started, tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt() -> str:
    return tiny_checkpoint("qwen3", seed=0)


@pytest.fixture(scope="module")
def servers(ckpt, request):
    """The server and, when the session runs the retraction test, its small-pool server, started
    side by side (each start keeps about one core busy)."""
    launches = [dict(model=ckpt, other_args=["--device", "cpu", "--chunked-prefill-size", "24"])]
    if session_runs(request, "test_retraction_keeps_outputs_identical"):
        # Each request ends at ~40 tokens; admission reserves only part of the budget it will use,
        # so with 200 slots the requests admitted together run out of KV and must be retracted.
        launches.append(dict(model=ckpt, other_args=["--device", "cpu", "--max-total-tokens", "200"]))
    with servers_running(*launches) as results:
        yield results


@pytest.fixture(scope="module")
def server(servers):
    return started(servers[0])  # or the error of its start


def generate(url: str, body: dict, stream: bool = False) -> dict:
    r = requests.post(f"{url}/generate", json={**body, "stream": stream}, stream=stream, timeout=300)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()
    last = None
    for line in r.iter_lines(decode_unicode=True):
        if line.startswith("data: ") and line != "data: [DONE]":
            last = json.loads(line[6:])
    return last


def test_prompt_logprobs_match_the_model_runner(server, ckpt) -> None:
    from sglang.srt.model_executor.batch_builder import ExtendRequest, build_extend_batch, prompt_logprob_targets
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.server_configs import build_run_configs

    ids = [(i * 29 + 3) % 450 + 7 for i in range(70)]  # three chunks of 24 on the server
    out = generate(server[1], {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
                               "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    meta = out["meta_info"]

    args = ServerArgs(model_path=ckpt, device="cpu", max_total_tokens=512, max_running_requests=2)
    runner = ModelRunner(build_run_configs(args).scheduler.runner)
    row = runner.req_to_token_pool.alloc(1)[0]
    locs = runner.token_to_kv_pool_allocator.alloc(len(ids))
    rel, targets = prompt_logprob_targets(ids, 0, len(ids), 0)
    fb = build_extend_batch(
        [ExtendRequest(row, ids, 0, locs, return_logprob=True, logprob_start_len=rel, logprob_target_ids=targets)],
        runner.req_to_token_pool, runner.device,
    )
    ref = runner.forward(fb)

    served = meta["input_token_logprobs"]
    assert served[0][:2] == [None, ids[0]]
    assert [e[1] for e in served[1:]] == ids[1:]
    assert [e[0] for e in served[1:]] == pytest.approx(ref.input_token_logprobs[0], abs=1e-4)
    assert out["output_ids"] == [int(ref.next_token_ids[0])]
    assert meta["output_token_logprobs"][0][0] == pytest.approx(ref.next_token_logprobs[0], abs=1e-4)


def workload() -> list[dict]:
    """32 greedy requests of mixed prompt and output lengths, half as text, half as token ids."""
    words = "the engine reads a prompt and runs the model one step at a time for every request".split()
    reqs = []
    for i in range(32):
        n = 3 + (i * 7) % 60
        params = {"max_new_tokens": 4 + (i * 5) % 21, "temperature": 0, "ignore_eos": True}
        if i % 2:
            reqs.append({"input_ids": [(i * 13 + k * 31) % 450 + 7 for k in range(n)], "sampling_params": params})
        else:
            reqs.append({"text": " ".join(words[(i + k) % len(words)] for k in range(n // 2 + 1)),
                         "sampling_params": params})
    return reqs


@pytest.fixture(scope="module")
def one_at_a_time(server) -> list[dict]:
    return [generate(server[1], body) for body in workload()]


def run_concurrently(url: str, bodies: list[dict]) -> list[dict]:
    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        return list(pool.map(lambda body: generate(url, body, stream=True), bodies))


def assert_same(outs: list[dict], refs: list[dict]) -> None:
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out["output_ids"] == ref["output_ids"], f"request {i}"
        assert out["text"] == ref["text"], f"request {i}"
        assert out["meta_info"]["completion_tokens"] == ref["meta_info"]["completion_tokens"]


def test_concurrent_streams_match_one_at_a_time(server, one_at_a_time) -> None:
    assert_same(run_concurrently(server[1], workload()), one_at_a_time)
    # Batched for certain: concurrent calls may still reach the scheduler one by one (a host that
    # prefills each before the next arrives), so each half of the workload (text, token ids) goes
    # as one call too, whose prompts reach the scheduler in one message and are admitted together.
    bodies = workload()
    halves = [[i for i, b in enumerate(bodies) if key in b] for key in ("text", "input_ids")]
    before = read_log(server[0])
    for key, idx in zip(("text", "input_ids"), halves):
        outs = generate(server[1], {key: [bodies[i][key] for i in idx],
                                    "sampling_params": [bodies[i]["sampling_params"] for i in idx]})
        assert isinstance(outs, list) and len(outs) == len(idx)
        assert_same(outs, [one_at_a_time[i] for i in idx])
    log = read_log(server[0])[len(before):]
    assert any(f"#new-seq: {k}," in log for k in range(2, 33)), "requests should have been batched"


def long_outputs() -> list[dict]:
    """Short prompts, long outputs: requests admitted together outgrow a small KV pool."""
    return [{"input_ids": [(i * 17 + k * 23) % 450 + 7 for k in range(4 + i % 9)],
             "sampling_params": {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}} for i in range(24)]


def test_retraction_keeps_outputs_identical(server, servers) -> None:
    refs = [generate(server[1], body) for body in long_outputs()]
    proc, url = started(servers[1])  # the 200-slot pool
    # One batch request: its 24 prompts reach the scheduler as one message, so they are admitted
    # together however fast this machine sends requests (sent one by one from threads, a slow host
    # let the first finish before the last arrived, and nothing outgrew the pool).
    bodies = long_outputs()
    outs = generate(url, {"input_ids": [b["input_ids"] for b in bodies],
                          "sampling_params": [b["sampling_params"] for b in bodies]})
    assert isinstance(outs, list) and len(outs) == len(bodies)
    info = requests.get(f"{url}/get_server_info", timeout=30).json()
    log = read_log(proc)
    assert "Retract requests" in log and info["num_retractions"] > 0
    assert_same(outs, refs)
    assert info["kv_available_tokens"] == 200 and info["last_integrity_check"]["ok"]


def test_adapters_on_a_server_without_lora_are_refused(server, ckpt) -> None:
    url = server[1]
    cases = [
        ("/generate", {"text": "hi", "lora_path": "sql"}, 400, "LoRA is not enabled"),
        ("/v1/completions", {"model": f"{ckpt}:sql", "prompt": "hi"}, 400, "LoRA is not enabled"),
        ("/v1/completions", {"model": "sql", "prompt": "hi"}, 404, "LoRA is not enabled"),
        ("/load_lora_adapter", {"lora_name": "sql", "lora_path": ckpt}, 400, "--enable-lora"),
        ("/v1/unload_lora_adapter", {"lora_name": "sql"}, 400, "LoRA is not enabled"),
    ]
    for path, body, status, needle in cases:
        r = requests.post(f"{url}{path}", json=body, timeout=60)
        assert r.status_code == status, (path, r.text)
        assert needle in r.json()["error"]["message"], (path, r.text)
    models = requests.get(f"{url}/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == [ckpt] and models[0]["parent"] is None
    assert "lora" not in requests.get(f"{url}/get_server_info", timeout=30).json()
