"""Per-request token histories on the device, for the penalties that read them.

The frequency and presence penalties need how often each token has been generated; the repetition
penalty also needs which tokens the prompt holds. Rebuilding that from the host's token lists every
step would copy a request's whole history each time, so each penalised request owns a row of two
[rows, vocab] tables (generated-token counts, prompt-token presence). A row is written when the
request first needs it and then only with the tokens the host has appended since (one scatter for
the whole batch); it is given back when the request finishes.

The counts mirror the host's `output_ids` exactly (a retracted request keeps its row and resumes
with it). A token sampled by a step whose result has not reached the host yet (the overlap
schedule) is not in them: the sampler adds it from the step's input tokens (logit_adjustments.py).

The sampler reads the rows in place (no per-step copy of them), so what a step's adjustments see
is the table as it is when they are applied; `version` counts the table's changes, and a step's
adjustments check that it has not moved since they were built (the runner samples a batch right
after building it, in stream order, before the next batch is built).

Requests without penalties cost nothing: the tables are allocated at the first penalised request
and grow by doubling, so their size follows the most penalised requests running at once.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from sglang.srt.sampling.host_copy import to_device


class CountedRequest(Protocol):
    """What the table reads of a request (the scheduler's `Req`)."""

    origin_input_ids: list[int]
    output_ids: list[int]
    counts_row: "int | None"
    counts_synced: int


class TokenCounts:
    MIN_ROWS = 8

    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=self.device)
        self.prompt_seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=self.device)
        self.free_rows: list[int] = []
        self.version = 0  # bumped by every change to the tables (see the module docstring)
        self._ones = torch.ones(0, dtype=torch.int32, device=self.device)

    @property
    def capacity(self) -> int:
        return self.output_counts.shape[0]

    @property
    def rows_in_use(self) -> int:
        return self.capacity - len(self.free_rows)

    def _grow(self) -> None:
        old = self.capacity
        new = max(self.MIN_ROWS, 2 * old)
        counts = torch.zeros(new, self.vocab_size, dtype=torch.int32, device=self.device)
        seen = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        counts[:old] = self.output_counts
        seen[:old] = self.prompt_seen
        self.output_counts, self.prompt_seen = counts, seen
        self.version += 1
        # Lowest rows first, so a small batch touches a compact block.
        self.free_rows = list(range(new - 1, old - 1, -1)) + self.free_rows

    def rows_for(self, reqs: Sequence[CountedRequest]) -> list[int]:
        """Each request's row, assigned where missing and brought up to its `output_ids`."""
        # The new tokens as flat positions (row * vocab + token) of the counts: one small copy and
        # one index_add for the whole batch (usually one token per request).
        flat: list[int] = []
        rows: list[int] = []
        vocab = self.vocab_size
        for req in reqs:
            if req.counts_row is None:
                self._assign(req)
            row, out, synced = req.counts_row, req.output_ids, req.counts_synced
            rows.append(row)
            n = len(out)
            if n > synced:
                flat.extend([row * vocab + t for t in out[synced:]])
                req.counts_synced = n
        if flat:
            self.output_counts.view(-1).index_add_(0, to_device(flat, torch.int64, self.device), self._ones_of(len(flat)))
            self.version += 1
        return rows

    def _assign(self, req: CountedRequest) -> None:
        if not self.free_rows:
            self._grow()
        row = self.free_rows.pop()
        self.output_counts[row].zero_()
        seen = self.prompt_seen[row]
        seen.zero_()
        seen[to_device(req.origin_input_ids, torch.int64, self.device)] = True
        req.counts_row, req.counts_synced = row, 0
        self.version += 1

    def _ones_of(self, n: int) -> torch.Tensor:
        """n int32 ones on the device (a slice of one buffer: only ever read)."""
        if self._ones.numel() < n:
            self._ones = torch.ones(max(n, 2 * self._ones.numel(), 64), dtype=torch.int32, device=self.device)
        return self._ones[:n]

    def release(self, req: CountedRequest) -> None:
        """Give the request's row back (idempotent); it is cleared when next assigned."""
        if req.counts_row is not None:
            self.free_rows.append(req.counts_row)
            req.counts_row, req.counts_synced = None, 0
