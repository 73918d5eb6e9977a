"""Penalties, logit_bias and min_new_tokens: the scheduler's tables and the sampler's arithmetic,
against Hugging Face's logits processors and OpenAI's published formula (CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from sglang.srt.layers.sampler import Sampler
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.managers.req import Req
from sglang.srt.managers.schedule_batch import LogitContext, sampling_info_for
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.sampling.token_counts import TokenCounts

VOCAB = 50
EOS = 7


def req(i: int, prompt: list[int], output: list[int] = (), **params) -> Req:
    sp = SamplingParams.from_dict({"max_new_tokens": 64, "temperature": 0.0, **params})
    sp.verify(VOCAB)
    r = Req(TokenizedGenerateReqInput(rid=f"r{i}", input_ids=list(prompt), sampling_params=sp), i)
    r.output_ids = list(output)
    return r


def ctx() -> LogitContext:
    return LogitContext({EOS}, VOCAB, "cpu")


def openai_reference(logits: torch.Tensor, output: list[int], frequency: float, presence: float) -> torch.Tensor:
    """OpenAI's formula, token by token: mu[j] - c[j] * frequency - (c[j] > 0) * presence."""
    out = logits.clone()
    for token in set(output):
        c = output.count(token)
        out[token] = out[token] - c * frequency - presence
    return out


def test_penalties_match_hf_and_openai_row_by_row() -> None:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    logits = torch.randn(5, VOCAB) * 3
    reqs = [
        req(0, [1, 2, 3], [4, 4, 5], repetition_penalty=1.3),
        req(1, [9, 9], [3, 1, 3, 3], frequency_penalty=0.5, presence_penalty=-0.25),
        req(2, [1, 2], [2, 8]),  # no adjustment: its row stays as it was
        req(3, [30, 31], [31, 40, 40], repetition_penalty=0.8, frequency_penalty=-1.5, presence_penalty=2.0),
        req(4, [5], [], repetition_penalty=1.7),  # nothing generated yet: the prompt alone counts
    ]
    info = sampling_info_for(reqs, "cpu", logit_ctx=ctx())
    assert info is not None and info.is_all_greedy and info.adjustments is not None
    got = info.adjustments.apply(logits)
    for i, r in enumerate(reqs):
        p = r.sampling_params
        want = logits[i].clone()
        if p.repetition_penalty != 1:
            history = torch.tensor([r.origin_input_ids + r.output_ids])
            want = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(history, want.unsqueeze(0))[0]
        want = openai_reference(want, r.output_ids, p.frequency_penalty, p.presence_penalty)
        torch.testing.assert_close(got[i], want, atol=1e-6, rtol=0)
    assert torch.equal(got[2], logits[2])


def test_logit_bias_and_min_new_tokens() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, VOCAB)
    reqs = [
        req(0, [1], [2], logit_bias={"3": 100, 4: -100.0}),
        req(1, [1], [2, 3], min_new_tokens=3, stop_token_ids=[11]),  # 2 generated: EOS and 11 held back
        req(2, [1], [2, 3, 4], min_new_tokens=3, stop_token_ids=[11]),  # 3 generated: free
    ]
    got = sampling_info_for(reqs, "cpu", logit_ctx=ctx()).adjustments.apply(logits)
    assert got[0, 3] == logits[0, 3] + 100 and got[0, 4] == logits[0, 4] - 100
    assert got[1, EOS] == -math.inf and got[1, 11] == -math.inf
    assert torch.equal(got[2], logits[2])
    # ignore_eos: EOS does not stop the request, so it is not held back either.
    r = req(3, [1], [], min_new_tokens=2, ignore_eos=True, stop_token_ids=[11])
    got = sampling_info_for([r], "cpu", logit_ctx=ctx()).adjustments.apply(logits[:1])
    assert got[0, EOS] == logits[0, EOS] and got[0, 11] == -math.inf
    # A token sampled by a step the host has not seen yet counts (the overlap schedule's `pending`).
    r = req(4, [1], [2], min_new_tokens=2)
    assert sampling_info_for([r], "cpu", pending=1, logit_ctx=ctx()).adjustments is None


def test_the_sampler_chooses_from_the_adjusted_logits_and_reports_the_raw_logprobs() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0], [5.0, 4.0, 0.0, 0.0]])
    global VOCAB
    vocab, VOCAB = VOCAB, 4
    try:
        reqs = [req(0, [0], [0, 0], frequency_penalty=1.0), req(1, [2], [])]
        info = sampling_info_for(reqs, "cpu", logit_ctx=LogitContext({3}, 4, "cpu"))
    finally:
        VOCAB = vocab
    raw = logits.clone()
    out = Sampler()(logits, info, return_logprob=True, top_logprobs_nums=[2, 2])
    assert out.next_token_ids.tolist() == [1, 0]  # 5 - 2 * 1.0 = 3 < 4
    assert torch.equal(logits, raw)  # the logits (maybe a graph's output buffer) are not written
    want = torch.log_softmax(raw, -1)
    torch.testing.assert_close(out.logprobs, want[[0, 1], [1, 0]])


def test_a_tiny_repetition_penalty_keeps_the_logits_finite() -> None:
    """1e-40 (denormal in float32, 1e-46 rounds to 0) would divide positive logits into inf, and
    a softmax over several infs is NaN, whose argmax could pick a held-back EOS."""
    torch.manual_seed(3)
    logits = torch.randn(2, VOCAB) * 5
    reqs = [req(i, list(range(20)), list(range(20, 30)), repetition_penalty=rp, min_new_tokens=20, temperature=1.0)
            for i, rp in enumerate((1e-40, 1e-46))]
    info = sampling_info_for(reqs, "cpu", logit_ctx=ctx())
    adjusted = info.adjustments.apply(logits)
    assert torch.isfinite(adjusted[:, [t for t in range(VOCAB) if t != EOS]]).all()
    assert (adjusted[:, EOS] == -math.inf).all()
    for _ in range(20):
        ids = Sampler()(logits, info).next_token_ids
        assert EOS not in ids.tolist() and all(t < 30 for t in ids.tolist())  # a seen token, boosted


def test_fed_tokens_count_as_generated() -> None:
    """Under the overlap schedule a decode step's input token is not in output_ids yet: counting it
    from the device tensor gives what counting it on the host gives."""
    torch.manual_seed(2)
    logits = torch.randn(2, VOCAB)
    params = dict(frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.2)
    host = [req(0, [1, 2], [5, 6, 5], **params), req(1, [3], [9], **params)]
    want = sampling_info_for(host, "cpu", logit_ctx=ctx()).adjustments.apply(logits)
    behind = [req(0, [1, 2], [5, 6], **params), req(1, [3], [], **params)]
    info = sampling_info_for(behind, "cpu", pending=1, logit_ctx=ctx())
    info.adjustments.fed_tokens = torch.tensor([5, 9])
    torch.testing.assert_close(info.adjustments.apply(logits), want, atol=0, rtol=0)


def test_token_counts_rows_follow_output_ids_grow_and_are_reused_clean() -> None:
    table = TokenCounts(VOCAB, "cpu")
    reqs = [req(i, [i, i + 1], [], frequency_penalty=1.0) for i in range(TokenCounts.MIN_ROWS + 3)]
    rows = table.rows_for(reqs)
    assert sorted(rows) == list(range(len(reqs))) and table.capacity == 2 * TokenCounts.MIN_ROWS
    for step in range(4):
        for i, r in enumerate(reqs):
            r.output_ids.append((i * 3 + step) % VOCAB)
        table.rows_for(reqs[::2] if step % 2 else reqs)  # some requests skip a step: they catch up
    table.rows_for(reqs)
    for r in reqs:
        assert torch.equal(table.output_counts[r.counts_row], torch.bincount(torch.tensor(r.output_ids),
                                                                             minlength=VOCAB).int())
        assert table.prompt_seen[r.counts_row].nonzero().view(-1).tolist() == sorted(set(r.origin_input_ids))
    first = reqs[0]
    row = first.counts_row
    table.release(first)
    table.release(first)  # idempotent
    assert first.counts_row is None and table.rows_in_use == len(reqs) - 1
    fresh = req(99, [40], [41], frequency_penalty=1.0)
    assert table.rows_for([fresh]) == [row]
    assert table.output_counts[row].nonzero().view(-1).tolist() == [41]
    assert table.prompt_seen[row].nonzero().view(-1).tolist() == [40]


def test_requests_without_adjustments_build_nothing() -> None:
    c = ctx()
    assert sampling_info_for([req(0, [1], [2]), req(1, [3], [])], "cpu", logit_ctx=c) is None
    info = sampling_info_for([req(0, [1], [2], temperature=0.5)], "cpu", logit_ctx=c)
    assert info.adjustments is None and c._counts is None  # no table until a penalised request


@pytest.mark.parametrize("params, message", [
    ({"frequency_penalty": 2.5}, "frequency_penalty must be a number in [-2, 2]"),
    ({"presence_penalty": float("nan")}, "presence_penalty must be a number in [-2, 2]"),
    ({"presence_penalty": True}, "presence_penalty must be a number"),
    ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 2]"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty must be in (0, 2]"),
    ({"repetition_penalty": 2.5}, "repetition_penalty must be in (0, 2]"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty must be in (0, 2]"),
    ({"min_new_tokens": 200}, "must not exceed max_new_tokens (128, the default when not set)"),
    ({"min_new_tokens": -1}, "min_new_tokens must be a non-negative integer"),
    ({"min_new_tokens": 2.0}, "min_new_tokens must be a non-negative integer"),
    ({"min_new_tokens": 9, "max_new_tokens": 8}, "min_new_tokens (9) must not exceed max_new_tokens (8)"),
    ({"logit_bias": [1, 2]}, "logit_bias must be an object"),
    ({"logit_bias": {"x": 1}}, "logit_bias: key 'x' is not a token id"),
    ({"logit_bias": {"1_0": 1}}, "logit_bias: key '1_0' is not a token id"),  # int() would read 10
    ({"logit_bias": {"+5": 1}}, "logit_bias: key '+5' is not a token id"),
    ({"logit_bias": {"\u0663": 1}}, "is not a token id"),  # an Arabic-Indic 3: int() reads it
    ({"logit_bias": {"1": 1, "01": 2}}, "logit_bias: token id 1 is given twice"),
    ({"logit_bias": {"50": 1}}, "outside the vocabulary [0, 50)"),
    ({"logit_bias": {"-1": 1}}, "outside the vocabulary"),
    ({"logit_bias": {"1": 101}}, "must be a number in [-100, 100]"),
    ({"logit_bias": {"1": "5"}}, "must be a number in [-100, 100]"),
])
def test_bad_values_are_refused_with_the_field_named(params: dict, message: str) -> None:
    with pytest.raises(ValueError) as e:
        SamplingParams.from_dict(params).verify(VOCAB)
    assert message in str(e.value)
