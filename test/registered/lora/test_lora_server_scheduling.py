"""Adapter slots under load, through a real server with `--max-loras-per-batch 2`.

Four adapters (one pinned, given in the JSON form of --lora-paths) share two adapter slots (the
base model needs none), and the pinned adapter always holds one of them: every batch has at most
one other adapter, so nearly every switch between adapters evicts one. Checked: concurrent requests for more
distinct adapters than slots all complete with the outputs they get alone; the pinned adapter is
never evicted (its slot, read from /get_server_info, never changes); and a request for an adapter
that does not fit completes within a bounded time while a steady stream of requests for a running
adapter keeps the slots busy; and unloading an adapter whose request waits for a slot waits for
that request to complete in full, refuses new requests for it at once, and loses nothing else.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from lora_server_testlib import (PROMPTS, load_adapter, lora_info, post, server_info, tiny_lora_checkpoint, unload_adapter,
                                 write_adapters)
from server_helpers import kill_server, popen_launch_server, read_log

SPECS = {
    "a": dict(r=4, seed=21),
    "b": dict(r=8, target_modules=["q_proj", "v_proj"], seed=22, b_std=0.05),
    "c": dict(r=16, lora_alpha=8, target_modules="all-linear", use_rslora=True, seed=23),
    "p": dict(r=8, seed=24),
}
MAX_WAIT_TURNS = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = tiny_lora_checkpoint("llama")
    paths = write_adapters(ckpt, str(tmp_path_factory.mktemp("sched-adapters")), SPECS)
    specs = [f"{n}={paths[n]}" for n in ("a", "b", "c")]
    specs.append(json.dumps({"lora_name": "p", "lora_path": paths["p"], "pinned": True}))
    proc, url = popen_launch_server(ckpt, [
        "--device", "cpu", "--dtype", "float32", "--lora-backend", "torch_native",
        "--max-loras-per-batch", "2", "--lora-max-wait-turns", str(MAX_WAIT_TURNS),
        "--max-total-tokens", "4096", "--lora-paths", *specs,
    ])
    yield proc, url, paths
    assert kill_server(proc) == 0, read_log(proc)[-3000:]


def run(url: str, lora, prompt, n: int = 8, timeout: float = 300) -> list[int]:
    r = post(url, "/generate", {"input_ids": prompt, "lora_path": lora,
                                "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}},
             timeout=timeout)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["meta_info"]["completion_tokens"] == n
    return out["output_ids"]


def test_pinned_adapter_is_configured(server) -> None:
    info = lora_info(server[1])
    assert info["pinned_adapters"] == ["p"]
    assert len(info["pool_slots"]) == 2 and set(info["loaded_adapters"]) == {"a", "b", "c", "p"}


def test_more_adapters_than_slots_all_complete(server) -> None:
    url = server[1]
    jobs = [(lora, PROMPTS[i % len(PROMPTS)]) for i, lora in enumerate(["a", "b", "c", None, "p"])] * 3
    alone = {i: run(url, lora, prompt) for i, (lora, prompt) in enumerate(jobs[:5])}
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(run, url, lora, prompt) for lora, prompt in jobs]
        outs = [f.result(timeout=300) for f in futures]
    for i, out in enumerate(outs):
        assert out == alone[i % 5], f"request {i} ({jobs[i][0]}) differs from the same request alone"
    # Distinct adapters give distinct outputs, so the requests were not served by the wrong slot.
    assert len({tuple(alone[i]) for i in range(5)}) == 5
    info = lora_info(url)
    assert "p" in info["resident_adapters"] and len(info["pool_slots"]) == 2


def test_pinned_adapter_is_never_evicted(server) -> None:
    url = server[1]
    run(url, "p", PROMPTS[0], n=1)
    slot = lora_info(url)["pool_slots"].index("p")
    last = None
    for lora in ["a", None, "b", "c", "a", None, "c"]:
        run(url, lora, PROMPTS[1], n=2)
        slots = lora_info(url)["pool_slots"]
        assert slots[slot] == "p", f"after a request for {lora!r}: {slots}"
        # The other slot is the one that moved: it holds the adapter used last (a base request
        # needs no slot and leaves it alone).
        last = lora if lora is not None else last
        assert slots[1 - slot] == last


def test_waiting_adapter_is_not_starved_by_a_running_one(server) -> None:
    """Steady traffic for adapter a (six clients, staggered lengths) keeps a's requests
    overlapping, so a always holds the only free slot. A request for b must still complete: after
    MAX_WAIT_TURNS turns the scheduler stops admitting a's requests until they drain. (Under the
    earlier rule, which only kept new adapters out, b waited until the clients stopped.)"""
    url = server[1]
    stop = threading.Event()
    done: list[int] = []
    errors: list[BaseException] = []

    def stream_a(k: int) -> None:
        try:
            while not stop.is_set():
                run(url, "a", PROMPTS[k % len(PROMPTS)], n=16 + 5 * k)
                done.append(k)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=stream_a, args=(k,), daemon=True) for k in range(6)]
    for t in threads:
        t.start()
    try:
        # Let a's requests overlap: wait until some have completed (a fixed sleep was too short
        # on a loaded 2-core machine, and the check below then failed).
        deadline = time.monotonic() + 60
        while len(done) < 2 and not errors and time.monotonic() < deadline:
            time.sleep(0.05)
        started = len(done)
        t0 = time.monotonic()
        out = run(url, "b", PROMPTS[2], n=4, timeout=60)
        waited = time.monotonic() - t0
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors, errors
    assert len(out) == 4
    assert waited < 30, f"the request for b waited {waited:.1f} s"
    assert started > 0, "the stream of a's requests never got going"


def test_unloading_an_adapter_whose_request_waits_for_a_slot(server) -> None:
    """a holds the only free slot with a long request; c's request waits for it. Unloading c then
    waits until c's request has completed in full (it was accepted, so it is served), new requests
    for c are refused at once with a clear message, and a's request completes untouched."""
    url, paths = server[1], server[2]
    results: dict[str, object] = {}

    def call(key: str, fn, *args, **kwargs) -> None:
        try:
            results[key] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - reported below
            results[key] = e

    # a's request must still hold the slot when c's arrives: it is seen running before c is sent
    # (a may be resident from an earlier test, before its request arrives), and it is long (its
    # 1,000 tokens take seconds, against the milliseconds c's request takes to arrive).
    n_a = 1000
    long_a = threading.Thread(target=call, args=("a", run, url, "a", PROMPTS[0]), kwargs={"n": n_a})
    long_a.start()
    deadline = time.monotonic() + 60
    while not (server_info(url)["num_running_reqs"] and "a" in lora_info(url)["resident_adapters"]):
        assert time.monotonic() < deadline, "a's request never started"
        time.sleep(0.02)
    waiting_c = threading.Thread(target=call, args=("c", run, url, "c", PROMPTS[1]), kwargs={"n": 4})
    waiting_c.start()
    deadline = time.monotonic() + 60
    while "c" not in lora_info(url)["waiting_adapters"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "c" in lora_info(url)["waiting_adapters"] and "c" not in lora_info(url)["resident_adapters"]
    unload = threading.Thread(target=call, args=("unload", unload_adapter, url, "c"))
    unload.start()
    deadline = time.monotonic() + 30
    refused = None
    while time.monotonic() < deadline:  # the name is gone at once, while c's request still waits
        r = post(url, "/generate", {"input_ids": PROMPTS[2], "lora_path": "c",
                                    "sampling_params": {"max_new_tokens": 2}})
        if r.status_code != 200:
            refused = r
            break
    for t in (long_a, waiting_c, unload):
        t.join(300)
    assert refused is not None and refused.status_code == 400, refused
    assert "c" in refused.json()["error"]["message"] and "not loaded" in refused.json()["error"]["message"]
    # Unloaded while it waited for a slot, c's request was still served in full: the unload waited.
    assert isinstance(results["c"], list) and len(results["c"]) == 4, results["c"]
    assert len(results["a"]) == n_a, results["a"]
    assert results["unload"].status_code == 200 and results["unload"].json()["success"] is True
    assert "c" not in lora_info(url)["loaded_adapters"]
    assert load_adapter(url, "c", paths["c"]).status_code == 200  # as the other tests expect
    assert run(url, "c", PROMPTS[1], n=4) == results["c"]  # the waiting request got c's own answer


def test_requests_that_need_no_slot_run_while_an_adapter_drains_the_slots(server) -> None:
    """a holds the only free slot with a long request and c waits past MAX_WAIT_TURNS, so the slots
    drain for c. Base-model requests and the pinned adapter's need no slot c could take: they must
    still run, not wait behind a's whole request (they did, for as long as a's longest request ran)."""
    url = server[1]
    progress: list[int] = []
    results: dict[str, object] = {}
    # a's request must outlast c's arrival, MAX_WAIT_TURNS * 3 of its steps and the base and pinned
    # requests (milliseconds each): its 1,000 tokens take seconds.
    n_a = 1000

    def stream_a() -> None:
        body = {"input_ids": PROMPTS[0], "lora_path": "a", "stream": True,
                "sampling_params": {"max_new_tokens": n_a, "temperature": 0, "ignore_eos": True}}
        with requests.post(f"{url}/generate", json=body, stream=True, timeout=300) as r:
            for line in r.iter_lines(decode_unicode=True):
                if line.startswith("data: {"):
                    progress.append(json.loads(line[6:])["meta_info"]["completion_tokens"])
        results["a"] = progress[-1] if progress else None

    def call_c() -> None:
        results["c"] = run(url, "c", PROMPTS[1], n=4)

    long_a = threading.Thread(target=stream_a)
    long_a.start()
    deadline = time.monotonic() + 60
    while not progress and time.monotonic() < deadline:
        time.sleep(0.02)
    waiting_c = threading.Thread(target=call_c)
    waiting_c.start()
    deadline = time.monotonic() + 60
    while "c" not in lora_info(url)["waiting_adapters"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "c" in lora_info(url)["waiting_adapters"]
    # Each of a's decode steps is a turn c is turned away: past MAX_WAIT_TURNS of them, c starves.
    seen = progress[-1]
    deadline = time.monotonic() + 60
    while progress[-1] < seen + 3 * MAX_WAIT_TURNS and time.monotonic() < deadline:
        time.sleep(0.02)
    base = run(url, None, PROMPTS[2], n=4, timeout=120)
    pinned = run(url, "p", PROMPTS[2], n=4, timeout=120)
    still_running = long_a.is_alive() and progress[-1] < n_a
    a_tokens_then = progress[-1]
    long_a.join(300)
    waiting_c.join(300)
    assert len(base) == 4 and len(pinned) == 4
    assert still_running, f"the base and pinned requests finished only after a's {n_a} tokens ({a_tokens_then})"
    assert results["a"] == n_a and results["c"] is not None and len(results["c"]) == 4
