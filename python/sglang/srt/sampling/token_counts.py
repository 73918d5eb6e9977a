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

Requests without penalties cost nothing: the tables are allocated at the first penalised request
and grow by doubling, so their size follows the most penalised requests running at once.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch


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
        # Lowest rows first, so a small batch touches a compact block.
        self.free_rows = list(range(new - 1, old - 1, -1)) + self.free_rows

    def rows_for(self, reqs: Sequence[CountedRequest]) -> list[int]:
        """Each request's row, assigned where missing and brought up to its `output_ids`."""
        pairs_rows: list[int] = []
        pairs_tokens: list[int] = []
        for req in reqs:
            if req.counts_row is None:
                if not self.free_rows:
                    self._grow()
                row = self.free_rows.pop()
                self.output_counts[row].zero_()
                seen = self.prompt_seen[row]
                seen.zero_()
                seen[torch.tensor(req.origin_input_ids, dtype=torch.int64).to(self.device, non_blocking=True)] = True
                req.counts_row, req.counts_synced = row, 0
            new = req.output_ids[req.counts_synced:]
            if new:
                pairs_rows += [req.counts_row] * len(new)
                pairs_tokens += new
                req.counts_synced = len(req.output_ids)
        if pairs_rows:
            index = torch.tensor([pairs_rows, pairs_tokens], dtype=torch.int64).to(self.device, non_blocking=True)
            ones = torch.ones(len(pairs_rows), dtype=torch.int32, device=self.device)
            self.output_counts.index_put_((index[0], index[1]), ones, accumulate=True)
        return [req.counts_row for req in reqs]

    def release(self, req: CountedRequest) -> None:
        """Give the request's row back (idempotent); it is cleared when next assigned."""
        if req.counts_row is not None:
            self.free_rows.append(req.counts_row)
            req.counts_row, req.counts_synced = None, 0
