"""The scheduler in-process, turn by turn, on a tiny Qwen3 checkpoint (real ModelRunner, real pipes).

Covers what is hard to see from outside: chunked prefill keeps prompt logprobs exact, retraction
resumes requests with identical greedy outputs, aborts and failed forwards give every KV slot back,
and the stop conditions.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import re
from typing import Any, Optional

import pytest

from server_helpers import tiny_checkpoint
from sglang.srt.managers.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    FaultInjectionReq,
    GetServerInfoOut,
    GetServerInfoReq,
    TokenizedGenerateReqInput,
)
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.scheduler_output import LOGPROB_FLOOR, json_logprob
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.server_configs import build_run_configs


@pytest.fixture(scope="module")
def ckpt() -> str:
    return tiny_checkpoint("qwen3", seed=0)


class Harness:
    """Drives a Scheduler through real pipes and gathers its BatchTokenIDOut news per request."""

    def __init__(self, model_path: str, **kwargs: Any) -> None:
        args = ServerArgs(**{"model_path": model_path, "device": "cpu", **kwargs})
        self.to_r, self.to_w = mp.Pipe(duplex=False)
        self.from_r, self.from_w = mp.Pipe(duplex=False)
        self.sched = Scheduler(build_run_configs(args).scheduler, self.to_r, self.from_w)
        self.out: dict[str, dict[str, Any]] = {}
        self.max_running_seen = 0

    def submit(self, rid: str, input_ids: list[int], max_new_tokens: int = 8, return_logprob: bool = False,
               logprob_start_len: int = -1, top_logprobs_num: int = 0, stream: bool = True,
               lora_id: Optional[str] = None, cache_salt: Optional[str] = None, **params: Any) -> None:
        sp = SamplingParams.from_dict({"max_new_tokens": max_new_tokens, "temperature": 0.0, **params})
        self.to_w.send(TokenizedGenerateReqInput(
            rid=rid, input_ids=input_ids, sampling_params=sp, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num, stream=stream,
            lora_id=lora_id, cache_salt=cache_salt,
        ))
        self.out[rid] = {"ids": [], "finish": None, "in_lp": None, "out_lp": [], "cached": 0}

    def step(self) -> bool:
        """One scheduler turn; False when there was nothing to run."""
        self.sched.process_messages(block=False)
        ran = self.sched.schedule_turn()
        self.max_running_seen = max(self.max_running_seen, len(self.sched.running))
        self._drain()
        return ran

    def _drain(self) -> None:
        while self.from_r.poll(0):
            msg = self.from_r.recv()
            if not isinstance(msg, BatchTokenIDOut):
                continue
            for i, rid in enumerate(msg.rids):
                rec = self.out[rid]
                rec["ids"] += msg.output_ids[i]
                rec["finish"] = msg.finished_reasons[i]
                rec["cached"] = msg.cached_tokens[i]
                if msg.input_token_logprobs and msg.input_token_logprobs[i] is not None:
                    rec["in_lp"] = msg.input_token_logprobs[i]
                if msg.output_token_logprobs and msg.output_token_logprobs[i] is not None:
                    rec["out_lp"] += msg.output_token_logprobs[i]

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.step() and not self.sched.waiting:
                return
        raise AssertionError("the scheduler did not finish in time")

    def kv_free(self) -> int:
        """Free KV slots, counting the prefix cache's evictable ones (they are given on demand)."""
        return self.sched._kv_available()

    def finish_of(self, rid: str) -> Optional[dict]:
        return self.out[rid]["finish"]


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 37 + i * 11) % 400 + 5 for i in range(n)]


def test_chunked_prefill_matches_unchunked(ckpt: str) -> None:
    ids = prompt(45, 1)
    results = []
    for chunk in (-1, 16):
        h = Harness(ckpt, chunked_prefill_size=chunk)
        h.submit("a", ids, max_new_tokens=6, return_logprob=True, logprob_start_len=3)
        h.run()
        results.append(h.out["a"])
        if chunk == 16:
            assert h.sched.check_integrity()["ok"]
    full, chunked = results
    assert chunked["ids"] == full["ids"]
    assert [t for _, t in chunked["in_lp"]] == ids[3:]
    assert len(full["in_lp"]) == len(ids) - 3
    for (a, ta), (b, tb) in zip(full["in_lp"], chunked["in_lp"]):
        assert ta == tb and abs(a - b) < 1e-4
    for (a, _), (b, _) in zip(full["out_lp"], chunked["out_lp"]):
        assert abs(a - b) < 1e-4


def test_retraction_resumes_with_identical_outputs(ckpt: str) -> None:
    prompts = {f"r{i}": prompt(10 + i, i) for i in range(6)}
    alone = {}
    ref = Harness(ckpt)
    for rid, ids in prompts.items():
        ref.submit(rid, ids, max_new_tokens=14)
        ref.run()
        alone[rid] = ref.out[rid]["ids"]

    h = Harness(ckpt, max_total_tokens=80)  # far less than the ~150 tokens all six need at once
    for rid, ids in prompts.items():
        h.submit(rid, ids, max_new_tokens=14)
    h.run()
    assert h.sched.stats["num_retractions"] > 0
    for rid in prompts:
        assert h.out[rid]["ids"] == alone[rid], rid
        assert h.finish_of(rid)["type"] == "length"
    assert h.kv_free() == 80
    assert h.sched.check_integrity()["ok"]


def test_abort_frees_kv_at_once(ckpt: str) -> None:
    h = Harness(ckpt)
    total = h.kv_free()
    h.submit("keep", prompt(12, 2), max_new_tokens=30)
    h.submit("gone", prompt(20, 3), max_new_tokens=30)
    for _ in range(4):
        h.step()
    assert h.kv_free() < total
    h.to_w.send(AbortReq(rid="gone"))
    h.step()
    assert "gone" not in h.sched.rid_to_req
    used_by_keep = h.sched.rid_to_req["keep"].kv_len
    assert h.kv_free() == total - used_by_keep
    h.run()
    assert h.kv_free() == total and h.sched.check_integrity()["ok"]


def test_failed_forward_fails_only_its_batch(ckpt: str) -> None:
    h = Harness(ckpt, enable_test_hooks=True)
    h.submit("steady", prompt(12, 4), max_new_tokens=10)
    h.step()  # prefill of "steady"
    h.to_w.send(FaultInjectionReq(rid_substring="boom"))
    h.submit("boom-1", prompt(9, 5), max_new_tokens=10)
    h.step()  # prefill of "boom-1" raises
    fin = h.finish_of("boom-1")
    assert fin["type"] == "abort" and fin["status_code"] == 500 and "injected fault" in fin["message"]
    h.run()
    assert h.finish_of("steady")["type"] == "length" and len(h.out["steady"]["ids"]) == 10
    assert h.sched.stats["num_forward_failures"] == 1
    assert h.kv_free() == h.sched.max_total_num_tokens and h.sched.check_integrity()["ok"]


def test_max_new_tokens_zero_returns_prompt_logprobs_only(ckpt: str) -> None:
    h = Harness(ckpt)
    ids = prompt(15, 6)
    h.submit("z", ids, max_new_tokens=0, return_logprob=True, logprob_start_len=0)
    h.run()
    rec = h.out["z"]
    assert rec["ids"] == [] and rec["finish"]["type"] == "length"
    assert rec["in_lp"][0] == (None, ids[0]) and [t for _, t in rec["in_lp"]] == ids


def test_stop_conditions(ckpt: str) -> None:
    h = Harness(ckpt)
    ids = prompt(14, 7)
    h.submit("base", ids, max_new_tokens=12, ignore_eos=True)
    h.run()
    base = h.out["base"]["ids"]
    assert len(base) == 12
    stop_tok = base[4]
    h.submit("tok", ids, max_new_tokens=12, ignore_eos=True, stop_token_ids=[stop_tok])
    h.run()
    first = base.index(stop_tok)
    assert h.out["tok"]["ids"] == base[: first + 1]
    assert h.finish_of("tok") == {"type": "stop", "matched": stop_tok}

    tokenizer = h.sched.stop_checker.tokenizer
    match = re.search(r"[A-Za-z]{3,}", tokenizer.decode(base))
    assert match, "the reference output should contain a word to use as a stop string"
    stop = match.group(0)
    h.submit("str", ids, max_new_tokens=12, ignore_eos=True, stop=[stop])
    h.run()
    got = h.out["str"]["ids"]
    assert h.finish_of("str") == {"type": "stop", "matched": stop}
    assert got == base[: len(got)]
    assert stop in tokenizer.decode(got) and stop not in tokenizer.decode(got[:-1])


def test_max_running_requests_is_respected(ckpt: str) -> None:
    h = Harness(ckpt, max_running_requests=2)
    for i in range(5):
        h.submit(f"m{i}", prompt(8, 10 + i), max_new_tokens=5)
    h.run()
    assert h.max_running_seen == 2
    assert all(len(h.out[f"m{i}"]["ids"]) == 5 for i in range(5))
    # The counters a serving benchmark reads (mean running batch = decode_reqs / decode_steps).
    stats = h.sched.stats
    assert stats["prefill_tokens"] == 5 * 8 and stats["prefill_batches"] >= 3
    assert stats["decode_reqs"] == 5 * 4  # the first token of each comes from its prefill
    assert stats["decode_steps"] >= 10 and stats["decode_reqs"] <= 2 * stats["decode_steps"]


def test_max_queued_requests_refuses_arrivals_past_the_queue_with_a_503(ckpt: str) -> None:
    h = Harness(ckpt, max_running_requests=1, max_queued_requests=2)
    for i in range(5):  # one message turn: all five arrive before anything is admitted
        h.submit(f"q{i}", prompt(8, 20 + i), max_new_tokens=4)
    h.run()
    refused = [f"q{i}" for i in range(5) if (h.finish_of(f"q{i}") or {}).get("status_code") == 503]
    assert refused == ["q2", "q3", "q4"]
    for rid in refused:
        assert h.out[rid]["ids"] == [] and "--max-queued-requests 2" in h.finish_of(rid)["message"]
    assert all(len(h.out[f"q{i}"]["ids"]) == 4 for i in (0, 1))
    assert h.sched.stats["num_rejected_queue_full"] == 3
    # Room again once the queue has drained; the refusals held nothing.
    h.submit("later", prompt(8, 30), max_new_tokens=4)
    h.run()
    assert len(h.out["later"]["ids"]) == 4 and not h.sched.rid_to_req
    assert h.kv_free() == h.sched.max_total_num_tokens


def test_server_info_while_idle_reports_a_current_integrity_check(ckpt: str) -> None:
    """A request that arrives and is aborted within one message turn never makes the scheduler
    busy for a turn; the info asked right after must still describe the pools as they are."""
    h = Harness(ckpt)
    h.submit("warm", prompt(12, 40), max_new_tokens=3)
    h.run()  # cached now: the aborted request below takes a cached prefix and gives it back
    runs = h.sched.last_integrity_check["runs"]
    h.submit("gone", prompt(12, 40) + [7, 8], max_new_tokens=3)
    h.to_w.send(AbortReq(rid="gone"))
    h.to_w.send(GetServerInfoReq())
    h.sched.process_messages(block=False)
    info = next(m.info for m in iter(h.from_r.recv, None) if isinstance(m, GetServerInfoOut))
    check = info["last_integrity_check"]
    assert check["runs"] > runs and check["ok"] and check["idle"], check
    assert info["kv_free_tokens"] == check["kv_free"] and info["kv_evictable_tokens"] == check["kv_evictable"]


def test_logprobs_are_strict_json():
    """-inf is floored and NaN reported as null, so a response always serialises."""
    assert json_logprob(-1.5) == -1.5
    assert json_logprob(float("-inf")) == LOGPROB_FLOOR
    assert json_logprob(float("nan")) is None
    json.dumps([json_logprob(v) for v in (0.0, float("-inf"), float("nan"))], allow_nan=False)


def test_tokenizer_loads_while_the_model_runner_starts(ckpt: str, monkeypatch) -> None:
    """The scheduler's tokenizer (stop strings) is not loaded after the model, KV cache and graphs
    but beside them: the load is already running when the ModelRunner starts, and the model
    runner finishes only once it has seen that (a serial start-up would time out here)."""
    import threading

    import sglang.srt.configs.tokenizer as tokenizer_mod
    import sglang.srt.managers.scheduler as scheduler_mod

    load_began, runner_began = threading.Event(), threading.Event()
    real_load, real_runner = tokenizer_mod.load_tokenizer, scheduler_mod.ModelRunner
    threads = []

    def load(spec):
        threads.append(threading.current_thread().name)
        load_began.set()
        assert runner_began.wait(30), "the model runner never started while the tokenizer loaded"
        return real_load(spec)

    def runner(*args, **kwargs):
        runner_began.set()
        assert load_began.wait(30), "the tokenizer load had not begun when the model runner started"
        return real_runner(*args, **kwargs)

    monkeypatch.setattr(tokenizer_mod, "load_tokenizer", load)
    monkeypatch.setattr(scheduler_mod, "ModelRunner", runner)
    h = Harness(ckpt)
    assert threads and threads[0] != threading.main_thread().name
    assert h.sched.stop_checker.tokenizer is not None
    h.submit("r", [1, 2, 3], max_new_tokens=2)
    h.run()
    assert len(h.out["r"]["ids"]) == 2


def test_graphs_are_captured_after_the_tokenizer_load(ckpt: str, monkeypatch) -> None:
    """The tokenizer's load (an import that holds the GIL) has ended when the model runner starts
    its graph capture: beside it, the capture's CUDA calls would each wait for the GIL. While it
    loads, the GIL switch interval is short, and it is restored after."""
    import sys
    import time

    import sglang.srt.configs.tokenizer as tokenizer_mod
    from sglang.srt.model_executor.model_runner import ModelRunner

    real_load, real_graphs = tokenizer_mod.load_tokenizer, ModelRunner.init_cuda_graphs
    load_ended, graphs_began, intervals = [], [], []
    before = sys.getswitchinterval()

    def load(spec):
        intervals.append(sys.getswitchinterval())
        time.sleep(0.5)  # longer than the rest of a tiny model runner's start
        tok = real_load(spec)
        load_ended.append(time.perf_counter())
        return tok

    def graphs(self):
        graphs_began.append(time.perf_counter())
        return real_graphs(self)

    monkeypatch.setattr(tokenizer_mod, "load_tokenizer", load)
    monkeypatch.setattr(ModelRunner, "init_cuda_graphs", graphs)
    h = Harness(ckpt)
    assert len(load_ended) == len(graphs_began) == 1 and graphs_began[0] >= load_ended[0]
    assert h.sched.stop_checker.tokenizer is not None
    assert intervals == [min(before, tokenizer_mod.LOAD_SWITCH_INTERVAL_S)] and sys.getswitchinterval() == before


@pytest.mark.parametrize("first_done", ["first", "second"])
def test_two_overlapping_tokenizer_loads_restore_the_switch_interval(monkeypatch, first_done: str) -> None:
    """Two background loads that overlap in one process, ending in either order: the process's own
    interval is back after both (never left at the short one). When the later-started load ends
    first, the earlier one keeps the short interval while it runs."""
    import sys
    import threading

    import sglang.srt.configs.tokenizer as tokenizer_mod

    gates = {"a": threading.Event(), "b": threading.Event()}
    monkeypatch.setattr(tokenizer_mod, "load_tokenizer", lambda spec: gates[spec.path].wait(30) and spec.path)
    before = sys.getswitchinterval()
    a = tokenizer_mod.start_tokenizer_load(tokenizer_mod.TokenizerSpec("a"))
    b = tokenizer_mod.start_tokenizer_load(tokenizer_mod.TokenizerSpec("b"))
    order = ("a", "b") if first_done == "first" else ("b", "a")
    gates[order[0]].set()
    assert {"a": a, "b": b}[order[0]].result(30) == order[0]
    if first_done == "second":
        assert sys.getswitchinterval() == min(before, tokenizer_mod.LOAD_SWITCH_INTERVAL_S)
    gates[order[1]].set()
    assert {"a": a, "b": b}[order[1]].result(30) == order[1]
    assert sys.getswitchinterval() == before
