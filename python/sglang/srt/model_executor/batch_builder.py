"""Build a ForwardBatch from plain per-request data, and write the requests' req_to_token rows.

The scheduler, `bench_one_batch` and the tests describe each request of a pass with an
`ExtendRequest` or a `DecodeRequest` (pool row, tokens, KV slots already allocated, logprob
options) and call `build_extend_batch` / `build_decode_batch`. Host-side lists are packed into one
host tensor and moved to the device with a single copy; nothing here reads device memory back.

Conventions (see forward_batch_info.py):
  - EXTEND: a request with `prefix_len` cached tokens feeds `input_ids` at positions
    prefix_len .. prefix_len + n - 1; its row of req_to_token gets `out_cache_loc` there.
  - DECODE: a request feeds one token at position seq_len - 1 (`seq_len` counts it).
  - Prompt logprobs: `logprob_start_len` is the first position *within this pass* whose
    next-token logprob is wanted and `logprob_target_ids` the prompt token following each such
    position; `prompt_logprob_targets` computes both from the whole prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch

from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.configs.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo


@dataclass
class ExtendRequest:
    req_pool_index: int
    input_ids: list[int]  # the tokens of this pass, after the cached prefix
    prefix_len: int  # tokens of this request already in the KV cache
    out_cache_loc: torch.Tensor | list[int]  # KV slot of each new token (host), len(input_ids)
    return_logprob: bool = False
    logprob_start_len: int = 0
    logprob_target_ids: list[int] = field(default_factory=list)
    top_logprobs_num: int = 0
    lora_id: Optional[str] = None


@dataclass
class DecodeRequest:
    req_pool_index: int
    input_id: int  # the token fed in this step (the last one sampled)
    seq_len: int  # sequence length after this step, the fed token included
    out_cache_loc: int  # KV slot of the fed token
    return_logprob: bool = False
    top_logprobs_num: int = 0
    lora_id: Optional[str] = None


def prompt_logprob_targets(
    prompt_ids: Sequence[int], prefix_len: int, extend_len: int, start_pos: int
) -> tuple[int, list[int]]:
    """Prompt-logprob options of one pass over prompt positions [prefix_len, prefix_len + extend_len).

    `start_pos` is the first absolute prompt position whose next-token logprob is wanted (the
    logprob of prompt token t is read at position t - 1). Positions without a prompt successor
    (the last prompt token) are left out: that logprob belongs to the sampled token.
    Returns (first wanted position relative to the pass, the prompt tokens that follow them).
    """
    first = max(start_pos, prefix_len)
    last = min(prefix_len + extend_len, len(prompt_ids) - 1)
    rel = min(max(start_pos - prefix_len, 0), extend_len)
    if first >= last:
        return rel, []
    return first - prefix_len, list(prompt_ids[first + 1 : last + 1])


def _lora_ids(lora_ids: list[Optional[str]], enable_lora: bool) -> Optional[list[Optional[str]]]:
    if enable_lora:
        return lora_ids
    if any(x is not None for x in lora_ids):
        raise ValueError("a request names a LoRA adapter but LoRA is not enabled")
    return None


def _logprob_fields(reqs: Sequence[Union[ExtendRequest, DecodeRequest]]) -> dict[str, Any]:
    """The ForwardBatch's per-request logprob fields, None when no request asks for logprobs."""
    wanted = any(r.return_logprob for r in reqs)
    return dict(
        return_logprob=wanted,
        return_logprob_per_req=[r.return_logprob for r in reqs] if wanted else None,
        top_logprobs_nums=[r.top_logprobs_num for r in reqs] if wanted else None,
    )


def _move(device: torch.device | str, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """One host->device copy for many int64 vectors; returns views of the device buffer."""
    sizes = [p.numel() for p in parts]
    packed = torch.cat([p.to(torch.int64).view(-1) for p in parts]).to(device, non_blocking=True)
    return list(packed.split(sizes))


def build_extend_batch(
    reqs: Sequence[ExtendRequest],
    req_to_token_pool: ReqToTokenPool,
    device: torch.device | str,
    sampling_info: Optional[SamplingBatchInfo] = None,
    enable_lora: bool = False,
) -> ForwardBatch:
    if not reqs:
        raise ValueError("an EXTEND batch needs at least one request")
    ext_lens = [len(r.input_ids) for r in reqs]
    prefix_lens = [r.prefix_len for r in reqs]
    for r, n in zip(reqs, ext_lens):
        if n == 0:
            raise ValueError(f"request in row {r.req_pool_index} has no new tokens")
        if len(r.out_cache_loc) != n:
            raise ValueError(f"request in row {r.req_pool_index}: {len(r.out_cache_loc)} KV slots for {n} tokens")
        if r.prefix_len + n > req_to_token_pool.max_context_len:
            raise ValueError(
                f"request in row {r.req_pool_index}: {r.prefix_len + n} tokens exceed the pool's "
                f"context of {req_to_token_pool.max_context_len}"
            )
    seq_lens = [p + n for p, n in zip(prefix_lens, ext_lens)]
    starts = [0]
    for n in ext_lens[:-1]:
        starts.append(starts[-1] + n)
    positions = torch.cat([torch.arange(p, s) for p, s in zip(prefix_lens, seq_lens)])
    locs = torch.cat([torch.as_tensor(r.out_cache_loc, dtype=torch.int64) for r in reqs])
    rows = torch.repeat_interleave(
        torch.tensor([r.req_pool_index for r in reqs]), torch.tensor(ext_lens)
    )
    (input_ids, positions_d, locs_d, rows_d, req_idx, seq_d, ext_d, prefix_d, start_d) = _move(
        device,
        [
            torch.tensor([t for r in reqs for t in r.input_ids]),
            positions,
            locs,
            rows,
            torch.tensor([r.req_pool_index for r in reqs]),
            torch.tensor(seq_lens),
            torch.tensor(ext_lens),
            torch.tensor(prefix_lens),
            torch.tensor(starts),
        ],
    )
    req_to_token_pool.write_rows(rows, positions, locs, (rows_d, positions_d, locs_d))

    logprobs = _logprob_fields(reqs)
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(reqs),
        input_ids=input_ids,
        positions=positions_d,
        out_cache_loc=locs_d,
        req_pool_indices=req_idx,
        seq_lens=seq_d,
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int64),
        extend_seq_lens=ext_d,
        extend_prefix_lens=prefix_d,
        extend_start_loc=start_d,
        extend_seq_lens_cpu=ext_lens,
        extend_prefix_lens_cpu=prefix_lens,
        extend_num_tokens=sum(ext_lens),
        lora_ids=_lora_ids([r.lora_id for r in reqs], enable_lora),
        **logprobs,
        extend_logprob_start_lens=[r.logprob_start_len for r in reqs] if logprobs["return_logprob"] else None,
        extend_logprob_target_ids=(
            [list(r.logprob_target_ids) for r in reqs] if logprobs["return_logprob"] else None
        ),
        sampling_info=sampling_info,
    )


def build_decode_batch(
    reqs: Sequence[DecodeRequest],
    req_to_token_pool: ReqToTokenPool,
    device: torch.device | str,
    sampling_info: Optional[SamplingBatchInfo] = None,
    enable_lora: bool = False,
) -> ForwardBatch:
    if not reqs:
        raise ValueError("a DECODE batch needs at least one request")
    # A decode step is built for every running request on every step, on the host while the GPU
    # waits: one pass over the requests and one host tensor for the five vectors, which `split`
    # leaves back to back on the device as `_move` does (the CPU measured 150 -> 65 µs at 64
    # requests against five tensors and a cat).
    n = len(reqs)
    ids, seq_lens, locs_l, rows_l = [], [], [], []
    for r in reqs:
        ids.append(r.input_id)
        seq_lens.append(r.seq_len)
        locs_l.append(r.out_cache_loc)
        rows_l.append(r.req_pool_index)
    max_len = req_to_token_pool.max_context_len
    if min(seq_lens) < 1 or max(seq_lens) > max_len:
        bad = next(r for r in reqs if not 1 <= r.seq_len <= max_len)
        raise ValueError(f"request in row {bad.req_pool_index}: seq_len {bad.seq_len} out of range")
    host = torch.tensor(ids + [s - 1 for s in seq_lens] + locs_l + rows_l + seq_lens, dtype=torch.int64)
    input_ids, positions, locs, req_idx, seq_d = host.to(device, non_blocking=True).split(n)
    req_to_token_pool.write_rows(host[3 * n:4 * n], host[n:2 * n], host[2 * n:3 * n], (req_idx, positions, locs))
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=n,
        input_ids=input_ids,
        positions=positions,
        out_cache_loc=locs,
        req_pool_indices=req_idx,
        seq_lens=seq_d,
        seq_lens_cpu=host[4 * n:].clone(),  # its own tensor: on a CPU device `host` is the batch's
        lora_ids=_lora_ids([r.lora_id for r in reqs], enable_lora),
        **_logprob_fields(reqs),
        sampling_info=sampling_info,
    )
