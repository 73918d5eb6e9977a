"""The scheduler's side of the sampling tensors: per step, what a batch's requests ask of the
Sampler (temperature and the filters, sampling/sampling_batch_info.py) and of the logits
(penalties, logit_bias, min_new_tokens' bans: sampling/logit_adjustments.py), as device tensors.

A decode batch keeps the same requests for many steps, and almost all of those tensors follow from
which requests it holds: their sampling parameters, their penalty values, their batch rows, their
rows of the token-count table, their biases. A `BatchPlan` holds them, built once per composition
(the requests, in order) and reused while the same requests come back in the same order (nothing
writes those tensors: steps share them). Each step then only
  * brings the count table up to the tokens appended since the last step (token_counts.py), and
    rebuilds the table-row index if a row moved (it does not while the requests run);
  * checks which requests are still under min_new_tokens (with `pending`, the overlap schedule's
    token in flight), rebuilding the bias entries only when that set changes (at most once per
    request).
A plan holds its requests, so no other request can take one of their ids while it is cached; a
few plans are kept (a prefill batch between two decode steps does not evict the decode's).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import torch

from sglang.srt.managers.req import Req
from sglang.srt.sampling.host_copy import to_device
from sglang.srt.sampling.logit_adjustments import REPETITION_FLOOR, BiasEntries, LogitAdjustments, PenaltyRows
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.token_counts import TokenCounts

# (token ids int64, values float32) on the device: one request's logit_bias or held-back tokens.
BiasTensors = tuple[torch.Tensor, torch.Tensor]


@dataclass
class BatchPlan:
    """What a batch's composition fixes about its adjustments (see the module docstring)."""

    reqs: list[Req]
    adjusting: bool = False  # some request adjusts its logits
    all_greedy: bool = False
    # The sampling parameters' tensors (built at the first step that needs them); a step's info
    # is this with its own steps, adjustments and grammar mask.
    base: Optional[SamplingBatchInfo] = None
    penalised: list[Req] = field(default_factory=list)
    penalty_rows: Optional[torch.Tensor] = None  # int64 [P]: their batch rows
    penalty_params: Optional[torch.Tensor] = None  # float32 [3, P]: PenaltyRows.params
    with_prompt: bool = False
    whole_batch: bool = False  # every request is penalised
    table_rows: list[int] = field(default_factory=list)  # the count rows `table_index` holds
    table_index: Optional[torch.Tensor] = None  # int64 [P]
    # Batch row -> its logit_bias tensors, and the rows whose min_new_tokens bans something.
    biased: dict[int, BiasTensors] = field(default_factory=dict)
    held_back: list[tuple[int, Req]] = field(default_factory=list)
    # The bias entries for the held-back rows still under min_new_tokens, `bias_key` telling which.
    bias_key: Optional[tuple[bool, ...]] = None
    bias: Optional[BiasEntries] = None


class LogitContext:
    """What a batch's logit adjustments need besides its requests: the tokens `min_new_tokens`
    holds back, the penalties' token-count table (allocated at the first penalised request), and
    the plans of the latest batch compositions."""

    MAX_PLANS = 4

    def __init__(self, eos_ids: set[int], vocab_size: int, device: torch.device | str) -> None:
        self.eos_ids = {t for t in eos_ids if 0 <= t < vocab_size}
        self.vocab_size = vocab_size
        self.device = device
        self._counts: Optional[TokenCounts] = None
        self._plans: OrderedDict[tuple[int, ...], BatchPlan] = OrderedDict()

    @property
    def counts(self) -> TokenCounts:
        if self._counts is None:
            self._counts = TokenCounts(self.vocab_size, self.device)
        return self._counts

    @property
    def token_counts_if_any(self) -> Optional[TokenCounts]:
        return self._counts

    def release(self, req: Req) -> None:
        """The request has ended: its token-count row goes back, and the plans that hold it (no
        batch will hold it again)."""
        if self._counts is not None:
            self._counts.release(req)
        for key in [k for k, plan in self._plans.items() if any(r is req for r in plan.reqs)]:
            del self._plans[key]

    def plan_for(self, reqs: list[Req]) -> BatchPlan:
        """The cached plan of this composition, or a new one (evicting the least recently used)."""
        # Identities are a sound key: every cached plan keeps its requests alive.
        key = tuple(map(id, reqs))
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            return plan
        plan = self._new_plan(reqs)
        self._plans[key] = plan
        if len(self._plans) > self.MAX_PLANS:
            self._plans.popitem(last=False)
        return plan

    def _new_plan(self, reqs: list[Req]) -> BatchPlan:
        plan = BatchPlan(reqs=list(reqs))
        plan.adjusting = any(r.sampling_params.adjusts_logits for r in reqs)
        plan.all_greedy = all(r.sampling_params.is_greedy for r in reqs)
        if not plan.adjusting:
            return plan
        rows = [i for i, r in enumerate(reqs) if r.sampling_params.needs_token_counts]
        if rows:
            params = [reqs[i].sampling_params for i in rows]
            plan.penalised = [reqs[i] for i in rows]
            plan.penalty_rows = to_device(rows, torch.int64, self.device)
            plan.penalty_params = to_device(
                [[float(p.frequency_penalty) for p in params], [float(p.presence_penalty) for p in params],
                 [max(float(p.repetition_penalty), REPETITION_FLOOR) for p in params]],
                torch.float32, self.device)
            plan.with_prompt = any(p.repetition_penalty != 1 for p in params)
            plan.whole_batch = len(rows) == len(reqs)
        for i, r in enumerate(reqs):
            p = r.sampling_params
            if p.logit_bias:
                if r.logit_bias_tensors is None:
                    r.logit_bias_tensors = _bias_tensors(sorted(p.logit_bias.items()), self.device)
                plan.biased[i] = r.logit_bias_tensors
            if p.min_new_tokens > 0:
                if r.held_back_tensors is None:
                    held_back = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)
                    r.held_back_tensors = _bias_tensors([(t, -math.inf) for t in sorted(held_back)], self.device)
                if len(r.held_back_tensors[0]):
                    plan.held_back.append((i, r))
        return plan

    def bias_entries(self, plan: BatchPlan, active: tuple[bool, ...]) -> Optional[BiasEntries]:
        """The plan's biases plus the bans of its held-back rows flagged in `active`."""
        if plan.bias_key == active:
            return plan.bias
        held = {i: r.held_back_tensors for (i, r), on in zip(plan.held_back, active) if on}
        parts: list[tuple[int, BiasTensors]] = []
        for i in sorted(plan.biased.keys() | held.keys()):
            if i in plan.biased:
                parts.append((i, plan.biased[i]))
            if i in held:
                parts.append((i, held[i]))
        bias = None
        if parts:
            lengths = torch.tensor([len(t[0]) for _, t in parts], dtype=torch.int64)
            rows = torch.repeat_interleave(torch.tensor([i for i, _ in parts], dtype=torch.int64), lengths)
            index = to_device(rows, torch.int64, self.device) * self.vocab_size + torch.cat([t[0] for _, t in parts])
            bias = BiasEntries(index=index, values=torch.cat([t[1] for _, t in parts]), vocab_size=self.vocab_size)
        plan.bias_key, plan.bias = active, bias
        return bias


def logit_adjustments_for(reqs: list[Req], ctx: LogitContext, pending: int,
                          plan: Optional[BatchPlan] = None) -> Optional[LogitAdjustments]:
    """Penalties, logit biases and min_new_tokens' bans for the batch's rows; None if none applies.
    `plan`: ctx.plan_for(reqs), when the caller has it."""
    plan = plan if plan is not None else ctx.plan_for(reqs)
    penalties = None
    if plan.penalised:
        table = ctx.counts
        rows = table.rows_for(plan.penalised)
        if rows != plan.table_rows:
            plan.table_rows, plan.table_index = rows, to_device(rows, torch.int64, ctx.device)
        penalties = PenaltyRows(rows=plan.penalty_rows, table_rows=plan.table_index, table=table,
                                version=table.version, params=plan.penalty_params, with_prompt=plan.with_prompt,
                                whole_batch=plan.whole_batch)
    active = tuple(len(r.output_ids) + pending < r.sampling_params.min_new_tokens for _, r in plan.held_back)
    bias = ctx.bias_entries(plan, active)
    if penalties is None and bias is None:
        return None
    return LogitAdjustments(penalties=penalties, bias=bias)


def _bias_tensors(pairs: list[tuple[int, float]], device: torch.device | str) -> BiasTensors:
    """(token ids int64, values float32) on the device."""
    return (to_device([t for t, _ in pairs], torch.int64, device),
            to_device([v for _, v in pairs], torch.float32, device))
