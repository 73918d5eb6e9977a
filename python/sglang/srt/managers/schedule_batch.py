"""`ScheduleBatch`: the requests of one forward pass, their KV allocation, and their ForwardBatch.

The scheduler decides *which* requests run (schedule_policy.py); this file turns that decision
into memory (request rows, KV slots) and tensors, through the engine core's `batch_builder`, and
gives memory back when a request finishes, is aborted or is retracted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch

from sglang.srt.managers.req import Req
from sglang.srt.model_executor.batch_builder import (
    DecodeRequest,
    ExtendRequest,
    build_decode_batch,
    build_extend_batch,
)
from sglang.srt.configs.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.managers.logit_context import LogitContext, logit_adjustments_for
from sglang.srt.sampling.grammar_mask import GrammarMask, new_host_bitmask
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner

__all__ = ["LogitContext", "Req", "ScheduleBatch", "release_kv"]


def release_kv(req: Req, model_runner: "ModelRunner") -> None:
    """Give back a request's KV slots and its request row (idempotent)."""
    if req.req_pool_idx is None:
        req.kv_len = 0
        return
    pool = model_runner.req_to_token_pool
    if req.kv_len > 0:
        slots = pool.slots([req.req_pool_idx], req.kv_len)[0]
        model_runner.token_to_kv_pool_allocator.free(slots)
    pool.free(req.req_pool_idx)
    req.req_pool_idx = None
    req.kv_len = 0


def make_room(model_runner: "ModelRunner", n: int, evict: Optional[Callable[[int], int]]) -> None:
    """Evict cached prefixes (`evict`, with a prefix cache) until n KV slots are free, if short."""
    short = n - model_runner.token_to_kv_pool_allocator.available_size()
    if short > 0 and evict is not None:
        evict(short)


def alloc_kv(model_runner: "ModelRunner", n: int, evict: Optional[Callable[[int], int]]) -> Optional[torch.Tensor]:
    """n free KV slots, evicting cached prefixes first if short."""
    make_room(model_runner, n, evict)
    return model_runner.token_to_kv_pool_allocator.alloc(n)


def grammar_mask_for(reqs: list[Req], vocab_size: int, device: torch.device | str) -> Optional[GrammarMask]:
    """The next-token masks of the constrained requests (their matchers fill them on the host,
    sampling/grammar_mask.py); None when no request is constrained or every grammar allows every
    token here."""
    rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
    if not rows:
        return None
    host = new_host_bitmask(len(rows), vocab_size)
    kept = [j for j, i in enumerate(rows) if reqs[i].grammar.fill_next_token_bitmask(host, j)]
    if not kept:
        return None
    if len(kept) < len(rows):
        host = host[kept]
    return GrammarMask.build([rows[j] for j in kept], host, device)


def sampling_info_for(reqs: list[Req], device: torch.device | str, pending: int = 0, *,
                      logit_ctx: LogitContext) -> Optional[SamplingBatchInfo]:
    """The batch's sampling tensors; None when every request is greedy and adjusts no logits,
    which the Sampler reads as argmax for every row (what it does with an all-greedy info too) and
    which costs no tensors and no copies (the CPU measured 168 µs per step at 64 requests for
    building them). `pending`: tokens each request has sampled that its output_ids do not hold
    yet (a seeded request's step and min_new_tokens count them). `logit_ctx` (the scheduler's):
    what the batch's composition fixes is built once and reused while the same requests come back
    (managers/logit_context.py)."""
    constrained = any(r.grammar is not None for r in reqs)
    # A grammar's mask is read from its matcher, which has accepted every token on the host: the
    # overlap schedule never feeds a constrained request a token still on the device.
    assert not (constrained and pending), "a constrained request in a step launched ahead of its token"
    plan = logit_ctx.plan_for(reqs)
    if not plan.adjusting and not constrained and plan.all_greedy:
        return None
    if plan.base is None:
        plan.base = _base_info(reqs, device)
    return dataclasses.replace(
        plan.base,
        steps=[len(r.output_ids) + pending for r in reqs],
        adjustments=logit_adjustments_for(reqs, logit_ctx, pending, plan) if plan.adjusting else None,
        grammar=grammar_mask_for(reqs, logit_ctx.vocab_size, device) if constrained else None,
    )


def _base_info(reqs: list[Req], device: torch.device | str) -> SamplingBatchInfo:
    """The tensors of the requests' sampling parameters (steps, adjustments, grammar: the step's)."""
    params = [r.sampling_params for r in reqs]
    return SamplingBatchInfo.from_params(
        temperatures=[0.0 if p.is_greedy else float(p.temperature) for p in params],
        top_ps=[float(p.top_p) for p in params],
        top_ks=[int(p.top_k) for p in params],
        min_ps=[float(p.min_p) for p in params],
        seeds=[p.seed for p in params],
        steps=[],
        device=device,
    )


@dataclass
class ScheduleBatch:
    mode: ForwardMode
    reqs: list[Req]
    forward_batch: ForwardBatch
    # Prefill only: the pass's prompt-logprob targets per request (to pair values with token ids).
    logprob_targets: Optional[list[list[int]]] = None

    @property
    def is_extend(self) -> bool:
        return self.mode.is_extend()

    @classmethod
    def prepare_extend(cls, reqs: list[Req], model_runner: "ModelRunner",
                       evict: Optional[Callable[[int], int]] = None,
                       keep_lora_ids: frozenset = frozenset(), *,
                       logit_ctx: LogitContext) -> "ScheduleBatch":
        """Allocate rows and KV for each request's `extend_len` tokens and build the batch (a
        request admitted with a cached prefix already has its row, holding that prefix).
        `keep_lora_ids`: adapters that stay resident with the batch (ForwardBatch.keep_lora_ids).
        `logit_ctx`: the scheduler's (the penalties' token counts, the batch compositions' plans).

        Admission already checked that the memory is free or evictable; running out here is a bug.
        """
        pool = model_runner.req_to_token_pool
        items: list[ExtendRequest] = []
        targets: list[list[int]] = []
        make_room(model_runner, sum(req.extend_len for req in reqs), evict)  # one eviction pass
        for req in reqs:
            if req.req_pool_idx is None:
                rows = pool.alloc(1)
                assert rows is not None, "admission let in more requests than there are rows"
                req.req_pool_idx = rows[0]
            n = req.extend_len
            locs = model_runner.token_to_kv_pool_allocator.alloc(n)
            assert locs is not None, "admission let in more tokens than there are free KV slots"
            start = req.kv_len
            rel, tgt = req.prompt_logprob_targets(start, n) if req.return_logprob else (n, [])
            items.append(ExtendRequest(
                req_pool_index=req.req_pool_idx,
                input_ids=req.fill_ids[start : start + n],
                prefix_len=start,
                out_cache_loc=locs,
                return_logprob=req.return_logprob,
                logprob_start_len=rel,
                logprob_target_ids=tgt,
                top_logprobs_num=req.top_logprobs_num,
                lora_id=req.lora_id,
            ))
            targets.append(tgt)
            # From here on the slots belong to the request (freed with it even if the pass fails).
            req.kv_len = start + n
        fb = build_extend_batch(
            items, pool, model_runner.device,
            sampling_info=sampling_info_for(reqs, model_runner.device, logit_ctx=logit_ctx),
            enable_lora=model_runner.lora_manager is not None,
        )
        fb.keep_lora_ids = keep_lora_ids
        return cls(ForwardMode.EXTEND, list(reqs), fb, logprob_targets=targets)

    @classmethod
    def prepare_decode(cls, reqs: list[Req], model_runner: "ModelRunner",
                       evict: Optional[Callable[[int], int]] = None,
                       input_ids: Optional[torch.Tensor] = None, *,
                       logit_ctx: LogitContext) -> "ScheduleBatch":
        """One new KV slot per request (the caller made sure there are enough, evictable included).

        `input_ids` (device, one per request): the tokens to feed, sampled by a step whose results
        have not reached the host yet (the overlap schedule); the requests' output_ids lack them."""
        locs = alloc_kv(model_runner, len(reqs), evict)
        assert locs is not None, "decode started without a free KV slot per request"
        pending = 0 if input_ids is None else 1
        items = []
        for req, loc in zip(reqs, locs.tolist()):
            # The last sampled token is fed now; its KV goes at position kv_len.
            items.append(DecodeRequest(
                req_pool_index=req.req_pool_idx,
                input_id=req.output_ids[-1] if input_ids is None else 0,
                seq_len=req.kv_len + 1,
                out_cache_loc=loc,
                return_logprob=req.return_logprob,
                top_logprobs_num=req.top_logprobs_num,
                lora_id=req.lora_id,
            ))
            req.kv_len += 1
        fb = build_decode_batch(
            items, model_runner.req_to_token_pool, model_runner.device,
            sampling_info=sampling_info_for(reqs, model_runner.device, pending, logit_ctx=logit_ctx),
            enable_lora=model_runner.lora_manager is not None,
        )
        if input_ids is not None:
            fb.input_ids.copy_(input_ids)  # queued after the step that samples them
            adjustments = fb.sampling_info.adjustments if fb.sampling_info is not None else None
            if adjustments is not None:
                adjustments.fed_tokens = fb.input_ids.long()  # counted by the penalties, not yet on the host
        return cls(ForwardMode.DECODE, list(reqs), fb)
