"""Static input buffers shared by the graph runners, and the bucket arithmetic.

A captured graph reads its inputs from fixed addresses. These buffers are allocated once, sized for
the largest bucket; a capture batch's tensors are views of their prefixes, and before a replay the
live batch is copied into them with the padded tail set to harmless values:

    input_ids  [ live tokens ........ | 0 0 0 ]      pad tokens embed token 0,
    positions  [ live positions ..... | 0 0 0 ]      sit at position 0,
    out_cache_loc [ live KV slots ... | 0 0 0 ]      and write their K/V to the dummy slot 0.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.configs.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.utils import stacked_view


# A prefill replay may pad its tokens up to this factor; beyond it the wasted work outweighs the
# launches saved.
MAX_PADDING_FACTOR = 2


def pick_bucket(buckets: list[int], n: int) -> Optional[int]:
    """Smallest bucket >= n (buckets sorted ascending), or None if n exceeds them all."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


def prefill_replay_bucket(buckets: list[int], num_tokens: int) -> Optional[int]:
    """The bucket a prefill of `num_tokens` replays in, or None when it must run eagerly: more
    tokens than the largest bucket, or padding that would more than double the work."""
    if num_tokens <= 0:
        return None
    bucket = pick_bucket(buckets, num_tokens)
    if bucket is None or bucket > MAX_PADDING_FACTOR * num_tokens:
        return None
    return bucket


@dataclass
class GraphInputBuffers:
    # The three token-wise inputs are the rows of `tokens` [3, max_tokens], so a live batch whose
    # vectors lie back to back (the batch builders' one packed copy) loads with one copy.
    tokens: torch.Tensor  # int64 [3, max_tokens]: input_ids, positions, out_cache_loc
    input_ids: torch.Tensor  # int64 [max_tokens]
    positions: torch.Tensor  # int64 [max_tokens]
    out_cache_loc: torch.Tensor  # int64 [max_tokens]
    # Per-request tensors of capture batches (views of these are handed to the capture batch).
    req_pool_indices: torch.Tensor  # int64 [max_reqs]
    seq_lens: torch.Tensor  # int64 [max_reqs]
    extend_seq_lens: torch.Tensor  # int64 [max_reqs]
    extend_prefix_lens: torch.Tensor  # int64 [max_reqs]
    extend_start_loc: torch.Tensor  # int64 [max_reqs]
    dummy_req_row: int

    @classmethod
    def allocate(
        cls, max_tokens: int, max_reqs: int, device: torch.device, dummy_req_row: int
    ) -> "GraphInputBuffers":
        def zeros(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int64, device=device)

        # Rows padded to 16 elements (128 bytes): every row starts as aligned as its own tensor would.
        tokens = torch.zeros(3, -(-max_tokens // 16) * 16, dtype=torch.int64, device=device)[:, :max_tokens]
        bufs = cls(
            tokens=tokens,
            input_ids=tokens[0],
            positions=tokens[1],
            out_cache_loc=tokens[2],
            req_pool_indices=zeros(max_reqs),
            seq_lens=zeros(max_reqs),
            extend_seq_lens=zeros(max_reqs),
            extend_prefix_lens=zeros(max_reqs),
            extend_start_loc=zeros(max_reqs),
            dummy_req_row=dummy_req_row,
        )
        bufs.req_pool_indices.fill_(dummy_req_row)
        return bufs

    def load_tokens(self, fb: ForwardBatch, padded: int) -> None:
        """Copy the live batch's token-wise inputs into the prefixes and neutralise the padding."""
        n = fb.num_tokens
        live = stacked_view(fb.input_ids, fb.positions, fb.out_cache_loc)
        if live is not None and live.shape[1] == n:
            self.tokens[:, :n].copy_(live, non_blocking=True)
        else:
            self.input_ids[:n].copy_(fb.input_ids, non_blocking=True)
            self.positions[:n].copy_(fb.positions, non_blocking=True)
            self.out_cache_loc[:n].copy_(fb.out_cache_loc, non_blocking=True)
        if padded > n:
            self.tokens[:, n:padded].zero_()

    def padded_view(self, fb: ForwardBatch, padded: int) -> ForwardBatch:
        """The live batch with its token tensors replaced by the padded static prefixes (the
        per-request metadata stays live): what a graph segment and its eager breaks see."""
        return dataclasses.replace(
            fb,
            input_ids=self.input_ids[:padded],
            positions=self.positions[:padded],
            out_cache_loc=self.out_cache_loc[:padded],
        )

    def capture_extend_batch(
        self, num_tokens: int, num_reqs: int, with_lora: bool, max_req_tokens: Optional[int] = None
    ) -> ForwardBatch:
        """An EXTEND batch for capture, valid for the model: the tokens fill requests of at most
        `max_req_tokens` (the context length) in order, and each request's positions start at 0,
        so no position passes the rotary table and no request passes its req_to_token row. The
        requests left over are empty. (A bucket larger than the context length is one a batch of
        several requests fills.)

        Every request points at the dummy row, whose req_to_token entries are all slot 0. The caller
        attaches the pools and the attention backend.
        """
        per_req = num_tokens if max_req_tokens is None else max_req_tokens
        if per_req < 1 or num_tokens > num_reqs * per_req:
            raise ValueError(
                f"a capture batch of {num_tokens} tokens does not fit {num_reqs} request(s) of at most "
                f"{per_req} tokens"
            )
        lens = [min(per_req, max(num_tokens - i * per_req, 0)) for i in range(num_reqs)]
        starts = [min(i * per_req, num_tokens) for i in range(num_reqs)]
        host = torch.tensor([lens, starts], dtype=torch.int64)
        self.seq_lens[:num_reqs].copy_(host[0])
        self.extend_seq_lens[:num_reqs].copy_(host[0])
        self.extend_prefix_lens[:num_reqs].zero_()
        self.extend_start_loc[:num_reqs].copy_(host[1])
        self.req_pool_indices[:num_reqs].fill_(self.dummy_req_row)
        self.input_ids[:num_tokens].zero_()
        positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens if n > 0])
        self.positions[:num_tokens].copy_(positions)
        self.out_cache_loc[:num_tokens].zero_()
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=num_reqs,
            input_ids=self.input_ids[:num_tokens],
            positions=self.positions[:num_tokens],
            out_cache_loc=self.out_cache_loc[:num_tokens],
            req_pool_indices=self.req_pool_indices[:num_reqs],
            seq_lens=self.seq_lens[:num_reqs],
            seq_lens_cpu=host[0].clone(),
            extend_seq_lens=self.extend_seq_lens[:num_reqs],
            extend_prefix_lens=self.extend_prefix_lens[:num_reqs],
            extend_start_loc=self.extend_start_loc[:num_reqs],
            extend_seq_lens_cpu=list(lens),
            extend_prefix_lens_cpu=[0] * num_reqs,
            extend_num_tokens=num_tokens,
            # Capture with the base model everywhere: LoRA kernels are recorded but idle (rank 0).
            lora_ids=[None] * num_reqs if with_lora else None,
        )

    def capture_decode_batch(self, bs: int, seq_len_fill: int, with_lora: bool) -> ForwardBatch:
        self.req_pool_indices[:bs].fill_(self.dummy_req_row)
        self.seq_lens[:bs].fill_(seq_len_fill)
        self.input_ids[:bs].zero_()
        self.positions[:bs].zero_()
        self.out_cache_loc[:bs].zero_()
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=torch.full((bs,), seq_len_fill, dtype=torch.int64),
            lora_ids=[None] * bs if with_lora else None,
        )
