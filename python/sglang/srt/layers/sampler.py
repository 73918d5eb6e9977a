"""Sampler: next-token choice from float32 logits, plus the logprobs of the choice.

Greedy rows (temperature 0) take the argmax. Other rows: temperature, then top-k, top-p and min-p
filtering of the probabilities (below), then one draw by the exponential race
(argmax p_i / E_i with E_i ~ Exp(1) picks i with probability p_i). A seeded request draws its
noise from a generator keyed by (seed, step), over the full vocabulary in vocabulary order, so its
draw at step k is the same whatever batch it is in. Reported logprobs are those of the
*untempered* distribution (log_softmax of the raw logits), as OpenAI-style APIs report them.
Penalties and biases (sampling/logit_adjustments.py), then the grammar mask of constrained rows
(sampling/grammar_mask.py), change the choice, not the reported logprobs. On CUDA tensors the
penalties run as one Triton kernel reading the count rows in place (layers/triton_ops/penalties.py:
the torch reference's bits; frequency + presence penalties cost a 64-request step 0.09 ms against
0.30 through torch on an H100); SGLANG_PENALTIES_KERNEL=0 takes the torch reference.

Top-k keeps a row's k most likely tokens; top-p keeps the smallest most-likely prefix whose mass
reaches top_p (a token is dropped when the mass of the tokens strictly more likely than it already
exceeds top_p); with both, the intersection; the most likely token always survives. top_k <= 0 or
>= vocab and top_p >= 1 turn a filter off. Both are applied as one threshold per row: the kept set
is {i : p_i >= t}, so *every* token equal to the cutoff value is kept (ties are inclusive: a
top_k 2 over [0.4, 0.2, 0.2, 0.2] keeps all four). On CUDA tensors the threshold comes from a
sort-free Triton search (layers/triton_ops/topk_topp.py: at 64 x 151,936 on an H100, 437 µs
against the sort's 1,340, the same kept sets; the sampling tail of a 64-request step 0.99 ms
against 1.87). SGLANG_SAMPLER_THRESHOLD_KERNEL=0, and CPU tensors, take a full sort of each row
instead: the reference, which follows the same tie rule (the two may disagree only on a token whose
mass-before lies within float32 rounding of top_p: they add in different orders).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from sglang.srt.layers.triton_ops.dispatch import use_triton
from sglang.srt.layers.triton_ops.penalties import penalize_fused
from sglang.srt.layers.triton_ops.topk_topp import topk_topp_threshold
from sglang.srt.sampling.logit_adjustments import PenaltyRows
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

# The sort-free top-k / top-p search on CUDA (see the module docstring); 0 sorts instead.
THRESHOLD_KERNEL = os.environ.get("SGLANG_SAMPLER_THRESHOLD_KERNEL", "1") == "1"

# The fused penalties on CUDA (see the module docstring); 0 takes the torch reference.
PENALTIES_KERNEL = os.environ.get("SGLANG_PENALTIES_KERNEL", "1") == "1"

_MASK64 = (1 << 64) - 1


def _seed_for_step(seed: int, step: int) -> int:
    """Mix (seed, step) into a 63-bit generator seed (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass
class SamplerOutput:
    next_token_ids: torch.Tensor  # int64 [B], on the device
    logprobs: Optional[torch.Tensor] = None  # float32 [B]: logprob of each chosen token
    top_logprobs_val: Optional[torch.Tensor] = None  # float32 [B, K], K = max of top_logprobs_nums
    top_logprobs_idx: Optional[torch.Tensor] = None  # int64 [B, K]


class Sampler(nn.Module):
    def forward(
        self,
        logits: torch.Tensor,
        sampling_info: Optional[SamplingBatchInfo],
        return_logprob: bool = False,
        top_logprobs_nums: Optional[list[int]] = None,
    ) -> SamplerOutput:
        """`logits` float32 [B, V]. `sampling_info` None means greedy for every row."""
        logits = logits.float()
        chosen_from = logits
        if sampling_info is not None and sampling_info.adjustments is not None:
            # Penalties, biases: not the logprobs. The penalties' kernel gives the reference's bits.
            penalize = penalize_with_kernel if PENALTIES_KERNEL and use_triton(logits) else None
            chosen_from = sampling_info.adjustments.apply(logits, penalize)
        if sampling_info is not None and sampling_info.grammar is not None:
            chosen_from = sampling_info.grammar.apply(chosen_from, logits)  # constrained rows only
        if sampling_info is None or sampling_info.is_all_greedy:
            ids = torch.argmax(chosen_from, dim=-1)
        else:
            ids = self._sample(chosen_from, sampling_info)
        out = SamplerOutput(next_token_ids=ids)
        if return_logprob:
            logprobs = torch.log_softmax(logits, dim=-1)
            out.logprobs = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1)
            k = max(top_logprobs_nums or [0])
            if k > 0:
                out.top_logprobs_val, out.top_logprobs_idx = logprobs.topk(k, dim=-1)
        return out

    def _sample(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        greedy = info.temperatures.view(-1) <= 0
        temps = torch.where(info.temperatures > 0, info.temperatures, torch.ones_like(info.temperatures))
        probs = torch.softmax(logits / temps, dim=-1)
        probs = filter_probs(probs, info)
        noise = self._exponential_noise(probs, info)
        sampled = torch.argmax(probs / noise, dim=-1)
        return torch.where(greedy, torch.argmax(logits, dim=-1), sampled)

    @staticmethod
    def _exponential_noise(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        noise = torch.empty_like(probs).exponential_()
        if info.seeds is not None:
            steps = info.steps or [0] * len(info.seeds)
            for row, seed in enumerate(info.seeds):
                if seed is None:
                    continue
                gen = torch.Generator(device=probs.device)
                gen.manual_seed(_seed_for_step(int(seed), int(steps[row])))
                noise[row].exponential_(generator=gen)
        # Exp(1) can round to 0; a zero would turn a filtered-out (p = 0) token into NaN.
        return noise.clamp_min_(1e-20)


def penalize_with_kernel(out: torch.Tensor, p: PenaltyRows, fed_tokens: Optional[torch.Tensor]) -> None:
    """LogitAdjustments' penalties through layers/triton_ops/penalties.py (the count rows read in place)."""
    penalize_fused(out, p.rows, p.table_rows, p.table.output_counts, p.table.prompt_seen if p.with_prompt else None,
                   p.params, fed_tokens)


def filter_probs(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Zero the probabilities that top-k, top-p or min-p exclude (rows are not renormalised: the
    exponential race does not need it). The most likely token always survives."""
    if info.need_top_k_sampling or info.need_top_p_sampling:
        # Rows whose filter is off carry top_k <= 0 / top_p >= 1 and get threshold 0 (keep all).
        if THRESHOLD_KERNEL and use_triton(probs):
            out = torch.empty_like(probs)
            topk_topp_threshold(probs, info.top_ks, info.top_ps, out=out)
            probs = out
        else:
            t = top_k_top_p_threshold_sort(probs, info.top_ks, info.top_ps)
            probs = probs.masked_fill(probs < t.unsqueeze(1), 0.0)
    if info.need_min_p_sampling:
        threshold = probs.max(dim=-1, keepdim=True).values * info.min_ps.unsqueeze(1)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def top_k_top_p_threshold_sort(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """The reference of triton_ops/topk_topp.py: per-row threshold (float32 [B]) from a full sort.
    The last kept position of the sorted row gives the cutoff value; comparing against a value
    (not a rank) keeps every token tied with it, as the kernel does."""
    sorted_probs, _ = probs.sort(dim=-1, descending=True)
    vocab = probs.shape[-1]
    rank = torch.arange(vocab, device=probs.device).unsqueeze(0)
    top_ks = torch.where((top_ks > 0) & (top_ks < vocab), top_ks, vocab).unsqueeze(1)
    # Drop a token when the mass strictly before it already exceeds top_p (top_p >= 1: off, even
    # where the float sum of the row passes 1).
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    top_ps = top_ps.unsqueeze(1)
    keep = (rank < top_ks) & ((before <= top_ps) | (top_ps >= 1.0))
    keep[:, 0] = True  # the most likely token always survives
    # The kept positions are a prefix of the sorted row: its last one holds the cutoff value.
    last = keep.sum(dim=-1, keepdim=True) - 1
    return sorted_probs.gather(1, last).squeeze(1).contiguous()
