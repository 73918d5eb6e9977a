"""The head of the eager tail: hidden states -> next-token logits and prompt logprobs.

EXTEND: each request's last row gives its next-token logits; rows listed by the logprob options
give prompt logprobs. DECODE: every row is a request's last token. Row indices are computed from
host lists (`extend_seq_lens_cpu`, the logprob options), never by reading device tensors, so the
only host sync of the tail is the final copy of the results.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Optional

import torch
from torch import nn

from sglang.srt.configs.forward_batch_info import ForwardBatch
from sglang.srt.configs.runner_output import TopLogprobs

# Prompt logprobs are computed in row chunks so [rows, vocab] float32 buffers stay near 128 MiB.
_LOGPROB_CHUNK_ELEMS = 1 << 25


@dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor  # float32 [B, V]
    # Prompt logprobs over the N requested positions, requests concatenated in batch order.
    input_token_logprobs: Optional[torch.Tensor] = None  # float32 [N]
    input_top_logprobs_val: Optional[torch.Tensor] = None  # float32 [N, K], K = max asked
    input_top_logprobs_idx: Optional[torch.Tensor] = None  # int64 [N, K]
    # Per request: (offset into N, count), or None when the request did not ask.
    input_logprob_segments: Optional[list[Optional[tuple[int, int]]]] = None
    top_logprobs_nums: Optional[list[int]] = None

    def input_logprobs_lists(
        self,
    ) -> tuple[Optional[list[Optional[list[float]]]], Optional[list[Optional[list[TopLogprobs]]]]]:
        """The prompt logprobs in ModelRunnerOutput's format (this copies to the host)."""
        if self.input_logprob_segments is None:
            return None, None
        values = self.input_token_logprobs.tolist()
        top_val = top_idx = None
        if self.input_top_logprobs_val is not None:
            top_val = self.input_top_logprobs_val.tolist()
            top_idx = self.input_top_logprobs_idx.tolist()
        token_lps: list[Optional[list[float]]] = []
        top_lps: list[Optional[list[TopLogprobs]]] = []
        for i, seg in enumerate(self.input_logprob_segments):
            if seg is None:
                token_lps.append(None)
                top_lps.append(None)
                continue
            off, n = seg
            token_lps.append(values[off : off + n])
            k = self.top_logprobs_nums[i] if self.top_logprobs_nums else 0
            if k > 0 and top_val is not None:
                top_lps.append([(top_val[r][:k], top_idx[r][:k]) for r in range(off, off + n)])
            else:
                top_lps.append(None)
        return token_lps, top_lps


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def compute_logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """[N, H] -> float32 [N, V]; the matmul runs in the model dtype, like the HF reference.
        Under tensor parallelism the head gathers the full vocabulary on every rank."""
        return lm_head.compute_logits(hidden).float()

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        lm_head: nn.Module,
        forward_batch: ForwardBatch,
    ) -> LogitsProcessorOutput:
        fb = forward_batch
        bs = fb.batch_size
        if not fb.forward_mode.is_extend():
            return LogitsProcessorOutput(next_token_logits=self.compute_logits(hidden_states[:bs], lm_head))

        lens = fb.extend_seq_lens_cpu
        assert lens is not None and len(lens) == bs, "EXTEND batch needs extend_seq_lens_cpu"
        starts = [0, *accumulate(lens)][:-1]
        last_rows = [s + n - 1 for s, n in zip(starts, lens)]
        prompt_rows, targets, segments = self._prompt_logprob_rows(fb, starts, lens)

        if bs == 1:
            last_hidden = hidden_states.narrow(0, last_rows[0], 1)  # a view: no copy, no index upload
        else:
            last_idx = torch.tensor(last_rows, dtype=torch.int64).to(hidden_states.device, non_blocking=True)
            last_hidden = hidden_states.index_select(0, last_idx)
        out = LogitsProcessorOutput(next_token_logits=self.compute_logits(last_hidden, lm_head))
        if segments is None:
            return out
        out.input_logprob_segments = segments
        out.top_logprobs_nums = list(fb.top_logprobs_nums or [0] * bs)
        k = max((out.top_logprobs_nums[i] for i, s in enumerate(segments) if s), default=0)
        self._prompt_logprobs(out, hidden_states, lm_head, prompt_rows, targets, k)
        return out

    @staticmethod
    def _prompt_logprob_rows(
        fb: ForwardBatch, starts: list[int], lens: list[int]
    ) -> tuple[list[int], list[int], Optional[list[Optional[tuple[int, int]]]]]:
        if not fb.return_logprob or fb.extend_logprob_target_ids is None:
            return [], [], None
        per_req = fb.return_logprob_per_req or [True] * fb.batch_size
        rows: list[int] = []
        targets: list[int] = []
        segments: list[Optional[tuple[int, int]]] = []
        for i in range(fb.batch_size):
            if not per_req[i]:
                segments.append(None)
                continue
            tgt = fb.extend_logprob_target_ids[i] or []
            first = fb.extend_logprob_start_lens[i] if fb.extend_logprob_start_lens else 0
            if first + len(tgt) > lens[i]:
                raise ValueError(
                    f"request {i}: {len(tgt)} logprob targets from position {first} exceed the "
                    f"{lens[i]} tokens of this pass"
                )
            segments.append((len(rows), len(tgt)))
            rows.extend(range(starts[i] + first, starts[i] + first + len(tgt)))
            targets.extend(tgt)
        return rows, targets, segments

    def _prompt_logprobs(
        self,
        out: LogitsProcessorOutput,
        hidden: torch.Tensor,
        lm_head: nn.Module,
        rows: list[int],
        targets: list[int],
        k: int,
    ) -> None:
        device = hidden.device
        row_idx = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
        tgt_idx = torch.tensor(targets, dtype=torch.int64).to(device, non_blocking=True)
        chunk = max(1, _LOGPROB_CHUNK_ELEMS // max(self.vocab_size, 1))
        vals, top_v, top_i = [], [], []
        for s in range(0, len(rows), chunk):
            logits = self.compute_logits(hidden.index_select(0, row_idx[s : s + chunk]), lm_head)
            logprobs = torch.log_softmax(logits, dim=-1)
            vals.append(logprobs.gather(1, tgt_idx[s : s + chunk, None]).squeeze(1))
            if k > 0:
                v, i = logprobs.topk(k, dim=-1)
                top_v.append(v)
                top_i.append(i)
        empty = torch.empty(0, dtype=torch.float32, device=device)
        out.input_token_logprobs = torch.cat(vals) if vals else empty
        if k > 0:
            out.input_top_logprobs_val = torch.cat(top_v) if top_v else empty.view(0, k)
            out.input_top_logprobs_idx = (
                torch.cat(top_i) if top_i else torch.empty(0, k, dtype=torch.int64, device=device)
            )
