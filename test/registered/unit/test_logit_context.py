"""The logit adjustments' per-composition plans (managers/logit_context.py): a batch that comes back
with the same requests reuses its tensors, and every step still gives, bit for bit, what the
documented arithmetic gives from the requests' host state (CPU, the real scheduler objects)."""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch

from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.managers.logit_context import LogitContext
from sglang.srt.managers.req import Req
from sglang.srt.managers.schedule_batch import sampling_info_for
from sglang.srt.sampling.logit_adjustments import REPETITION_FLOOR
from sglang.srt.sampling.sampling_params import SamplingParams

VOCAB = 64
EOS = 7
PENALTIES = dict(frequency_penalty=0.7, presence_penalty=-0.3, repetition_penalty=1.3)


def req(i: int, prompt: list[int], output: list[int] = (), **params) -> Req:
    sp = SamplingParams.from_dict({"max_new_tokens": 64, "temperature": 0.0, **params})
    sp.verify(VOCAB)
    r = Req(TokenizedGenerateReqInput(rid=f"r{i}", input_ids=list(prompt), sampling_params=sp), i)
    r.output_ids = list(output)
    return r


def expected(logits: torch.Tensor, reqs: list[Req], pending: int = 0,
             fed: Optional[list[int]] = None) -> torch.Tensor:
    """The module docstring of sampling/logit_adjustments.py, row by row from the host's lists, in
    the same float32 operations and order (so equality is exact)."""
    out = logits.clone()
    for i, r in enumerate(reqs):
        p, row = r.sampling_params, out[i]
        for t, v in sorted((p.logit_bias or {}).items()):
            row[t] += torch.tensor(v, dtype=torch.float32)
        if len(r.output_ids) + pending < p.min_new_tokens:
            for t in set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS}):
                row[t] = -math.inf
        if not p.needs_token_counts:
            continue
        generated = r.output_ids + ([fed[i]] if fed is not None else [])
        counts = torch.bincount(torch.tensor(generated, dtype=torch.int64), minlength=VOCAB).to(torch.int32)
        rep = torch.tensor(max(p.repetition_penalty, REPETITION_FLOOR), dtype=torch.float32)
        if p.repetition_penalty != 1:
            seen = counts > 0
            seen[r.origin_input_ids] = True
            row = torch.where(seen, torch.where(row > 0, row / rep, row * rep), row)
        freq = torch.tensor(p.frequency_penalty, dtype=torch.float32)
        pres = torch.tensor(p.presence_penalty, dtype=torch.float32)
        out[i] = row - freq * counts - pres * (counts > 0)
    return out


def adjusted(reqs: list[Req], ctx: LogitContext, logits: torch.Tensor, pending: int = 0,
             fed: Optional[list[int]] = None) -> torch.Tensor:
    info = sampling_info_for(reqs, "cpu", pending, logit_ctx=ctx)
    adj = info.adjustments if info is not None else None
    if adj is None:
        return logits.clone()
    if fed is not None:
        adj.fed_tokens = torch.tensor(fed)
    return adj.apply(logits)


def grow(reqs: list[Req], step: int) -> None:
    for j, r in enumerate(reqs):
        r.output_ids.append((5 * j + 3 * step) % VOCAB)


def test_penalties_plan_is_reused_while_the_batch_holds_the_same_requests_and_counts_follow_output() -> None:
    torch.manual_seed(0)
    ctx = LogitContext({EOS}, VOCAB, "cpu")
    reqs = [req(i, [i, i + 1, 2], [i], **PENALTIES) for i in range(5)]
    reqs.append(req(5, [1], [2]))  # no penalty: its row stays raw
    plans = set()
    for step in range(6):
        logits = torch.randn(len(reqs), VOCAB) * 3
        assert torch.equal(adjusted(reqs, ctx, logits), expected(logits, reqs))
        plans.add(id(ctx.plan_for(reqs)))
        grow(reqs, step)
    assert len(plans) == 1
    plan = ctx.plan_for(reqs)
    assert plan.penalty_rows.tolist() == [0, 1, 2, 3, 4]


def test_penalties_and_logit_bias_follow_requests_joining_leaving_and_finishing() -> None:
    torch.manual_seed(1)
    ctx = LogitContext({EOS}, VOCAB, "cpu")
    a = req(0, [1, 2], [3], **PENALTIES)
    b = req(1, [4], [4, 4], frequency_penalty=1.0, logit_bias={"9": 5.0})
    c = req(2, [5], [], presence_penalty=0.5, logit_bias={"10": -3.0, "11": 100})
    d = req(3, [6], [7], repetition_penalty=0.5)
    batches = [[a, b], [a, b, c], [b, c], [c, b], [c, b, d], [c, d]]  # join, leave, reorder
    for step, batch in enumerate(batches):
        logits = torch.randn(len(batch), VOCAB)
        assert torch.equal(adjusted(batch, ctx, logits), expected(logits, batch)), step
        grow(batch, step)
        if step == 4:
            ctx.release(b)  # b finishes: its row goes back, and the plans that hold it
            assert b.counts_row is None and all(b not in p.reqs for p in ctx._plans.values())
    # A new request takes a freed row: it starts clean.
    e = req(4, [8], [9, 9], **PENALTIES)
    logits = torch.randn(3, VOCAB)
    assert torch.equal(adjusted([c, d, e], ctx, logits), expected(logits, [c, d, e]))
    assert ctx.counts.rows_in_use == 4  # a, c, d, e (a was never released)


def test_penalties_table_growth_and_a_moved_row_rebuild_the_row_index() -> None:
    torch.manual_seed(2)
    ctx = LogitContext({EOS}, VOCAB, "cpu")
    first = [req(i, [i], [i + 1], frequency_penalty=0.5) for i in range(3)]
    logits = torch.randn(3, VOCAB)
    assert torch.equal(adjusted(first, ctx, logits), expected(logits, first))
    others = [req(10 + i, [i], [i], presence_penalty=1.0) for i in range(12)]  # grows the table
    adjusted(others, ctx, torch.randn(12, VOCAB))
    assert ctx.counts.capacity > 8
    grow(first, 0)
    assert torch.equal(adjusted(first, ctx, logits), expected(logits, first))
    # The table gives a request's row back behind the plan's back: the next step finds it a new
    # one (re-synced from its whole output), and the plan's row index follows.
    ctx.counts.release(first[1])
    ctx.counts.rows_for([req(99, [0], [0], frequency_penalty=1.0)])  # someone else takes that row
    grow(first, 1)
    assert torch.equal(adjusted(first, ctx, logits), expected(logits, first))
    assert ctx.plan_for(first).table_index.tolist() == [r.counts_row for r in first]


def test_penalties_fed_tokens_of_the_overlap_schedule_with_a_cached_plan() -> None:
    """Steps alternate between the host knowing every token and a token still on the device
    (pending 1, fed_tokens): the same plan serves both, and the fed token counts once."""
    torch.manual_seed(3)
    ctx = LogitContext({EOS}, VOCAB, "cpu")
    reqs = [req(i, [i, 30], [i + 1], min_new_tokens=4, **PENALTIES) for i in range(3)]
    for step in range(6):
        logits = torch.randn(3, VOCAB) * 2
        if step % 2:
            fed = [(7 * step + j) % VOCAB for j in range(3)]
            got = adjusted(reqs, ctx, logits, pending=1, fed=fed)
            assert torch.equal(got, expected(logits, reqs, pending=1, fed=fed)), step
            for r, t in zip(reqs, fed):
                r.output_ids.append(t)  # the step's result reaches the host
        else:
            assert torch.equal(adjusted(reqs, ctx, logits), expected(logits, reqs)), step
            grow(reqs, step)
    assert len(ctx._plans) == 1


def test_min_new_tokens_bans_lift_per_request_as_outputs_reach_it() -> None:
    torch.manual_seed(4)
    ctx = LogitContext({EOS}, VOCAB, "cpu")
    reqs = [req(i, [1], [], min_new_tokens=i + 1, stop_token_ids=[11], logit_bias={"3": 2.0} if i % 2 else None)
            for i in range(4)]
    keys = []
    for step in range(6):
        logits = torch.randn(4, VOCAB)
        for pending in (1, 0):  # the key read below is pending 0's
            assert torch.equal(adjusted(reqs, ctx, logits, pending), expected(logits, reqs, pending)), (step, pending)
        keys.append(ctx.plan_for(reqs).bias_key)
        grow(reqs, step)
    assert keys[0] == (True, True, True, True) and keys[-1] == (False, False, False, False)
    # Past every min_new_tokens, only the logit_bias rows adjust anything.
    assert ctx.plan_for(reqs).bias.index.numel() == 2
    plain = [req(9, [1], [1, 2], min_new_tokens=2)]
    assert sampling_info_for(plain, "cpu", 0, logit_ctx=ctx).adjustments is None


def test_penalties_of_a_retracted_request_keep_its_row_when_it_returns() -> None:
    torch.manual_seed(5)
    ctx = LogitContext({EOS}, VOCAB, "cpu")
    reqs = [req(i, [i, 2], [i], **PENALTIES) for i in range(3)]
    logits = torch.randn(3, VOCAB)
    adjusted(reqs, ctx, logits)
    grow(reqs, 0)
    retracted = reqs[2]
    row = retracted.counts_row
    for step in range(1, 3):  # decoded without it, its row untouched
        adjusted(reqs[:2], ctx, logits[:2])
        grow(reqs[:2], step)
    # Back as a prefill of its own (a new composition), then decoding with the others again.
    assert torch.equal(adjusted([retracted], ctx, logits[:1]), expected(logits[:1], [retracted]))
    assert retracted.counts_row == row
    grow(reqs, 3)
    assert torch.equal(adjusted(reqs, ctx, logits), expected(logits, reqs))
    assert ctx.plan_for(reqs).table_index.tolist() == [r.counts_row for r in reqs]


def test_penalties_built_for_a_step_are_refused_after_the_table_moved() -> None:
    """The sampler reads the count rows in place: a step's adjustments applied after the next step
    synced its tokens would count them; they assert instead of answering wrong."""
    ctx = LogitContext({EOS}, VOCAB, "cpu")
    reqs = [req(0, [1], [2], frequency_penalty=1.0)]
    stale = sampling_info_for(reqs, "cpu", 0, logit_ctx=ctx).adjustments
    grow(reqs, 0)
    sampling_info_for(reqs, "cpu", 0, logit_ctx=ctx)
    with pytest.raises(AssertionError, match="token counts changed"):
        stale.apply(torch.zeros(1, VOCAB))


def test_plans_are_few_and_hold_their_requests() -> None:
    ctx = LogitContext({EOS}, VOCAB, "cpu")
    batches = [[req(10 * k + i, [1], [2], logit_bias={"4": 1.0}) for i in range(2)] for k in range(6)]
    for batch in batches:
        sampling_info_for(batch, "cpu", 0, logit_ctx=ctx)
    assert len(ctx._plans) == LogitContext.MAX_PLANS
    assert [p.reqs for p in ctx._plans.values()] == batches[-LogitContext.MAX_PLANS:]


def test_sampling_tensors_are_built_once_per_batch_and_steps_follow_each_step() -> None:
    """The parameters' tensors are shared by the steps of one composition; what moves per step
    (a seeded request's step, with the pending token) does not."""
    ctx = LogitContext({EOS}, VOCAB, "cpu")
    reqs = [req(0, [1], [2], temperature=0.7, top_p=0.9, seed=5), req(1, [1], [], temperature=0.0),
            req(2, [3], [4, 5], temperature=1.2, top_k=8, min_p=0.1, frequency_penalty=0.5)]
    first = sampling_info_for(reqs, "cpu", 0, logit_ctx=ctx)
    grow(reqs, 0)
    second = sampling_info_for(reqs, "cpu", 1, logit_ctx=ctx)
    assert second.temperatures is first.temperatures and second.top_ks is first.top_ks
    assert first.steps == [1, 0, 2] and second.steps == [3, 2, 4]
    alone = sampling_info_for([reqs[0], reqs[1]], "cpu", 1, logit_ctx=LogitContext({EOS}, VOCAB, "cpu"))  # nothing cached
    for name in ("temperatures", "top_ps", "top_ks", "min_ps"):
        assert torch.equal(getattr(second, name)[:2], getattr(alone, name)), name
    assert (second.seeds, second.need_top_k_sampling, second.need_min_p_sampling) == ([5, None, None], True, True)
    assert alone.steps == [3, 2] and alone.adjustments is None
    greedy = [req(3, [1], [2]), req(4, [1], [])]
    assert sampling_info_for(greedy, "cpu", 0, logit_ctx=ctx) is None
