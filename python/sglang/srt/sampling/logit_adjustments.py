"""What a batch's sampling parameters do to the logits before the choice: penalties and biases.

Per request, in this order (on float32 logits, out of place: the raw logits still give the
reported logprobs, as OpenAI-style APIs report them):
  1. logit_bias, added as given, and -inf on EOS and `stop_token_ids` while the request has fewer
     than `min_new_tokens` tokens (biases before penalties, as vLLM and Hugging Face order them);
  2. repetition penalty r (Hugging Face's definition): the logit of every token seen in the prompt
     or generated so far is divided by r where positive, multiplied by r otherwise;
  3. frequency and presence penalties (OpenAI's): minus `frequency * count`, minus `presence` once,
     for every token generated so far (the prompt does not count).
Temperature and the top-k / top-p / min-p filters then act on the result, greedy rows take its
argmax. The adjustments run eagerly after the logits, never inside a CUDA graph.

The penalties read the requests' rows of the token-count table when applied, through a table-row
index, with no copy of them at build time (sampling/token_counts.py: applied after the table moved
on, they refuse). `apply` takes the arithmetic of the penalised rows as a function: the torch
reference here (`penalize_reference`), or the Sampler's fused kernel on CUDA (the default there)
(layers/triton_ops/penalties.py), which does the same float32 operations in the same order, so
both give the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from sglang.srt.sampling.token_counts import TokenCounts

# A repetition penalty below this acts as this: dividing a float32 logit by less could overflow
# to inf (and a softmax over several infs is NaN); the order of the logits is the same.
REPETITION_FLOOR = 1e-6


@dataclass
class PenaltyRows:
    """The batch rows that carry a frequency, presence or repetition penalty."""

    rows: torch.Tensor  # int64 [P]: rows of the batch, ascending
    table_rows: torch.Tensor  # int64 [P]: their rows of `table`
    table: TokenCounts  # generated-token counts (as the host knows them) and prompt presence
    version: int  # table.version when built: the table must not have moved when they are applied
    # float32 [3, P]: frequency, presence, repetition (floored at REPETITION_FLOOR) per row.
    params: torch.Tensor
    with_prompt: bool  # some row has a repetition penalty: the prompt's tokens are read too
    whole_batch: bool = False  # rows is every row of the batch (0..B-1): no gather, no scatter back

    @property
    def frequency(self) -> torch.Tensor:  # float32 [P, 1]
        return self.params[0].unsqueeze(1)

    @property
    def presence(self) -> torch.Tensor:  # float32 [P, 1]
        return self.params[1].unsqueeze(1)

    @property
    def repetition(self) -> torch.Tensor:  # float32 [P, 1]
        return self.params[2].unsqueeze(1)


@dataclass
class BiasEntries:
    """What is added to the logits: logit_bias, and -inf for min_new_tokens' bans."""

    index: torch.Tensor  # int64 [E]: flat positions row * vocab_size + token of the [B, V] logits
    values: torch.Tensor  # float32 [E]
    vocab_size: int  # the row width `index` was computed for


# (out, penalties, fed_tokens): apply the penalties to out's penalised rows, in place.
Penalize = Callable[[torch.Tensor, PenaltyRows, Optional[torch.Tensor]], None]


@dataclass
class LogitAdjustments:
    penalties: Optional[PenaltyRows] = None
    bias: Optional[BiasEntries] = None
    # The step's input tokens when they were sampled by a step whose result has not reached the host
    # yet (the overlap schedule): they belong in the counts but are not in the table.
    fed_tokens: Optional[torch.Tensor] = None  # int64 [B]

    def apply(self, logits: torch.Tensor, penalize: Optional[Penalize] = None) -> torch.Tensor:
        """float32 [B, V] -> a new float32 [B, V]; `logits` is left as it is. `penalize`: how the
        penalised rows are computed (default: `penalize_reference`)."""
        out = logits.clone(memory_format=torch.contiguous_format)
        if self.bias is not None:
            assert self.bias.vocab_size == out.shape[1], (self.bias.vocab_size, out.shape)
            # Positions repeat only where a bias meets a ban (-inf whatever the order of the adds).
            out.view(-1).index_add_(0, self.bias.index, self.bias.values)
        p = self.penalties
        if p is not None:
            assert p.table.version == p.version, "the token counts changed between building and applying a step's penalties"
            assert p.table.vocab_size == out.shape[1], (p.table.vocab_size, out.shape)
            (penalize or penalize_reference)(out, p, self.fed_tokens)
        return out


def penalize_reference(out: torch.Tensor, p: PenaltyRows, fed_tokens: Optional[torch.Tensor]) -> None:
    """The penalties of the module docstring on `out`'s rows `p.rows`, in place (torch ops).
    In place where `sub` is `out` itself (whole_batch): the operations and their order are those
    of `sub - frequency * counts - presence * generated`, so the bits are too."""
    sub = out if p.whole_batch else out.index_select(0, p.rows)
    counts = p.table.output_counts.index_select(0, p.table_rows)
    if fed_tokens is not None:
        fed = fed_tokens.index_select(0, p.rows).unsqueeze(1)
        counts.scatter_add_(1, fed, torch.ones_like(fed, dtype=counts.dtype))  # a copy: the table is untouched
    generated = counts > 0
    if p.with_prompt:
        seen = generated | p.table.prompt_seen.index_select(0, p.table_rows)
        scaled = torch.where(sub > 0, sub / p.repetition, sub * p.repetition)
        torch.where(seen, scaled, sub, out=sub)
    sub.sub_(p.frequency * counts)
    sub.sub_(p.presence * generated)
    if not p.whole_batch:
        out.index_copy_(0, p.rows, sub)
