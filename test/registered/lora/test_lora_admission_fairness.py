"""The LoRA slot admission's bound on waiting (managers/schedule_policy.py `LoRAAdmission`),
simulated turn by turn with the real `plan_prefill`.

Two slots, one held by a pinned adapter P, so a batch has room for one other pool user. Requests
for adapter A arrive steadily and overlap, so A is always running; a request for B does not fit
while A runs. The bound: B is admitted within `max_wait_turns` turns plus the time the running A
requests need to finish. The counterfactual (the earlier rule, which only kept *new* adapters out)
shows that the scenario really starves B, so the bound is not vacuous.
"""

from __future__ import annotations

from typing import Optional

from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.managers.req import Req
from sglang.srt.managers.schedule_policy import GroupedLoRAAdmission, LoRAAdmission, PrefillBudget, plan_prefill
from sglang.srt.sampling.sampling_params import SamplingParams

MAX_WAIT = 8
LONGEST_A = 16  # decode steps of the longest A request
B_ARRIVES = 20


def fits_with_pinned(ids: set) -> bool:
    return len((set(ids) - {None}) | {"P"}) <= 2  # the base model (None) has a slot of its own


def needs_slot(lora_id: Optional[str]) -> bool:
    return lora_id not in (None, "P")  # what LoRAManager.needs_slot says of the base and a pinned adapter


class EarlierRule(LoRAAdmission):
    """The rule before the drain: a starving request only keeps *new* adapters out."""

    def begin(self, active, waiting) -> None:
        super().begin(active, waiting)
        starving = [r for r in waiting if r.lora_wait_turns >= self.max_wait_turns]
        if starving:
            self.allowed = self.active | {min(starving, key=lambda r: r.arrival).lora_id}


def make_req(arrival: int, lora: str, max_new: int) -> Req:
    msg = TokenizedGenerateReqInput(rid=f"{lora}{arrival}", input_ids=[1, 2, 3, 4, 5],
                                    sampling_params=SamplingParams(max_new_tokens=max_new), lora_id=lora)
    return Req(msg, arrival)


def turns_until_b_runs(admission: LoRAAdmission, turns: int = 400, base_every: int = 0,
                       admitted: Optional[list] = None, rows: int = 1000) -> Optional[int]:
    """Each turn: arrivals, then a prefill batch if admission allows one, else a decode step of
    everything running (like Scheduler.get_next_batch). Returns B's wait in turns, or None.
    `base_every` > 0 adds a base-model request every that many turns; `admitted` collects
    (turn, lora) of every admission; `rows` is the running-request limit."""
    waiting: list[Req] = []
    running: list[Req] = []
    b = None
    for t in range(turns):
        if t % 4 == 0:  # a new A request every 4 turns, each decoding 10..16 tokens: always overlapping
            waiting.append(make_req(t, "A", 10 + t % 7))
        if base_every and t % base_every == 1:
            waiting.append(make_req(t, None, 12))
        if t == B_ARRIVES:
            b = make_req(t, "B", 3)
            waiting.append(b)
        admission.begin({r.lora_id for r in running}, waiting)
        free_rows = max(rows - len(running), 0)
        budget = PrefillBudget(kv_free=10**6, rows_free=free_rows, max_new_reqs=free_rows, max_prefill_tokens=10**6,
                               chunk_size=None, new_token_ratio=1.0)
        order = admission.order(waiting) if hasattr(admission, "order") else waiting
        plan = plan_prefill(order, None, running, budget, admission)
        if plan.reqs:
            for r in plan.reqs:
                if admitted is not None:
                    admitted.append((t, r.lora_id))
                waiting.remove(r)
                r.kv_len += r.extend_len
                r.output_ids.append(7)  # the token sampled at the end of prefill
                running.append(r)
            if b in plan.reqs:
                return t - B_ARRIVES
            # The slot check held for the whole batch: running + admitted adapters fit.
            assert fits_with_pinned({r.lora_id for r in running})
        else:
            for r in running:
                r.kv_len += 1
                r.output_ids.append(7)
            running = [r for r in running if r.remaining_new_tokens > 0]
    return None


def test_waiting_adapter_runs_within_the_bound() -> None:
    waited = turns_until_b_runs(LoRAAdmission(fits_with_pinned, MAX_WAIT))
    assert waited is not None and waited <= MAX_WAIT + LONGEST_A + 2, waited


def test_the_scenario_starves_without_the_drain() -> None:
    assert turns_until_b_runs(EarlierRule(fits_with_pinned, MAX_WAIT)) is None


def test_a_starving_adapter_that_fits_keeps_new_adapters_out() -> None:
    admission = LoRAAdmission(lambda ids: len(ids) <= 3, MAX_WAIT)
    b, c = make_req(1, "B", 3), make_req(2, "C", 3)
    b.lora_wait_turns = MAX_WAIT
    admission.begin({"A"}, [b, c])  # {A, B} fits: B goes in with A's requests, C waits
    assert admission.fits("A") and admission.fits("B") and not admission.fits("C")
    admission.begin({"A", None}, [b, c])  # {A, None, B} fits too
    assert admission.fits("B") and admission.fits(None)
    admission.begin({"A", "D", None}, [b, c])  # B does not fit: drain, only B (and the base) may enter
    assert not admission.fits("A") and admission.fits(None) and not admission.fits("B")


def test_the_drain_still_admits_what_takes_no_slot() -> None:
    """While B drains the slots, requests that cannot take the slot B waits for still run: the base
    model's and a pinned adapter's. They were held back too, so base traffic stalled behind a
    waiting adapter for as long as the longest running adapter request."""
    admission = LoRAAdmission(fits_with_pinned, MAX_WAIT, needs_slot)
    b = make_req(1, "B", 3)
    b.lora_wait_turns = MAX_WAIT
    admission.begin({"A", "P"}, [b])  # {A, P, B} does not fit: drain A
    assert admission.fits(None) and admission.fits("P")
    assert not admission.fits("A") and not admission.fits("B") and not admission.fits("C")
    # The default needs_slot exempts the base model only.
    plain = LoRAAdmission(fits_with_pinned, MAX_WAIT)
    plain.begin({"A", "P"}, [b])
    assert plain.fits(None) and not plain.fits("P")


def test_an_adapter_behind_full_rows_still_starts_the_drain() -> None:
    """Four rows, kept full by A's and the base model's requests (which go first, needing no new
    slot): the loop stops at the full rows before it reaches B, and B's turns were counted only
    where it was reached, so B never starved officially and waited for good. Every turn its adapter
    does not fit now counts."""
    for adm in (LoRAAdmission(fits_with_pinned, MAX_WAIT, needs_slot),
                GroupedLoRAAdmission(fits_with_pinned, MAX_WAIT, needs_slot)):
        waited = turns_until_b_runs(adm, base_every=3, rows=4, turns=3000)
        # The drain: B starves after MAX_WAIT turns, then A's requests (up to 16 tokens) and the
        # rows' base requests (12 tokens) finish, with prefill turns between their decode turns.
        assert waited is not None and waited <= MAX_WAIT + 2 * (LONGEST_A + 12), (type(adm).__name__, waited)


def test_base_traffic_runs_while_an_adapter_waits_and_the_adapter_still_gets_in() -> None:
    admitted: list = []
    waited = turns_until_b_runs(LoRAAdmission(fits_with_pinned, MAX_WAIT, needs_slot), base_every=3,
                                admitted=admitted)
    assert waited is not None and waited <= MAX_WAIT + LONGEST_A + 2, waited
    drain_start = B_ARRIVES + MAX_WAIT
    during = [lora for t, lora in admitted if drain_start < t < B_ARRIVES + waited]
    assert None in during and "A" not in during, during
