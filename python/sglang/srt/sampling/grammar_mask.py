"""The grammar mask of a batch's constrained rows, applied to the logits before the choice.

A constrained request's matcher (sglang/srt/constrained/) fills one row of a packed bitmask on the
host: int32 words, bit j of word w allowing token 32 * w + j (xgrammar's layout). The scheduler
copies the rows of the batch's constrained requests to the device once per step; the sampler sets
every token a row does not allow to -inf in its private copy of the logits, after the penalties and
biases and before temperature, top-k/top-p/min-p and greedy. Rows without a grammar are not
touched (their values are copied bit for bit), and the reported logprobs stay those of the model,
as for the penalties (sampling/logit_adjustments.py). It runs in the eager tail, never in a graph.

One conflict is resolved here: `min_new_tokens` bans EOS with -inf, while a complete grammar
allows nothing but EOS. A row left with no finite logit takes the grammar's mask alone, so the
grammar wins and the request ends (the other adjustments would otherwise pick a token the grammar
refuses, or read NaN from a softmax over -inf).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS_PER_WORD = 32


def bitmask_words(vocab_size: int) -> int:
    """Words of one packed bitmask row for `vocab_size` tokens."""
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def new_host_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """int32 [rows, words] on the host, every token allowed (what a matcher's fill overwrites)."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [G, W] -> bool [G, vocab_size] (True: allowed); tokens past the mask are not allowed."""
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    pad = torch.zeros(bits.shape[0], vocab_size - bits.shape[1], dtype=torch.bool, device=bits.device)
    return torch.cat((bits, pad), dim=1)


@dataclass
class GrammarMask:
    rows: torch.Tensor  # int64 [G]: the batch rows whose grammar restricts the next token
    bitmask: torch.Tensor  # int32 [G, W], on the logits' device

    @classmethod
    def build(cls, rows: list[int], host_bitmask: torch.Tensor, device: torch.device | str) -> "GrammarMask":
        """From the host bitmask of `rows` (row i of it belongs to batch row rows[i]); the copies are
        queued without waiting (from pinned memory on CUDA)."""
        assert host_bitmask.shape[0] == len(rows) and host_bitmask.dtype == torch.int32
        index = torch.tensor(rows, dtype=torch.int64)
        if torch.device(device).type == "cuda":
            index, host_bitmask = index.pin_memory(), host_bitmask.pin_memory()
        return cls(rows=index.to(device, non_blocking=True), bitmask=host_bitmask.to(device, non_blocking=True))

    def apply(self, logits: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
        """float32 [B, V] -> a new float32 [B, V] with the disallowed tokens of the constrained rows at
        -inf. `logits`: what the choice reads so far (penalties applied); `raw`: the model's logits,
        whose masked row replaces a row the adjustments left without any allowed token."""
        allowed = unpack_bitmask(self.bitmask, logits.shape[1])
        neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
        masked = torch.where(allowed, logits.index_select(0, self.rows), neg_inf)
        if logits is not raw:
            dead = torch.isneginf(masked).all(dim=1, keepdim=True)
            masked = torch.where(dead, torch.where(allowed, raw.index_select(0, self.rows), neg_inf), masked)
        return logits.index_copy(0, self.rows, masked)
