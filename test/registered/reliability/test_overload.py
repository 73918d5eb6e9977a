"""Overload: more requests than request slots and KV, more adapters than LoRA slots, long and short
prompts mixed, chunked prefill on (CPU, a real server, and the scheduler in process).

The server has 4 running-request slots, a 256-token KV pool, 32-token prefill chunks and 2 LoRA
adapter slots (the base model needs none) for 4 adapters. Checked:
  * a burst of concurrent requests all completes, queued, retracted and resumed, with adapters
    evicted and loaded again, and every greedy output (tokens and their logprobs) equals the same
    request run alone;
  * under steady closed-loop load from several clients, including one whose adapter nobody else
    uses, no request waits unboundedly: fewer than a quarter of the run's requests end while any
    one of them runs;
  * the round that crashed upstream (sglang#23141): N adapters plus the base model arriving
    together while a chunked prefill is staged. In process, every turn's batch together with
    the running and chunked requests uses at most --max-loras-per-batch distinct adapters.
Afterwards nothing leaks (KV, rows, adapter references) and both integrity checks are clean.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import pytest
import requests

from lora_server_testlib import post, tiny_lora_checkpoint, write_adapters
from reliability_lib import assert_no_leaks, server_info, wait_idle
from server_helpers import kill_server, popen_launch_server, read_log

SPECS = {
    "a": dict(r=4, seed=71),
    "b": dict(r=8, target_modules=["q_proj", "v_proj"], seed=72),
    "c": dict(r=16, lora_alpha=8, target_modules="all-linear", use_rslora=True, seed=73),
    "d": dict(r=8, seed=74),
}
LORAS = ["a", "b", "c", "d", None]
KV_TOKENS = 256
SLOTS = 2


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 131 + i * 37) % 500 + 3 for i in range(n)]


# (adapter, prompt, max_new_tokens): long prompts take 3-4 chunks, short ones fit in one.
JOBS: list[tuple[Optional[str], list[int], int]] = [
    (LORAS[i % 5], prompt(96 if i % 3 == 0 else 7 + i, i), 40 if i % 2 else 12) for i in range(15)
]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    ckpt = tiny_lora_checkpoint("llama")
    return write_adapters(ckpt, str(tmp_path_factory.mktemp("overload")), SPECS)


@pytest.fixture(scope="module")
def server(adapters):
    proc, url = popen_launch_server(tiny_lora_checkpoint("llama"), [
        "--device", "cpu", "--dtype", "float32", "--lora-backend", "torch_native",
        "--max-running-requests", "4", "--max-total-tokens", str(KV_TOKENS), "--chunked-prefill-size", "32",
        "--max-loras-per-batch", str(SLOTS), "--lora-max-wait-turns", "8", "--decode-log-interval", "1000",
        "--lora-paths", *[f"{n}={p}" for n, p in adapters.items()],
    ])
    yield proc, url
    assert kill_server(proc) == 0, read_log(proc)[-3000:]


def run(url: str, lora: Optional[str], ids: list[int], n: int) -> dict:
    r = post(url, "/generate", {"input_ids": ids, "lora_path": lora, "return_logprob": True,
                                "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["meta_info"]["completion_tokens"] == n, out["meta_info"]
    return {"ids": out["output_ids"], "lp": [e[0] for e in out["meta_info"]["output_token_logprobs"]]}


def assert_same(got: dict, want: dict, what: str) -> None:
    assert got["ids"] == want["ids"], what
    # Batched with other neighbours, matmuls of other shapes may round differently in float32.
    assert max(abs(a - b) for a, b in zip(got["lp"], want["lp"])) <= 1e-4, what


@pytest.fixture(scope="module")
def alone(server) -> list[dict]:
    return [run(server[1], *job) for job in JOBS]


def test_burst_beyond_every_limit_completes_with_the_outputs_of_requests_alone(server, alone) -> None:
    url = server[1]
    before = server_info(url)
    with ThreadPoolExecutor(len(JOBS) * 3) as pool:
        futures = [pool.submit(run, url, *JOBS[i % len(JOBS)]) for i in range(len(JOBS) * 3)]
        outs = [f.result(timeout=600) for f in futures]
    for i, out in enumerate(outs):
        assert_same(out, alone[i % len(JOBS)], f"request {i} ({JOBS[i % len(JOBS)][0]})")
    info = wait_idle(url)
    assert_no_leaks(info)
    assert info["num_retractions"] > before["num_retractions"], "the KV pool never ran out: not an overload"
    lora = info["lora"]
    assert lora["num_evictions"] > before["lora"]["num_evictions"] and len(lora["pool_slots"]) == SLOTS
    assert info["num_forward_failures"] == 0
    assert "KV cache pool is full. Retract requests." in read_log(server[0])
    print(f"[overload] burst of {len(outs)}: retractions {info['num_retractions'] - before['num_retractions']}, "
          f"adapter loads {lora['num_adapter_loads'] - before['lora']['num_adapter_loads']}, "
          f"evictions {lora['num_evictions'] - before['lora']['num_evictions']}")


def test_no_request_waits_unboundedly(server) -> None:
    """Six closed-loop clients for `duration` seconds: four on mixed adapters, one on the base model
    and one on adapter d alone. A starved client would wait until the others stop, i.e. about the
    whole run; every request must instead finish while fewer than a quarter of the run's requests
    end, and the client on the adapter nobody else uses must get a fair share of the completions.
    The wait is counted in requests that ended meanwhile, not in seconds: a loaded machine slows
    every request alike, which leaves that count where it was but stretches a latency."""
    url = server[1]
    # The run is long against one request's time on this machine, so that "under a quarter of the
    # run's requests" tells starvation apart from a busy server: at least 30 times the largest job alone.
    solo = []
    for k in range(3):
        t0 = time.monotonic()
        run(url, "c", prompt(90, k), 32)
        solo.append(time.monotonic() - t0)
    duration = max(10.0, 30 * max(solo))
    stop_at = time.monotonic() + duration
    latencies: dict[str, list[float]] = {}
    waits: dict[str, list[int]] = {}  # per client: the requests (of any client) that ended while each ran
    ended = [0]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def client(name: str, loras: list[Optional[str]], seed: int) -> None:
        rng = random.Random(seed)
        try:
            while time.monotonic() < stop_at:
                lora = rng.choice(loras)
                ids = prompt(rng.choice([6, 20, 90]), rng.randrange(1000))
                t0, since = time.monotonic(), ended[0]
                run(url, lora, ids, rng.choice([4, 16, 32]))
                with lock:
                    latencies.setdefault(name, []).append(time.monotonic() - t0)
                    waits.setdefault(name, []).append(ended[0] - since)
                    ended[0] += 1
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    clients = [(f"mixed{k}", ["a", "b", "c"], k) for k in range(4)] + [("base", [None], 9), ("d-only", ["d"], 10)]
    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=c, daemon=True) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    run_time = time.monotonic() - t0
    assert not errors, errors
    worst = {name: max(v) for name, v in latencies.items()}
    assert set(worst) == {c[0] for c in clients}, f"some client never completed a request: {latencies.keys()}"
    longest = {name: max(v) for name, v in waits.items()}
    assert max(longest.values()) < ended[0] / 4, \
        f"requests ended meanwhile, worst per client {longest}, of {ended[0]} (latencies {worst}, {run_time:.1f} s run)"
    mixed = [len(latencies[f"mixed{k}"]) for k in range(4)]
    assert len(latencies["d-only"]) >= 0.25 * sum(mixed) / len(mixed), {k: len(v) for k, v in latencies.items()}
    print(f"[overload] {sum(map(len, latencies.values()))} requests in {run_time:.1f} s; worst latency per client "
          + ", ".join(f"{k} {v:.2f}s/{len(latencies[k])} reqs ({longest[k]} ended meanwhile)" for k, v in worst.items()))
    assert_no_leaks(wait_idle(url))


# ---------------------------------------------------------------------------- the upstream crash, in process
def test_adapters_plus_base_around_a_chunked_prefill_in_process(adapters) -> None:
    """sglang#23141: a chunked prefill staged for adapter a, and requests for b, c and the base
    model arriving in the same round, used to build a batch of N + 1 adapters and kill the server.
    Here every turn must respect the 2 slots (counting the chunked and running requests), nothing
    fails, and every request's output equals its output alone."""
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.server_configs import build_run_configs

    args = ServerArgs(model_path=tiny_lora_checkpoint("llama"), device="cpu", dtype="float32",
                      lora_backend="torch_native", max_loras_per_batch=SLOTS, chunked_prefill_size=16,
                      max_total_tokens=KV_TOKENS, lora_max_wait_turns=4,
                      lora_paths=[f"{n}={p}" for n, p in adapters.items()])
    to_r, to_w = mp.Pipe(duplex=False)
    from_r, from_w = mp.Pipe(duplex=False)
    sched = Scheduler(build_run_configs(args).scheduler, to_r, from_w)
    names = {ref.lora_name: lora_id for lora_id, ref in sched.model_runner.lora_manager.refs.items()}
    jobs = [("long-a", "a", prompt(70, 1)), ("b", "b", prompt(9, 2)), ("base", None, prompt(11, 3)),
            ("c", "c", prompt(8, 4)), ("d", "d", prompt(12, 5)), ("base2", None, prompt(5, 6))]
    outputs: dict[str, list[int]] = {}

    def submit(rid: str, lora: Optional[str], ids: list[int]) -> None:
        sp = SamplingParams.from_dict({"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True})
        sched.add_request(TokenizedGenerateReqInput(rid=rid, input_ids=ids, sampling_params=sp,
                                                    lora_id=None if lora is None else names[lora]))
        outputs[rid] = []

    def run_turns() -> int:
        widest = 0
        for _ in range(1000):
            batch = sched.get_next_batch()
            if batch is None:
                assert not sched.waiting, "requests wait but nothing can run"
                return widest
            mode, reqs = batch
            in_pool = ({r.lora_id for r in sched._holders()} | {r.lora_id for r in reqs}) - {None}
            widest = max(widest, len(in_pool))
            assert len(in_pool) <= SLOTS, f"a batch with {len(in_pool)} adapters for {SLOTS} slots"
            sched.run_batch(mode, reqs)
            while from_r.poll(0):  # drain the news so the pipe never fills
                from_r.recv()
            for r in reqs:
                if r.finished:
                    outputs[r.rid] = list(r.output_ids)
        raise AssertionError("the scheduler did not finish")

    for rid, lora, ids in jobs:  # each alone first
        submit(f"alone-{rid}", lora, ids)
        run_turns()
    for rid, lora, ids in jobs:  # then all in the same round, the long one first (chunked)
        submit(rid, lora, ids)
    widest = run_turns()
    assert widest == SLOTS and sched.stats["num_forward_failures"] == 0
    for rid, _, _ in jobs:
        assert outputs[rid] == outputs[f"alone-{rid}"] and len(outputs[rid]) == 10, rid
    assert sched.check_integrity()["ok"]


def test_a_full_queue_refuses_with_a_503_and_the_server_goes_on() -> None:
    """--max-queued-requests: with one request running and one waiting, the next gets a 503 in the
    OpenAI error envelope at once (a load balancer retries it elsewhere); both others complete."""
    import openai

    from server_helpers import tiny_checkpoint

    proc, url = popen_launch_server(tiny_checkpoint("qwen3"), [
        "--device", "cpu", "--max-running-requests", "1", "--max-queued-requests", "1", "--decode-log-interval", "1000",
    ])
    try:
        long_params = {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}
        with ThreadPoolExecutor(2) as pool:
            # Streamed so that its first chunk shows it running; the second then waits behind it.
            running = requests.post(f"{url}/generate", json={"input_ids": prompt(8, 1), "stream": True,
                                                              "sampling_params": long_params}, stream=True)
            assert running.status_code == 200
            lines = running.iter_lines()
            assert next(line for line in lines if line).startswith(b"data:")
            waiting = pool.submit(post, url, "/generate", {"input_ids": prompt(8, 2),
                                                           "sampling_params": {"max_new_tokens": 3}})
            deadline = time.monotonic() + 60
            while server_info(url)["num_waiting_reqs"] < 1:
                assert time.monotonic() < deadline and not waiting.done()
                time.sleep(0.05)
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            with pytest.raises(openai.APIStatusError) as e:
                client.completions.create(model="default", prompt="one more", max_tokens=3)
            assert e.value.status_code == 503
            assert "request queue is full" in e.value.body["message"] and "--max-queued-requests 1" in e.value.body["message"]
            refused = post(url, "/generate", {"input_ids": prompt(8, 3), "sampling_params": {"max_new_tokens": 3}})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == 503
            assert next(line for line in lines if line).startswith(b"data:")  # it streams on
            running.close()  # a disconnect aborts it, so the waiting one runs
            assert waiting.result(timeout=120).status_code == 200
        assert server_info(url)["num_rejected_queue_full"] == 2
        after = post(url, "/generate", {"input_ids": prompt(8, 4), "sampling_params": {"max_new_tokens": 3}})
        assert after.status_code == 200 and after.json()["meta_info"]["completion_tokens"] == 3
        # A batch the queue takes only in part: one request is admitted, the other two refused.
        # The reply is the 503 at once, and the admitted one is aborted, not run to its end.
        before = wait_idle(url)
        batch = post(url, "/generate", {"input_ids": [prompt(8, 5), prompt(8, 6), prompt(8, 7)],
                                        "sampling_params": long_params})
        assert batch.status_code == 503 and "request queue is full" in batch.json()["error"]["message"]
        info = wait_idle(url)  # the abort of the admitted one was sent before the reply
        assert info["num_finished"] == before["num_finished"] + 3
        assert_no_leaks(info)
        assert info["num_rejected_queue_full"] == 4 and info["decode_reqs"] - before["decode_reqs"] < long_params["max_new_tokens"] - 1
    finally:
        assert kill_server(proc) == 0, read_log(proc)[-3000:]
