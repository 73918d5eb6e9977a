"""Admission (managers/schedule_policy.py): FCFS, chunking, KV reservation, request limits, and the
LoRA slot check with its bounded wait."""

from __future__ import annotations

from typing import Optional

from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.managers.req import Req
from sglang.srt.managers.schedule_policy import LoRAAdmission, PrefillBudget, plan_prefill, reserved_tokens
from sglang.srt.sampling.sampling_params import SamplingParams

_arrival = iter(range(10**6))


def req(n: int, max_new: int = 10, lora: Optional[str] = None, rid: str = "") -> Req:
    msg = TokenizedGenerateReqInput(rid=rid or f"r{n}-{lora}", input_ids=list(range(1, n + 1)),
                                    sampling_params=SamplingParams(max_new_tokens=max_new), lora_id=lora)
    return Req(msg, next(_arrival))


def budget(kv: int = 1000, rows: int = 100, max_new_reqs: int = 100, max_prefill: int = 10000,
           chunk: Optional[int] = None, ratio: float = 1.0) -> PrefillBudget:
    return PrefillBudget(kv_free=kv, rows_free=rows, max_new_reqs=max_new_reqs, max_prefill_tokens=max_prefill,
                         chunk_size=chunk, new_token_ratio=ratio)


NO_LORA = LoRAAdmission(None, 8)


def running(n: int, kv: int, max_new: int, done: int) -> Req:
    r = req(n, max_new)
    r.kv_len = kv
    r.output_ids = [7] * done
    return r


def test_fcfs_admits_in_order_until_a_limit() -> None:
    waiting = [req(10), req(20), req(30)]
    plan = plan_prefill(waiting, None, [], budget(), NO_LORA)
    assert plan.reqs == waiting and [r.extend_len for r in plan.reqs] == [10, 20, 30]
    plan = plan_prefill(waiting, None, [], budget(max_new_reqs=2), NO_LORA)
    assert plan.reqs == waiting[:2]
    plan = plan_prefill(waiting, None, [], budget(max_prefill=35), NO_LORA)
    assert plan.reqs == waiting[:2]  # 10 + 20 fit, 30 more would not


def test_first_request_may_exceed_the_prefill_budget_alone() -> None:
    plan = plan_prefill([req(50)], None, [], budget(max_prefill=16), NO_LORA)
    assert [r.extend_len for r in plan.reqs] == [50]


def test_kv_reservation_for_running_requests() -> None:
    run = [running(10, kv=15, max_new=50, done=5)]  # 45 tokens still to decode
    assert reserved_tokens(run[0], 1.0) == 45
    w = [req(30, max_new=10), req(5, max_new=1)]
    # free 80: 30 + its 10 + 45 reserved = 85 > 80, so nothing is admitted (and the small one
    # behind it must not overtake it).
    assert plan_prefill(w, None, run, budget(kv=80), NO_LORA).reqs == []
    assert plan_prefill(w, None, run, budget(kv=80, ratio=0.5), NO_LORA).reqs == w


def test_a_lone_request_is_admitted_whenever_its_prompt_fits() -> None:
    plan = plan_prefill([req(60, max_new=500)], None, [], budget(kv=64), NO_LORA)
    assert len(plan.reqs) == 1


def test_chunking_splits_long_prompts_and_continues_them_first() -> None:
    long, short = req(40), req(5)
    plan = plan_prefill([long, short], None, [], budget(chunk=16), NO_LORA)
    assert plan.reqs == [long] and long.extend_len == 16 and plan.chunked is long
    long.kv_len = 16  # the scheduler ran the first chunk
    plan = plan_prefill([short], long, [], budget(chunk=16), NO_LORA)
    assert plan.reqs == [long] and long.extend_len == 16 and plan.chunked is long
    long.kv_len = 32
    plan = plan_prefill([short], long, [], budget(chunk=16), NO_LORA)
    # The last 8 tokens finish the prompt; the short request fills the rest of the chunk budget.
    assert plan.reqs == [long, short] and long.extend_len == 8 and plan.chunked is None


def test_chunk_budget_applies_across_requests() -> None:
    a, b = req(10), req(10)
    plan = plan_prefill([a, b], None, [], budget(chunk=16), NO_LORA)
    assert plan.reqs == [a, b] and b.extend_len == 6 and plan.chunked is b


def fits_two(ids: set) -> bool:
    return len(ids) <= 2


def test_lora_slots_skip_requests_that_do_not_fit() -> None:
    lora = LoRAAdmission(fits_two, max_wait_turns=3)
    a, b, base = req(5, lora="A"), req(5, lora="B"), req(5)
    lora.begin([None], [a, b, base])
    plan = plan_prefill([a, b, base], None, [], budget(), lora)
    assert plan.reqs == [a, base] and plan.lora_blocked == [b]
    assert b.lora_wait_turns == 1


def test_lora_bounded_wait_stops_new_adapters() -> None:
    lora = LoRAAdmission(fits_two, max_wait_turns=3)
    b, c = req(5, lora="B"), req(5, lora="C")
    b.lora_wait_turns = 3  # B has been turned away long enough
    # Only the base model runs: C would fit the slots, but it is a new adapter and B starves.
    lora.begin([None], [b, c])
    plan = plan_prefill([c, b], None, [], budget(), lora)
    assert plan.reqs == [b] and c in plan.lora_blocked
    # Without a starving request C is admitted.
    lora2 = LoRAAdmission(fits_two, max_wait_turns=3)
    c2 = req(5, lora="C")
    lora2.begin([None], [c2])
    assert plan_prefill([c2], None, [], budget(), lora2).reqs == [c2]


def test_no_lora_manager_admits_any_adapter() -> None:
    waiting = [req(5, lora=x) for x in ("A", "B", "C")]
    NO_LORA.begin([None], waiting)
    assert plan_prefill(waiting, None, [], budget(), NO_LORA).reqs == waiting


def test_longest_prefix_first_ranks_by_cached_tokens_and_keeps_fcfs_among_equals() -> None:
    from sglang.srt.managers.schedule_policy import LPM_MAX_WAITING, GroupedLoRAAdmission, longest_prefix_first

    waiting = [req(10, rid="a"), req(10, rid="b"), req(10, rid="c"), req(10, rid="d")]
    cached = {"a": 0, "b": 7, "c": 0, "d": 7}
    ranked = longest_prefix_first(waiting, lambda r: cached[r.rid])
    assert [r.rid for r in ranked] == ["b", "d", "a", "c"]
    # LoRA grouping keeps that order inside a group (it used to re-sort by arrival).
    lora = GroupedLoRAAdmission(lambda ids: True, max_wait_turns=8)
    lora.begin([None], ranked)
    assert [r.rid for r in lora.order(ranked)] == ["b", "d", "a", "c"]
    # A long queue keeps FCFS: ranking would walk every prompt through the tree each turn.
    many = [req(5, rid=f"q{i}") for i in range(LPM_MAX_WAITING + 1)]
    assert longest_prefix_first(many, lambda r: int(r.rid[1:])) == many
