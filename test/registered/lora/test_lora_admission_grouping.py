"""`GroupedLoRAAdmission` (managers/schedule_policy.py): waiting requests ordered by adapter, adapters
rotated through the slots, the wait-turns bound kept. Checked with the real `plan_prefill`, turn by
turn, in a closed loop like `bench_serving --max-concurrency` (each finished request is replaced by
a new one for a random adapter):
  - with more adapters than slots it keeps the running batch fuller than the plain slot check
    (which lets adapters that keep getting requests hold their slots, so the batch shrinks to
    their requests), and with enough slots it changes nothing;
  - the order: active adapters and the base model first, then the adapter in most demand;
  - a retiring adapter takes no new request until it has drained;
  - the bound on waiting of test_lora_admission_fairness.py holds for it too.
"""

from __future__ import annotations

import random
import statistics
from typing import Optional

from test_lora_admission_fairness import LONGEST_A, MAX_WAIT, fits_with_pinned, needs_slot, turns_until_b_runs

from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.managers.req import Req
from sglang.srt.managers.schedule_policy import (
    GroupedLoRAAdmission,
    LoRAAdmission,
    PrefillBudget,
    plan_prefill,
)
from sglang.srt.sampling.sampling_params import SamplingParams


def make_req(arrival: int, lora: Optional[str], prompt: int = 8, max_new: int = 4) -> Req:
    msg = TokenizedGenerateReqInput(rid=f"{lora}-{arrival}", input_ids=[1] * prompt,
                                    sampling_params=SamplingParams(max_new_tokens=max_new), lora_id=lora)
    return Req(msg, arrival)


def closed_loop(admission: LoRAAdmission, slots: int, adapters: int = 8, clients: int = 32,
                total: int = 300, seed: int = 0) -> float:
    """Mean running batch over the decode steps of `total` requests (outputs of 16..64 tokens)."""
    rng = random.Random(seed)
    names = [f"L{i}" for i in range(adapters)]
    arrivals = iter(range(10**6))

    def new() -> Req:
        return make_req(next(arrivals), rng.choice(names), rng.randint(8, 32), rng.randint(16, 64))

    waiting = [new() for _ in range(clients)]
    running: list[Req] = []
    sizes, done, sent = [], 0, clients
    while done < total:
        holders = {r.lora_id for r in running}
        if isinstance(admission, GroupedLoRAAdmission):
            admission.begin(holders, waiting, running)
            order = admission.order(waiting)
        else:
            admission.begin(holders, waiting)
            order = waiting
        budget = PrefillBudget(kv_free=10**7, rows_free=10**4, max_new_reqs=10**4, max_prefill_tokens=10**6,
                               chunk_size=None, new_token_ratio=1.0)
        plan = plan_prefill(order, None, running, budget, admission)
        assert len({r.lora_id for r in running + plan.reqs} - {None}) <= slots  # the slot check held
        if plan.reqs:
            for r in plan.reqs:
                waiting.remove(r)
                r.kv_len += r.extend_len
                r.output_ids.append(7)
                running.append(r)
            continue
        assert running, "requests wait but nothing runs"
        sizes.append(len(running))
        for r in running:
            r.kv_len += 1
            r.output_ids.append(7)
        finished = [r for r in running if r.remaining_new_tokens == 0]
        running = [r for r in running if r.remaining_new_tokens > 0]
        for _ in finished:
            done += 1
            if sent < total:
                waiting.append(new())
                sent += 1
    return statistics.fmean(sizes)


def fits(slots: int):
    return lambda ids: len(set(ids) - {None}) <= slots


def test_rotation_keeps_the_batch_fuller_than_the_plain_slot_check() -> None:
    seeds = range(3)
    plain = statistics.fmean(closed_loop(LoRAAdmission(fits(4), 256), slots=4, seed=s) for s in seeds)
    grouped = statistics.fmean(closed_loop(GroupedLoRAAdmission(fits(4), 256), slots=4, seed=s) for s in seeds)
    print(f"mean running batch, 8 adapters / 4 slots / 32 clients: plain {plain:.1f}, grouped {grouped:.1f}")
    assert grouped > 1.04 * plain  # measured: 15.0 -> 16.2
    # Slots for every adapter: nothing to rotate, the batch is the same.
    assert closed_loop(GroupedLoRAAdmission(fits(8), 256), slots=8) == closed_loop(LoRAAdmission(fits(8), 256), slots=8)


def test_order_puts_active_adapters_and_base_first_then_demand() -> None:
    adm = GroupedLoRAAdmission(fits(2), 64)
    reqs = [make_req(0, "C"), make_req(1, "B"), make_req(2, None), make_req(3, "A"), make_req(4, "B"),
            make_req(5, "C"), make_req(6, "B")]
    reqs[0].lora_wait_turns = 5  # C: 2 requests, one of them waited 5 turns -> demand 8 > B's 3
    adm.begin({"A"}, reqs)
    assert [r.arrival for r in adm.order(reqs)] == [2, 3, 0, 5, 1, 4, 6]
    assert adm.wanted_adapters(reqs, {"A"}) == ["C", "B"]
    assert GroupedLoRAAdmission(None, 64).order(reqs) == reqs  # LoRA off: FCFS
    # A starving request's adapter goes before everything, the base model included: base traffic,
    # admitted while the slots drain for it, must not keep taking the rows it waits for.
    reqs[1].lora_wait_turns = MAX_WAIT
    starving = GroupedLoRAAdmission(fits(2), MAX_WAIT)
    starving.begin({"A"}, reqs)
    assert [r.arrival for r in starving.order(reqs)][:4] == [1, 4, 6, 2]
    # ... and its adapter is the one prefetched first, though C is in more demand.
    reqs[1].lora_wait_turns = reqs[4].lora_wait_turns = reqs[6].lora_wait_turns = 0
    reqs[0].lora_wait_turns = MAX_WAIT + 5
    reqs[1].lora_wait_turns = MAX_WAIT
    assert adm.wanted_adapters(reqs, {"A"})[0] == "C"
    starving.begin({"A"}, reqs[1:])  # only B starves now (C's requests are not waiting)
    assert starving.wanted_adapters(reqs, {"A"}) == ["B", "C"]


def test_a_retiring_adapter_drains_before_it_takes_requests_again() -> None:
    adm = GroupedLoRAAdmission(fits(2), 64)
    running = [make_req(0, "A", max_new=50), make_req(1, "B", max_new=5)]
    waiting = [make_req(2, "C"), make_req(3, "C"), make_req(4, "A")]
    adm.begin({"A", "B"}, waiting, running)
    # C (2 waiting) does not fit; B has no waiting request and little work left: B retires.
    assert adm.retiring == "B" and not adm.fits("B") and adm.fits("A") and not adm.fits("C")
    adm.begin({"A"}, waiting, [running[0]])  # B drained: C fits now and goes first
    assert adm.fits("C") and adm.retiring != "B" and adm.order(waiting)[1].lora_id == "C"
    adm.begin({"A", "C"}, [make_req(5, "B")], running)  # one request for B, none for A or C
    assert adm.retiring in ("A", "C") and not adm.fits(adm.retiring)
    retiring = adm.retiring
    adm.begin({"A", "C"}, [make_req(6, "A")], running)  # it drains completely all the same
    assert adm.retiring == retiring and not adm.fits(retiring)
    adm.begin({"A", "C"} - {retiring}, [make_req(6, "A")], running)  # drained: back to normal
    assert adm.fits("A") and adm.fits("C")


def test_the_wait_bound_holds_with_grouping() -> None:
    waited = turns_until_b_runs(GroupedLoRAAdmission(fits_with_pinned, MAX_WAIT))
    assert waited is not None and waited <= MAX_WAIT + LONGEST_A + 2, waited
    # With base traffic too, which now runs during the drain.
    waited = turns_until_b_runs(GroupedLoRAAdmission(fits_with_pinned, MAX_WAIT, needs_slot), base_every=3)
    assert waited is not None and waited <= MAX_WAIT + LONGEST_A + 2, waited
