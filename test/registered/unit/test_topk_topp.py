"""The sort-free top-k / top-p threshold kernel (layers/triton_ops/topk_topp.py) against the sort
reference (sampler.top_k_top_p_threshold_sort), and the Sampler's filter through either path.
CPU runs interpret the kernel at small shapes; the `gpu` test compares at the served shape."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.sampler import filter_probs, top_k_top_p_threshold_sort
from sglang.srt.layers.triton_ops.dispatch import fused_kernels
from sglang.srt.layers.triton_ops.topk_topp import topk_topp_threshold
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

# Per row (top_k, top_p): neither, top-k only, top-p only, both, top_p tiny (only the argmax),
# top_p 1.0, top_k 1, top_k > vocab, top_k 0 with top_p, a large top_k with a small top_p.
ROWS = [(-1, 1.0), (5, 1.0), (-1, 0.9), (20, 0.5), (-1, 1e-6), (0, 1.0), (1, 1.0), (10**6, 1.0), (0, 0.3), (300, 0.05)]


def distribution(n_rows: int, vocab: int, kind: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scale = {"peaked": 6.0, "flat": 0.3}[kind]
    probs = torch.softmax(torch.randn(n_rows, vocab, generator=gen) * scale, dim=-1)
    # Tie-free: where the kept set of a tie depends on the rule, the reference sort's order would.
    for row in probs:
        assert row.unique().numel() == vocab
    return probs


def kept_by_kernel(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, **launch) -> torch.Tensor:
    out = torch.full_like(probs, float("nan"))
    t = topk_topp_threshold(probs, top_ks, top_ps, out=out, **launch)
    assert torch.equal(out, probs.masked_fill(probs < t.unsqueeze(1), 0.0))  # the fused write agrees
    return out > 0


def kept_by_sort(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    return probs >= top_k_top_p_threshold_sort(probs, top_ks, top_ps).unsqueeze(1)


def kept_by_rank(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """The rule as written, rank by rank over the sorted row (float64 mass), for tie-free rows."""
    vocab = probs.shape[-1]
    keep = torch.zeros_like(probs, dtype=torch.bool)
    for r in range(probs.shape[0]):
        order = probs[r].double().argsort(descending=True)
        before = 0.0
        for rank, i in enumerate(order.tolist()):
            k, p = int(top_ks[r]), float(top_ps[r])
            if (0 < k < vocab and rank >= k) or (p < 1.0 and before > p):
                break
            keep[r, i] = True
            before += float(probs[r, i])
    return keep


@pytest.mark.parametrize("vocab,block", [(257, 64), (1000, 128), (999, 1024), (50, 16)])
@pytest.mark.parametrize("kind", ["peaked", "flat"])
def test_kernel_keeps_what_the_sort_keeps(vocab: int, block: int, kind: str) -> None:
    probs = distribution(len(ROWS), vocab, kind, seed=vocab)
    top_ks = torch.tensor([k for k, _ in ROWS])
    top_ps = torch.tensor([p for _, p in ROWS], dtype=torch.float32)
    kernel = kept_by_kernel(probs, top_ks, top_ps, block=block)
    assert torch.equal(kernel, kept_by_sort(probs, top_ks, top_ps))
    assert torch.equal(kernel, kept_by_rank(probs, top_ks, top_ps))
    counts = kernel.sum(-1).tolist()
    assert counts[0] == counts[5] == counts[7] == vocab  # filters off
    assert counts[1] == 5 and counts[6] == 1 and counts[4] == 1  # top_k 5, top_k 1, top_p tiny
    assert kernel[torch.arange(len(ROWS)), probs.argmax(-1)].all()  # the argmax always survives


@pytest.mark.parametrize("n_cand", [1, 4, 32])
def test_candidates_per_pass_do_not_change_the_threshold(n_cand: int) -> None:
    probs = distribution(len(ROWS), 300, "peaked", seed=7)
    top_ks = torch.tensor([k for k, _ in ROWS])
    top_ps = torch.tensor([p for _, p in ROWS], dtype=torch.float32)
    t = topk_topp_threshold(probs, top_ks, top_ps, block=64, n_cand=n_cand)
    assert torch.equal(t, topk_topp_threshold(probs, top_ks, top_ps, block=64, n_cand=8))


def test_ties_at_the_cutoff_are_all_kept() -> None:
    """The threshold form's semantics: every token equal to the cutoff value survives (a sort kept an
    arbitrary subset of them). Both paths agree."""
    probs = torch.tensor([[0.2, 0.4, 0.2, 0.2], [0.4, 0.2, 0.2, 0.2], [0.25, 0.25, 0.25, 0.25], [0.1, 0.5, 0.3, 0.1]])
    top_ks = torch.tensor([2, -1, 1, 3])
    top_ps = torch.tensor([1.0, 0.5, 1.0, 1.0])
    expected = torch.tensor([[True] * 4, [True] * 4, [True] * 4, [True] * 4])
    assert torch.equal(kept_by_kernel(probs, top_ks, top_ps, block=16), expected)
    assert torch.equal(kept_by_sort(probs, top_ks, top_ps), expected)
    # Below the cutoff, ties are dropped together.
    top_ps = torch.tensor([0.3, 0.3, 0.3, 0.3])
    expected = torch.tensor([[False, True, False, False], [True, False, False, False], [True] * 4,
                             [False, True, False, False]])
    assert torch.equal(kept_by_kernel(probs, torch.tensor([-1] * 4), top_ps, block=16), expected)
    assert torch.equal(kept_by_sort(probs, torch.tensor([-1] * 4), top_ps), expected)


def test_filter_probs_is_the_same_through_either_path(monkeypatch) -> None:
    from sglang.srt.layers import sampler

    monkeypatch.setattr(sampler, "THRESHOLD_KERNEL", True)  # the default, whatever the environment says
    probs = distribution(len(ROWS), 400, "peaked", seed=3)
    info = SamplingBatchInfo.from_params([0.7] * len(ROWS), [p for _, p in ROWS], [k for k, _ in ROWS],
                                         [0.0, 0.0, 0.05, 0.0, 0.0, 0.0, 0.0, 0.0, 0.2, 0.0],
                                         [None] * len(ROWS), [0] * len(ROWS), "cpu")
    with fused_kernels("torch"):
        reference = filter_probs(probs, info)
    with fused_kernels("triton"):
        kernel = filter_probs(probs, info)
    assert torch.equal(kernel, reference)


@pytest.mark.gpu
def test_kernel_matches_the_sort_at_the_served_shape() -> None:
    """64 x 151936 (Qwen3's vocabulary), temperature-0.7-like rows, the bench's top_p 0.9 plus a
    spread of top_k / top_p. Exact equality of kept sets, except tokens whose mass-before sits
    within float32 summation error of top_p (the kernel and cumsum add in different orders)."""
    torch.manual_seed(0)
    n, vocab = 64, 151936
    probs = torch.softmax(torch.randn(n, vocab, device="cuda") * 4 / 0.7, dim=-1)
    top_ks = torch.tensor([[-1, 50, 1, 10**6][i % 4] for i in range(n)], device="cuda")
    top_ps = torch.tensor([[0.9, 1.0, 0.5, 0.95, 1e-6, 0.99][i % 6] for i in range(n)], device="cuda")
    kernel = kept_by_kernel(probs, top_ks, top_ps)
    sort = kept_by_sort(probs, top_ks, top_ps)
    diff = kernel != sort
    if diff.any():
        # Mass strictly above each differing token, in float64, must be ~top_p.
        rows, cols = diff.nonzero(as_tuple=True)
        above = torch.stack([probs[r][probs[r] > probs[r, c]].double().sum() for r, c in zip(rows, cols)])
        assert (above - top_ps[rows].double()).abs().max() < 1e-4, above
    assert diff.sum() <= 8
