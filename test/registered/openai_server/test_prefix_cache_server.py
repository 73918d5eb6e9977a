"""The prefix cache end to end, through one real server (tiny llama, float32, two PEFT adapters and
a third name for the first one's files), the native API and the official `openai` client:

  * with a cache hit, prompt logprobs, greedy tokens and their logprobs equal a miss's, for the
    base model and for adapters; a prompt-logprob request reuses at most up to its first position;
  * a multi-turn chat reuses the earlier turns (`usage.prompt_tokens_details.cached_tokens`);
  * the same prompt under adapters, the base model and salts never hits another namespace's
    entries, with names and salts chosen to collide as strings (a salt equal to an adapter's name
    or id, an adapter named "a:s" beside adapter "a" with salt "s", the salt "None");
  * an unloaded adapter's entries are dropped, and the same name loaded again starts cold;
  * `/flush_cache` refuses while a request runs (400 in the envelope), then empties the cache;
  * `/get_server_info` reports the hit rate, the prefill log line `#cached-token`;
  * with `--disable-radix-cache` nothing is reused and the flush is a no-op;
  * `bench_serving --dataset-name generated-shared-prefix` builds its groups and reports hits.
"""

from __future__ import annotations

import re

import pytest
import requests

openai = pytest.importorskip("openai")  # the GPU machine lacks it; CI installs it (the test extra)

from lora_server_testlib import generate, post, tiny_lora_checkpoint, write_adapter
from reliability_lib import assert_no_leaks, server_info, wait_idle
from server_helpers import read_log, servers_running, session_runs, started
from sglang.srt.lora.lora_registry import make_lora_ref

TOL = 1e-5  # float32: the same numbers up to summation order
SYSTEM = [(i * 29 + 7) % 500 + 3 for i in range(24)]
QUESTION = [(i * 13 + 5) % 500 + 3 for i in range(8)]
PROMPT = SYSTEM + QUESTION


@pytest.fixture(scope="module")
def ckpt() -> str:
    return tiny_lora_checkpoint("llama")


@pytest.fixture(scope="module")
def adapters(ckpt, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("prefix-adapters")
    a = write_adapter(ckpt, str(root / "a"), r=4, seed=31)
    return {"a": a, "b": write_adapter(ckpt, str(root / "b"), r=8, target_modules=["q_proj", "v_proj"], seed=32),
            "a:s": a}  # the same files under a name that collides with adapter "a" + salt "s"


@pytest.fixture(scope="module")
def servers(ckpt, adapters, request):
    """The LoRA server with the prefix cache and, when the session runs its test, the one with
    --disable-radix-cache, started side by side (each start keeps about one core busy)."""
    launches = [dict(model=ckpt, other_args=[
        "--device", "cpu", "--dtype", "float32", "--lora-backend", "torch_native", "--max-loras-per-batch", "4",
        "--max-lora-rank", "8", "--lora-target-modules", "all", "--enable-cache-report",
        "--lora-paths", *[f"{name}={path}" for name, path in adapters.items()],
    ])]
    if session_runs(request, "test_disable_radix_cache_turns_it_all_off"):
        launches.append(dict(model=ckpt, other_args=["--device", "cpu", "--dtype", "float32", "--disable-radix-cache"]))
    with servers_running(*launches) as results:
        yield results


@pytest.fixture(scope="module")
def server(servers):
    return started(servers[0])  # or the error of its start


def flush(url: str) -> dict:
    r = post(url, "/flush_cache", {})
    assert r.status_code == 200, r.text
    return r.json()


def gen(url: str, ids: list[int], lora=None, salt=None, start: int = -1, n: int = 6) -> dict:
    return generate(url, {"input_ids": ids, "lora_path": lora, "cache_salt": salt, "return_logprob": True,
                          "logprob_start_len": start,
                          "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}})


def max_diff(a: list, b: list) -> float:
    assert [t for _, t, _ in a] == [t for _, t, _ in b]
    return max((abs(x - y) for (x, _, _), (y, _, _) in zip(a, b) if x is not None), default=0.0)


@pytest.mark.parametrize("lora", [None, "a", "b"])
def test_a_hit_answers_like_a_miss(server, lora):
    url = server[1]
    flush(url)
    start = len(SYSTEM) + 1  # prompt logprobs from the first question token on
    miss = gen(url, PROMPT, lora, start=start)
    hit = gen(url, PROMPT, lora, start=start)
    deep = gen(url, PROMPT, lora)  # no prompt logprobs: everything but the last token is reused
    assert [x["meta_info"]["cached_tokens"] for x in (miss, hit, deep)] == [0, len(SYSTEM), len(PROMPT) - 1]
    m, h, d = miss["meta_info"], hit["meta_info"], deep["meta_info"]
    assert len(m["input_token_logprobs"]) == len(PROMPT) - start
    diffs = (max_diff(m["input_token_logprobs"], h["input_token_logprobs"]),
             max_diff(m["output_token_logprobs"], h["output_token_logprobs"]),
             max_diff(m["output_token_logprobs"], d["output_token_logprobs"]))
    print(f"{lora}: max |miss - hit| prompt {diffs[0]:.1e}, output {diffs[1]:.1e}, deep hit {diffs[2]:.1e}")
    assert miss["output_ids"] == hit["output_ids"] == deep["output_ids"]
    assert max(diffs) <= TOL, diffs


def test_namespaces_never_share_entries(server, adapters):
    url = server[1]
    uid_a = make_lora_ref(f"a={adapters['a']}").lora_id
    spaces = [(None, None), ("a", None), ("b", None), ("a:s", None), ("a", "s"), (None, "s"), (None, "a"),
              (None, "a:s"), (None, uid_a), (None, "None"), ("b", "a"), ("b", uid_a)]
    flush(url)
    for lora, salt in spaces:  # every earlier namespace already holds this very prompt
        assert gen(url, PROMPT, lora, salt, n=1)["meta_info"]["cached_tokens"] == 0, (lora, salt)
    for lora, salt in spaces:  # the control: each namespace does find its own entry
        assert gen(url, PROMPT, lora, salt, n=1)["meta_info"]["cached_tokens"] == len(PROMPT) - 1, (lora, salt)
    info = server_info(url)["prefix_cache"]
    assert info["namespaces"] == len(spaces) and info["hit_rate"] > 0 and info["cached_tokens"] > 0


def test_multi_turn_chat_reuses_earlier_turns(server):
    client = openai.OpenAI(base_url=f"{server[1]}/v1", api_key="unused")
    messages = [{"role": "system", "content": "You answer questions about boats, briefly and kindly."},
                {"role": "user", "content": "What is a keel for?"}]
    for model in ("default", "default:a"):
        first = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
        turn2 = messages + [{"role": "assistant", "content": first.choices[0].message.content},
                            {"role": "user", "content": "And a rudder?"}]
        second = client.chat.completions.create(model=model, messages=turn2, max_tokens=8, temperature=0)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached >= first.usage.prompt_tokens - 2 and cached < second.usage.prompt_tokens, (model, cached)
        stream = client.chat.completions.create(model=model, messages=turn2, max_tokens=4, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        usage = [c.usage for c in stream if c.usage is not None][-1]
        assert usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1
    completion = client.completions.create(model="default", prompt="Boats float because", max_tokens=2,
                                           extra_body={"cache_salt": "tenant-7"})
    again = client.completions.create(model="default", prompt="Boats float because", max_tokens=2,
                                      extra_body={"cache_salt": "tenant-7"})
    assert completion.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1


def test_unloading_an_adapter_drops_its_entries(server, adapters):
    url = server[1]
    assert post(url, "/load_lora_adapter", {"lora_name": "c", "lora_path": adapters["b"]}).status_code == 200
    first = gen(url, PROMPT, "c")
    assert gen(url, PROMPT, "c")["meta_info"]["cached_tokens"] == len(PROMPT) - 1
    before = wait_idle(url)["prefix_cache"]
    assert post(url, "/unload_lora_adapter", {"lora_name": "c"}).status_code == 200
    info = wait_idle(url)
    assert info["prefix_cache"]["namespaces"] == before["namespaces"] - 1
    assert info["prefix_cache"]["size"] < before["size"]
    assert_no_leaks(info)
    assert post(url, "/load_lora_adapter", {"lora_name": "c", "lora_path": adapters["b"]}).status_code == 200
    again = gen(url, PROMPT, "c")  # the same name and files: a new adapter id, so a cold start
    assert again["meta_info"]["cached_tokens"] == 0 and again["output_ids"] == first["output_ids"]
    assert post(url, "/unload_lora_adapter", {"lora_name": "c"}).status_code == 200


def test_flush_cache_refuses_while_a_request_runs(server):
    proc, url = server
    # The flush is sent once the stream's first event arrived; the request then still runs for
    # seconds (1,500 tokens), and ends when the test closes its stream (an abort), not on its own.
    body = {"input_ids": PROMPT, "stream": True,
            "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 0}}
    with requests.post(f"{url}/generate", json=body, stream=True, timeout=300) as stream:
        assert stream.status_code == 200, stream.text
        lines = stream.iter_lines()  # kept: a dropped generator closes the connection (an abort)
        first = next(line for line in lines if line.startswith(b"data: {"))
        r = post(url, "/flush_cache", {})
    assert r.status_code == 400, (r.text, first[:300])
    body = r.json()
    assert body["error"]["type"] == "invalid_request_error" and "running or waiting" in body["error"]["message"]
    assert body["success"] is False and first
    wait_idle(url)
    out = flush(url)
    assert out["success"] is True and "flushed" in out["message"]
    info = wait_idle(url)
    assert info["prefix_cache"]["size"] == 0 and info["kv_free_tokens"] == info["max_total_num_tokens"]
    assert_no_leaks(info)
    assert requests.get(f"{url}/flush_cache", timeout=60).status_code == 200  # GET works too, like SGLang's
    log = read_log(proc)
    assert re.search(r"Prefill batch, #new-seq: \d+, #new-token: \d+, #cached-token: [1-9]\d*,", log)
    assert "Cache flushed" in log


def test_disable_radix_cache_turns_it_all_off(servers):
    proc, url = started(servers[1])
    outs = [gen(url, PROMPT, n=2) for _ in range(2)]
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 0]
    assert outs[0]["output_ids"] == outs[1]["output_ids"]
    assert "disabled" in flush(url)["message"]
    info = wait_idle(url)
    assert info["prefix_cache"] == {"enabled": False} and info["kv_evictable_tokens"] == 0
    assert_no_leaks(info)
    assert "#cached-token: 0," in read_log(proc)


# ---------------------------------------------------------------------------- the benchmark's workload
def gsp_args(*extra: str):
    from sglang import bench_serving

    return bench_serving.parse_args([
        "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "3", "--gsp-prompts-per-group", "4",
        "--gsp-system-prompt-len", "10", "--gsp-question-len", "5", "--gsp-output-len", "7", *extra])


def test_generated_shared_prefix_dataset():
    from sglang import bench_serving

    args = gsp_args("--gsp-range-ratio", "0.4", "--gsp-lora-per-group", "--lora-name", "a", "b")
    specs = bench_serving.build_requests(args, vocab_size=500)
    groups: dict[tuple, list] = {}
    for spec in specs:
        groups.setdefault(tuple(spec.body["input_ids"][:10]), []).append(spec)
    assert len(specs) == 12 and sorted(len(g) for g in groups.values()) == [4, 4, 4]
    assert sorted(g[0].body["lora_path"] for g in groups.values()) == ["a", "a", "b"]
    assert all(len({s.body["lora_path"] for s in g}) == 1 for g in groups.values())  # one adapter per group
    assert all(2 <= len(s.body["input_ids"]) - 10 <= 5 and 2 <= s.output_len <= 7 for s in specs)
    assert len({tuple(s.body["input_ids"]) for s in specs}) == 12  # every request its own question
    order = [next(i for i, k in enumerate(groups) if tuple(s.body["input_ids"][:10]) == k) for s in specs]
    assert order != sorted(order)  # the groups interleave
    with pytest.raises(SystemExit):
        gsp_args("--gsp-lora-per-group")  # needs --lora-name


def test_bench_serving_shared_prefix_reports_hits(server):
    from sglang import bench_serving

    res = bench_serving.main(["--base-url", server[1], "--dataset-name", "generated-shared-prefix",
                              "--gsp-num-groups", "2", "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "40",
                              "--gsp-question-len", "4", "--gsp-output-len", "3", "--max-concurrency", "3",
                              "--gsp-lora-per-group", "--lora-name", "a", "b", "--flush-cache", "--backend", "threads",
                              "--disable-tqdm"])
    assert res["completed"] == 6 and res["failed"] == 0 and res["total_output_tokens"] == 18
    # Four of the six requests reuse their group's system prompt (and the cache started empty).
    assert res["total_cached_tokens"] >= 4 * 40 and 0 < res["cache_hit_rate"] < 1
