"""Sampler: greedy, temperature, top-k / top-p / min-p, per-request seeds, logprobs."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.sampler import Sampler
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def info(n: int, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, seeds=None, steps=None) -> SamplingBatchInfo:
    def per_row(v):
        return list(v) if isinstance(v, (list, tuple)) else [v] * n

    return SamplingBatchInfo.from_params(
        per_row(temperature), per_row(top_p), per_row(top_k), per_row(min_p),
        seeds if seeds is not None else [None] * n, steps if steps is not None else [0] * n, "cpu",
    )


def frequencies(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(ids, minlength=vocab).float() / ids.numel()


def test_greedy_is_argmax_with_and_without_sampling_info() -> None:
    logits = torch.randn(6, 50)
    expected = logits.argmax(-1)
    assert torch.equal(Sampler()(logits, None).next_token_ids, expected)
    assert torch.equal(Sampler()(logits, info(6, temperature=0.0)).next_token_ids, expected)


def test_mixed_batch_keeps_greedy_rows_greedy() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    temps = [0.0, 1.0] * 4
    ids = Sampler()(logits, info(8, temperature=temps)).next_token_ids
    assert torch.equal(ids[0::2], logits[0::2].argmax(-1))


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_sampling_follows_the_tempered_distribution(temperature: float) -> None:
    torch.manual_seed(1)
    n = 40000
    ids = Sampler()(LOGITS.expand(n, -1), info(n, temperature=temperature)).next_token_ids
    expected = torch.softmax(LOGITS / temperature, -1)
    torch.testing.assert_close(frequencies(ids, 4), expected, atol=0.01, rtol=0)


def test_top_k_top_p_min_p_restrict_the_support() -> None:
    torch.manual_seed(2)
    n = 40000
    sampler = Sampler()
    # top-k 2: only the two most likely, in proportion 0.5 : 0.3.
    f = frequencies(sampler(LOGITS.expand(n, -1), info(n, top_k=2)).next_token_ids, 4)
    torch.testing.assert_close(f, torch.tensor([0.625, 0.375, 0, 0]), atol=0.01, rtol=0)
    # top-p 0.7: the smallest prefix reaching 0.7 is {0, 1}.
    f = frequencies(sampler(LOGITS.expand(n, -1), info(n, top_p=0.7)).next_token_ids, 4)
    torch.testing.assert_close(f, torch.tensor([0.625, 0.375, 0, 0]), atol=0.01, rtol=0)
    # top-p 0.85 keeps a third token (0.5 + 0.3 < 0.85).
    f = frequencies(sampler(LOGITS.expand(n, -1), info(n, top_p=0.85)).next_token_ids, 4)
    torch.testing.assert_close(f, torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95, atol=0.01, rtol=0)
    # min-p 0.5: tokens with p >= 0.25.
    f = frequencies(sampler(LOGITS.expand(n, -1), info(n, min_p=0.5)).next_token_ids, 4)
    torch.testing.assert_close(f, torch.tensor([0.625, 0.375, 0, 0]), atol=0.01, rtol=0)
    # top-k 1 is greedy; per-row settings do not leak into other rows.
    ids = sampler(LOGITS.expand(4, -1), info(4, top_k=[1, -1, 1, -1])).next_token_ids
    assert ids[0] == 0 and ids[2] == 0


def test_seeded_request_draws_the_same_token_in_any_batch() -> None:
    sampler = Sampler()
    vocab = 64
    torch.manual_seed(3)
    row = torch.randn(vocab) * 0.1  # nearly flat: the draw depends on the noise only
    alone = [sampler(row[None], info(1, seeds=[1234], steps=[k])).next_token_ids.item() for k in range(12)]
    assert len(set(alone)) > 3  # different steps draw different noise
    for k in range(12):
        others = torch.randn(4, vocab)
        logits = torch.cat([others[:2], row[None], others[2:]])
        batch = info(5, seeds=[None, 7, 1234, None, 1234 + k], steps=[0, k, k, 5, 0])
        assert sampler(logits, batch).next_token_ids[2].item() == alone[k]
    # Another seed gives another stream.
    other = [sampler(row[None], info(1, seeds=[99], steps=[k])).next_token_ids.item() for k in range(12)]
    assert other != alone


def test_logprobs_are_untempered_and_top_k_is_sorted() -> None:
    torch.manual_seed(4)
    logits = torch.randn(3, 20) * 3
    out = Sampler()(logits, info(3, temperature=[0.0, 0.7, 1.5]), return_logprob=True, top_logprobs_nums=[0, 3, 5])
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.next_token_ids[:, None]).squeeze(1))
    assert out.top_logprobs_val.shape == (3, 5)
    torch.testing.assert_close(out.top_logprobs_val, ref.topk(5, -1).values)
    assert torch.equal(out.top_logprobs_idx, ref.topk(5, -1).indices)
    plain = Sampler()(logits, None)
    assert plain.logprobs is None and plain.top_logprobs_val is None


def test_an_all_greedy_batch_builds_no_sampling_tensors() -> None:
    """The scheduler's sampling_info_for: None when every request is greedy (temperature 0 or
    top_k 1), which the Sampler reads as argmax for every row; one sampled request gets the tensors
    for the whole batch, its greedy rows still greedy."""
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.managers.req import Req
    from sglang.srt.managers.schedule_batch import LogitContext, sampling_info_for
    from sglang.srt.sampling.sampling_params import SamplingParams

    def req(i: int, **params) -> Req:
        sp = SamplingParams.from_dict({"max_new_tokens": 4, **params})
        return Req(TokenizedGenerateReqInput(rid=f"r{i}", input_ids=[1, 2], sampling_params=sp), i)

    greedy = [req(0, temperature=0.0), req(1, temperature=0.7, top_k=1)]
    ctx = LogitContext(set(), 50, "cpu")
    assert sampling_info_for(greedy, "cpu", logit_ctx=ctx) is None
    mixed = sampling_info_for(greedy + [req(2, temperature=0.7, top_p=0.9)], "cpu", logit_ctx=ctx)
    assert mixed is not None and not mixed.is_all_greedy and mixed.need_top_p_sampling
    assert mixed.temperatures.view(-1).tolist()[:2] == [0.0, 0.0]
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    ids = Sampler()(logits, mixed).next_token_ids
    assert ids[:2].tolist() == logits[:2].argmax(-1).tolist()
