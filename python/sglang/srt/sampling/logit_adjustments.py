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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


# A repetition penalty below this acts as this: dividing a float32 logit by less could overflow
# to inf (and a softmax over several infs is NaN); the order of the logits is the same.
REPETITION_FLOOR = 1e-6


@dataclass
class PenaltyRows:
    """The batch rows that carry a frequency, presence or repetition penalty."""

    rows: torch.Tensor  # int64 [P]: rows of the batch
    output_counts: torch.Tensor  # int32 [P, V]: tokens generated so far (as the host knows them)
    prompt_seen: Optional[torch.Tensor]  # bool [P, V]; None when no row has a repetition penalty
    frequency: torch.Tensor  # float32 [P, 1]
    presence: torch.Tensor  # float32 [P, 1]
    repetition: torch.Tensor  # float32 [P, 1]


@dataclass
class LogitAdjustments:
    penalties: Optional[PenaltyRows] = None
    # (row, token, value) triples added to the logits: logit_bias, and -inf for min_new_tokens.
    bias_rows: Optional[torch.Tensor] = None  # int64 [E]
    bias_tokens: Optional[torch.Tensor] = None  # int64 [E]
    bias_values: Optional[torch.Tensor] = None  # float32 [E]
    # The step's input tokens when they were sampled by a step whose result has not reached the host
    # yet (the overlap schedule): they belong in the counts but are not in `output_counts`.
    fed_tokens: Optional[torch.Tensor] = None  # int64 [B]

    @classmethod
    def build(
        cls,
        penalties: Optional[tuple[list[int], torch.Tensor, Optional[torch.Tensor], list[float], list[float], list[float]]],
        biases: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        device: torch.device | str,
    ) -> Optional["LogitAdjustments"]:
        """`penalties`: (rows, their output counts, their prompt presence, frequency, presence,
        repetition per row), the tables already gathered on the device; `biases`: (rows, tokens,
        values) on the device. None when there is nothing to adjust."""
        if penalties is None and biases is None:
            return None
        out = cls()
        if penalties is not None:
            rows, counts, seen, freq, pres, rep = penalties
            rep = [max(r, REPETITION_FLOOR) for r in rep]
            floats = torch.tensor([freq, pres, rep], dtype=torch.float32).to(device, non_blocking=True)
            out.penalties = PenaltyRows(
                rows=torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True),
                output_counts=counts,
                prompt_seen=seen,
                frequency=floats[0].unsqueeze(1),
                presence=floats[1].unsqueeze(1),
                repetition=floats[2].unsqueeze(1),
            )
        if biases is not None:
            out.bias_rows, out.bias_tokens, out.bias_values = biases
        return out

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 [B, V] -> a new float32 [B, V]; `logits` is left as it is."""
        out = logits.clone()
        if self.bias_rows is not None:
            out.index_put_((self.bias_rows, self.bias_tokens), self.bias_values, accumulate=True)
        p = self.penalties
        if p is not None:
            sub = out.index_select(0, p.rows)
            counts = p.output_counts
            if self.fed_tokens is not None:
                fed = self.fed_tokens.index_select(0, p.rows).unsqueeze(1)
                counts = counts.scatter_add(1, fed, torch.ones_like(fed, dtype=counts.dtype))
            generated = counts > 0
            if p.prompt_seen is not None:
                seen = generated | p.prompt_seen
                scaled = torch.where(sub > 0, sub / p.repetition, sub * p.repetition)
                sub = torch.where(seen, scaled, sub)
            sub = sub - p.frequency * counts - p.presence * generated
            out.index_copy_(0, p.rows, sub)
        return out
