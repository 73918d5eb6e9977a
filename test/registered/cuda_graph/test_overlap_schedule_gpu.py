"""The overlap schedule on the GPU, under CUDA graphs and LoRA, against the ordinary schedule (GPU only).

One in-process Scheduler per schedule: the peaked tiny Qwen3 of test_graph_runners_gpu.py, its two
PEFT adapters on 2 slots (a third adapter waits for one), triton attention, csgmv LoRA, breakable
prefill and full decode graphs, float32 with deterministic inference. The same requests, arriving
at the same turns (some while a decode step is in flight, one with a prompt longer than the chunk
and prompt / top logprobs), run

  - ordinary       step by step (--disable-overlap-schedule);
  - overlap        decode steps launched ahead, a prefill admitted while a step is in flight run
                   once that step is finished (SGLANG_OVERLAP_PREFILL=0);
  - overlap+queued the default on one CUDA GPU: such a prefill queued behind the step.

Every request gets the same tokens and finish reason in all three, its logprobs agree within
1e-3 (the schedules batch requests differently, so cuBLAS may sum in another order), the overlap
schedules really overlapped (their counters), and the KV pool and rows are back at the end.
"""

from __future__ import annotations

import pytest

from test_graph_runners_gpu import DECODE_BUCKETS, PREFILL_BUCKETS, assets
from test_scheduler import Harness, prompt

pytestmark = pytest.mark.gpu

TOL = 1e-3
SCHEDULES = {"ordinary": (False, "0"), "overlap": (True, "0"), "overlap+queued": (True, "1")}


def harness(schedule: str, monkeypatch) -> Harness:
    overlap, queued = SCHEDULES[schedule]
    monkeypatch.setenv("SGLANG_OVERLAP_PREFILL", queued)  # read when the Scheduler is built
    monkeypatch.setenv("SGLANG_FORWARD_TIMES", "1")  # the forward clock's CUDA events, every schedule
    ckpt, adapters = assets()
    return Harness(
        ckpt, device="cuda", dtype="float32", attention_backend="triton", max_total_tokens=8192,
        max_running_requests=16, lora_paths=[f"{n}={p}" for n, p in adapters.items()] + [f"c={adapters['a']}"],
        max_loras_per_batch=2, lora_max_wait_turns=4, lora_backend="csgmv", disable_cuda_graph=False,
        cuda_graph_backend_prefill="breakable", cuda_graph_backend_decode="full",
        cuda_graph_bs_prefill=PREFILL_BUCKETS, cuda_graph_bs_decode=DECODE_BUCKETS, chunked_prefill_size=64,
        enable_deterministic_inference=True, enable_overlap_schedule=overlap,
    )


def serve(h: Harness) -> None:
    ids = {ref.lora_name: lid for lid, ref in h.sched.model_runner.lora_manager.refs.items()}

    def submit(rid: str, n: int, seed: int, lora, new: int, **kw) -> None:
        h.submit(rid, prompt(n, seed), max_new_tokens=new, ignore_eos=True, return_logprob=True,
                 lora_id=None if lora is None else ids[lora], **kw)

    arrivals = {
        0: [("a0", 20, 1, "a", 24), ("b0", 12, 2, "b", 18), ("base0", 9, 3, None, 30)],
        3: [("a1", 15, 4, "a", 10)],
        5: [("long", 150, 5, "b", 8, dict(logprob_start_len=0, top_logprobs_num=3))],
        7: [("c0", 11, 6, "c", 12)],  # a third adapter on two slots: it waits for one
        9: [("base1", 30, 7, None, 6, dict(logprob_start_len=3))],
    }
    for turn in range(2000):
        for job in arrivals.get(turn, []):
            submit(*job[:5], **(job[5] if len(job) > 5 else {}))
        ran = h.step()
        report = h.sched.check_integrity()
        assert report["ok"], report["problems"]
        if not ran and not h.sched.waiting and turn > max(arrivals):
            return
    raise AssertionError("the scheduler did not finish in time")


def test_the_overlap_schedules_give_the_ordinary_outputs(monkeypatch):
    runs = {}
    for schedule in SCHEDULES:
        h = harness(schedule, monkeypatch)
        serve(h)
        s = h.sched
        assert s.inflight is None and not s.running and not s.waiting
        assert s.req_to_token_pool.available_size() == s.total_rows
        timed = s.live_info()["forward_seconds"]  # every forward counted once, under its phase
        assert timed["prefill_forwards"] == s.stats["prefill_batches"] and timed["prefill_s"] > 0
        assert timed["decode_forwards"] == s.stats["decode_steps"] and timed["decode_s"] > 0
        runs[schedule] = (h.out, dict(s.stats))
    want, base_stats = runs["ordinary"]
    assert base_stats["overlapped_decode_steps"] == 0
    for schedule in ("overlap", "overlap+queued"):
        got, stats = runs[schedule]
        assert got.keys() == want.keys()
        for rid in want:
            x, y = want[rid], got[rid]
            assert x["ids"] == y["ids"] and x["finish"] == y["finish"], (schedule, rid)
            for key in ("in_lp", "out_lp"):
                p, q = x[key] or [], y[key] or []
                assert [t for _, t in p] == [t for _, t in q], (schedule, rid, key)
                diffs = [abs(u - v) for (u, _), (v, _) in zip(p, q) if u is not None]
                assert max(diffs, default=0.0) <= TOL, (schedule, rid, key, max(diffs))
        assert len(got["long"]["in_lp"]) == 150
        assert stats["overlapped_decode_steps"] > 0, (schedule, stats)
        assert (stats["overlapped_prefills"] > 0) == (schedule == "overlap+queued"), (schedule, stats)
