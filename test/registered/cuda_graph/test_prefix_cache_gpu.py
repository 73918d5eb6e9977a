"""Prefix-cache hits served by the prefill CUDA graphs, with LoRA (GPU only).

One in-process Scheduler per prefill graph backend (breakable, full) and dtype: the peaked tiny
Qwen3 of test_graph_runners_gpu.py, its two PEFT adapters, triton attention, csgmv LoRA. For the base
model and each adapter, a request over a 200-token system prompt and a 40-token question runs
uncached, then again with the system prompt from the cache (its prompt logprobs start at the
question, so the hit stops there), alone and in a mixed batch:
  - cached and uncached prompt logprobs agree within 1e-2 in float32 (no tf32 anywhere: cuBLAS,
    attention and LoRA dots are ieee fp32). In bf16 the two paths run GEMMs of other row counts
    (241 rows against 41), which cuBLAS rounds differently; this model's logits reach ~35, where a
    bf16 ulp is 0.25, and the H200 run of 2026-11-30 measured 0.155 (one logit ulp) against an
    exact 0 on the CPU. So bf16 allows 2 ulps at the row's largest |logprob| (about 0.5 here): a
    wrong prefix or adapter moves this peaked model's logprobs by whole nats;
  - the adapter still moves the logprobs (> 5e-2) on the cached path;
  - the log shows `cuda graph: True` for prefill batches with `#cached-token` > 0 (so the graph,
    not an eager fallback, served the hits), and the KV accounting is clean at the end.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch

from test_graph_runners_gpu import DECODE_BUCKETS, PREFILL_BUCKETS, assets
from test_scheduler import Harness

pytestmark = pytest.mark.gpu

TOL = 1e-2
LORA_EFFECT = 5e-2
SYSTEM = [(i * 31 + 17) % 480 + 5 for i in range(200)]
QUESTIONS = [[(i * 7 + 3 * k) % 480 + 5 for i in range(40)] for k in range(3)]
START = len(SYSTEM) + 1  # prompt logprobs from the first question token: the hit covers SYSTEM
HIT_LINE = re.compile(r"Prefill batch, .*#cached-token: [1-9]\d*, .*cuda graph: True")


@functools.lru_cache(maxsize=None)
def harness(prefill: str, dtype: str) -> Harness:
    ckpt, adapters = assets()
    return Harness(
        ckpt, device="cuda", dtype=dtype, attention_backend="triton", max_total_tokens=16384,
        max_running_requests=32, lora_paths=[f"{n}={p}" for n, p in adapters.items()], max_loras_per_batch=3,
        lora_backend="csgmv", disable_cuda_graph=False, cuda_graph_backend_prefill=prefill,
        cuda_graph_backend_decode="full", cuda_graph_bs_prefill=PREFILL_BUCKETS, cuda_graph_bs_decode=DECODE_BUCKETS,
        enable_deterministic_inference=True,
    )


def lora_id(h: Harness, name):
    refs = h.sched.model_runner.lora_manager.refs
    return None if name is None else next(i for i, r in refs.items() if r.lora_name == name)


def run(h: Harness, reqs: list[tuple[str, list[int], object]]) -> dict[str, dict]:
    """Submit (rid, prompt, adapter name) together and run them to the end."""
    for rid, ids, name in reqs:
        h.submit(rid, ids, max_new_tokens=8, return_logprob=True, logprob_start_len=START, ignore_eos=True,
                 lora_id=lora_id(h, name))
    h.run()
    return {rid: h.out[rid] for rid, _, _ in reqs}


def prompt_lp(rec: dict) -> torch.Tensor:
    return torch.tensor([lp for lp, _ in rec["in_lp"]], dtype=torch.float64)


def allowed(a: torch.Tensor, b: torch.Tensor, dtype: str) -> float:
    if dtype == "float32":
        return TOL
    scale = float(torch.maximum(a.abs().max(), b.abs().max()))
    return TOL + 2 * scale * 2.0 ** -7  # two bf16 ulps at the largest logprob's magnitude


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("prefill", ["breakable", "full"])
def test_cached_prefix_under_the_prefill_graph(prefill, dtype, caplog):
    caplog.set_level("INFO", logger="sglang.srt.managers.scheduler")
    h = harness(prefill, dtype)
    assert h.sched.flush_cache().success
    names = [None, "a", "b"]
    cold, warm = {}, {}
    for n in names:  # alone: uncached (a fresh namespace), then the same prompt with SYSTEM cached
        cold.update(run(h, [(f"cold-{n}", SYSTEM + QUESTIONS[0], n)]))
        warm.update(run(h, [(f"warm-{n}", SYSTEM + QUESTIONS[0], n)]))
    # A mixed batch of hits: three adapters (base included), new questions, one prefill pass.
    mix = [(f"mix-{k}-{n}", SYSTEM + QUESTIONS[k], n) for k, n in zip((1, 2, 1), names)]
    mixed = run(h, mix)
    mixed_cold = {}
    for rid, ids, n in mix:  # the same requests with nothing cached, one at a time
        assert h.sched.flush_cache().success
        mixed_cold.update(run(h, [(f"cold-{rid}", ids, n)]))

    for n in names:
        c, w = cold[f"cold-{n}"], warm[f"warm-{n}"]
        assert c["cached"] == 0 and w["cached"] == len(SYSTEM), (n, c["cached"], w["cached"])
        diff, bound = float((prompt_lp(c) - prompt_lp(w)).abs().max()), allowed(prompt_lp(c), prompt_lp(w), dtype)
        print(f"{prefill} {dtype} {n}: max |uncached - cached| prompt logprob {diff:.2e} (allowed {bound:.2e})")
        assert diff < bound, (n, diff, bound)
    for rid, _, n in mix:
        m, mc = mixed[rid], mixed_cold[f"cold-{rid}"]
        assert m["cached"] == len(SYSTEM) and mc["cached"] == 0
        diff, bound = float((prompt_lp(m) - prompt_lp(mc)).abs().max()), allowed(prompt_lp(m), prompt_lp(mc), dtype)
        print(f"{prefill} {dtype} mixed {n}: max |uncached - cached| {diff:.2e} (allowed {bound:.2e})")
        assert diff < bound, (n, diff, bound)
    effect = float((prompt_lp(warm["warm-a"]) - prompt_lp(warm["warm-None"])).abs().max())
    assert effect > LORA_EFFECT, effect

    lines = [r.getMessage() for r in caplog.records if "Prefill batch" in r.getMessage()]
    hits = [ln for ln in lines if HIT_LINE.search(ln)]
    assert len(hits) >= len(names) + 1, lines  # every warm request and the mixed batch
    assert any("#new-seq: 3," in ln for ln in hits), lines
    report = h.sched.check_integrity()
    assert report["ok"] and report["kv_protected"] == 0, report
