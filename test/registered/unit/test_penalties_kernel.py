"""The fused penalties kernel (layers/triton_ops/penalties.py) against the torch reference
(sampling/logit_adjustments.py `penalize_reference`): the same bits, float32. CPU runs interpret
the kernel at small shapes; the `gpu` test compares at the served shape."""

from __future__ import annotations

import math

import pytest
import torch

from sglang.srt.layers.sampler import Sampler
from sglang.srt.layers.triton_ops.dispatch import fused_kernels
from sglang.srt.layers.triton_ops.penalties import penalize_fused
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.managers.logit_context import LogitContext
from sglang.srt.managers.req import Req
from sglang.srt.managers.schedule_batch import sampling_info_for
from sglang.srt.sampling.logit_adjustments import PenaltyRows, penalize_reference
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.sampling.token_counts import TokenCounts


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)  # -0.0 and 0.0, and NaN payloads, differ here


def penalty_case(batch: int, vocab: int, with_prompt: bool, fed: bool, device: str, seed: int,
                 whole_batch: bool = False):
    """Logits with signed zeros, -inf bans and exact ties, a table whose rows are not the batch
    rows, penalised rows that skip some of the batch, and tokens counted many times."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen) * 4
    logits[:, :4] = torch.tensor([0.0, -0.0, -math.inf, 1.0])
    logits[:, 4:8] = 2.5
    rows = list(range(batch)) if whole_batch else [i for i in range(batch) if i % 3 != 1]
    table = TokenCounts(vocab, device)
    while table.capacity < 2 * batch:
        table._grow()
    table_rows = torch.randperm(table.capacity, generator=gen)[:len(rows)]
    table.output_counts.copy_(torch.randint(0, 3, (table.capacity, vocab), generator=gen, dtype=torch.int32)
                              * (torch.rand(table.capacity, vocab, generator=gen) < 0.1))
    table.prompt_seen.copy_(torch.rand(table.capacity, vocab, generator=gen) < 0.05)
    params = torch.stack([torch.rand(len(rows), generator=gen) * 4 - 2, torch.rand(len(rows), generator=gen) * 4 - 2,
                          torch.rand(len(rows), generator=gen) * 2 + 1e-6])
    params[:, 0] = torch.tensor([-0.5, 0.0, 1.0])  # zeros times counts: signed zeros
    if not with_prompt:
        params[2] = 1.0
    p = PenaltyRows(rows=torch.tensor(rows, device=device), table_rows=table_rows.to(device), table=table,
                    version=table.version, params=params.to(device), with_prompt=with_prompt,
                    whole_batch=whole_batch)
    fed_tokens = torch.randint(0, vocab, (batch,), generator=gen).to(device) if fed else None
    return logits.to(device), p, fed_tokens


def run_fused(out: torch.Tensor, p: PenaltyRows, fed, **launch) -> None:
    penalize_fused(out, p.rows, p.table_rows, p.table.output_counts, p.table.prompt_seen if p.with_prompt else None,
                   p.params, fed, **launch)


def out_of_place(logits: torch.Tensor, p: PenaltyRows, fed_tokens) -> torch.Tensor:
    """The penalties as first written (before the reference went in place): gathered rows, each
    step a new tensor, the rows copied back."""
    sub = logits.index_select(0, p.rows)
    counts = p.table.output_counts.index_select(0, p.table_rows)
    if fed_tokens is not None:
        fed = fed_tokens.index_select(0, p.rows).unsqueeze(1)
        counts = counts.scatter_add(1, fed, torch.ones_like(fed, dtype=counts.dtype))
    generated = counts > 0
    if p.with_prompt:
        seen = generated | p.table.prompt_seen.index_select(0, p.table_rows)
        scaled = torch.where(sub > 0, sub / p.repetition, sub * p.repetition)
        sub = torch.where(seen, scaled, sub)
    sub = sub - p.frequency * counts - p.presence * generated
    return logits.index_copy(0, p.rows, sub)


@pytest.mark.parametrize("with_prompt", [False, True])
@pytest.mark.parametrize("whole_batch", [False, True])
def test_penalties_reference_in_place_gives_the_out_of_place_bits(with_prompt: bool, whole_batch: bool) -> None:
    logits, p, fed_tokens = penalty_case(9, 333, with_prompt, True, "cpu", seed=5, whole_batch=whole_batch)
    got = logits.clone()
    penalize_reference(got, p, fed_tokens)
    assert torch.equal(bits(got), bits(out_of_place(logits, p, fed_tokens)))
    assert not torch.equal(bits(got), bits(logits))


@pytest.mark.parametrize("with_prompt", [False, True])
@pytest.mark.parametrize("fed", [False, True])
@pytest.mark.parametrize("vocab,block", [(300, 64), (257, 128), (50, 1024)])
def test_penalties_kernel_gives_the_reference_bits(with_prompt: bool, fed: bool, vocab: int, block: int) -> None:
    logits, p, fed_tokens = penalty_case(7, vocab, with_prompt, fed, "cpu", seed=vocab + 2 * with_prompt + fed,
                                         whole_batch=vocab == 50)
    counts_before = p.table.output_counts.clone()
    want, got = logits.clone(), logits.clone()
    penalize_reference(want, p, fed_tokens)
    run_fused(got, p, fed_tokens, block=block)
    assert torch.equal(bits(got), bits(want))
    assert not torch.equal(bits(got), bits(logits))  # something was penalised
    assert torch.equal(p.table.output_counts, counts_before)  # the fed token is not written to the table


def test_penalties_through_the_sampler_kernel_and_reference_agree(monkeypatch) -> None:
    """The served path: sampling_info_for on requests, then the Sampler's dispatch either way."""
    from sglang.srt.layers import sampler

    monkeypatch.setattr(sampler, "PENALTIES_KERNEL", True)  # the default, whatever the environment says
    vocab = 96
    torch.manual_seed(7)
    reqs = []
    for i in range(6):
        params = {"max_new_tokens": 64, "temperature": 0.0, "frequency_penalty": 0.3 * i - 0.6,
                  "presence_penalty": 0.5 if i % 2 else 0.0, "repetition_penalty": [1.0, 1.4, 0.6][i % 3],
                  "logit_bias": {str(i): 3.0}, "min_new_tokens": 2 * i}
        if i == 5:
            params = {"max_new_tokens": 64, "temperature": 0.0}
        sp = SamplingParams.from_dict(params)
        sp.verify(vocab)
        r = Req(TokenizedGenerateReqInput(rid=f"r{i}", input_ids=[i, 2 * i, 40], sampling_params=sp), i)
        r.output_ids = [(7 * i + k) % vocab for k in range(5)]
        reqs.append(r)
    ctx = LogitContext({vocab - 1}, vocab, "cpu")
    logits = torch.randn(len(reqs), vocab) * 3
    info = sampling_info_for(reqs, "cpu", pending=1, logit_ctx=ctx)
    info.adjustments.fed_tokens = torch.arange(len(reqs)) * 11
    with fused_kernels("torch"):
        want = info.adjustments.apply(logits)
        want_ids = Sampler()(logits, info).next_token_ids
    calls = []
    monkeypatch.setattr(sampler, "penalize_fused", lambda *a, **k: (calls.append(1), penalize_fused(*a, **k)))
    with fused_kernels("triton"):
        got_ids = Sampler()(logits, info).next_token_ids
    assert calls and torch.equal(got_ids, want_ids)
    assert torch.equal(bits(info.adjustments.apply(logits, sampler.penalize_with_kernel)), bits(want))


@pytest.mark.gpu
@pytest.mark.parametrize("with_prompt", [False, True])
def test_penalties_kernel_gives_the_reference_bits_at_the_served_shape(with_prompt: bool) -> None:
    logits, p, fed_tokens = penalty_case(64, 151936, with_prompt, True, "cuda", seed=11)
    want, got = logits.clone(), logits.clone()
    penalize_reference(want, p, fed_tokens)
    run_fused(got, p, fed_tokens)
    assert torch.equal(bits(got), bits(want))
    assert torch.equal(bits(want), bits(out_of_place(logits, p, fed_tokens)))
