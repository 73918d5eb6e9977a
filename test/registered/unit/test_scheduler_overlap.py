"""The overlap schedule (`--enable-overlap-schedule`, managers/scheduler_overlap.py) against the
ordinary one, turn by turn on a tiny Qwen3 checkpoint (real ModelRunner, real pipes, CPU).

The same requests give the same tokens, finish reasons and logprobs, through every way a request
ends (length, EOS, a stop token, a stop string, an abort), arrivals while decoding (their
prefills queued behind the step in flight, the default, or run after it: SGLANG_OVERLAP_PREFILL=0),
retraction, the prefix cache (read through the KV table's host twin, as on a GPU) and seeded sampling; the KV
accounting holds after every turn, nothing is left held at the end, and the steps really were
launched ahead (the schedule's counter).
"""

from __future__ import annotations

import re
from typing import Any, Callable

import pytest

from server_helpers import tiny_checkpoint
from test_scheduler import Harness, prompt
from sglang.srt.managers.io_struct import AbortReq, FaultInjectionReq

TOL = 1e-5  # float32 on the CPU: the same numbers up to summation order


@pytest.fixture(scope="module")
def ckpt() -> str:
    return tiny_checkpoint("qwen3", seed=0)


@pytest.fixture(autouse=True)
def host_twin(monkeypatch):
    """Slots read from a separate host twin of the KV table, as on a GPU."""
    from sglang.srt.mem_cache import memory_pool

    monkeypatch.setattr(memory_pool, "SEPARATE_HOST_TWIN", True)


@pytest.fixture(autouse=True, params=["prefill-apart", "prefill-queued"])
def overlap_prefill(request, monkeypatch) -> bool:
    """Every case in both ways an admitted prefill meets a step in flight: run after it, or queued
    behind it (the default)."""
    queued = request.param == "prefill-queued"
    monkeypatch.setenv("SGLANG_OVERLAP_PREFILL", "1" if queued else "0")
    return queued


def run(h: Harness, events: dict[int, Callable[[Harness], None]] | None = None, max_turns: int = 3000) -> int:
    """Turns until idle, each followed by the integrity check; `events[t]` runs before turn t."""
    events = events or {}
    for turn in range(max_turns):
        if turn in events:
            events[turn](h)
        ran = h.step()
        report = h.sched.check_integrity()
        assert report["ok"], report["problems"]
        if not ran and not h.sched.waiting and turn >= max(events, default=0):
            return turn
    raise AssertionError("the scheduler did not finish in time")


def both(ckpt: str, submit: Callable[[Harness], None], events=None, **kwargs: Any) -> tuple[Harness, Harness]:
    runs = []
    for overlap in (False, True):
        h = Harness(ckpt, enable_overlap_schedule=overlap, **kwargs)
        submit(h)
        run(h, events)
        runs.append(h)
    return runs[0], runs[1]


def assert_same_outputs(a: Harness, b: Harness, aborted: tuple[str, ...] = ()) -> None:
    """`aborted`: requests aborted at a turn, which is a token earlier or later in one schedule than
    in the other (the overlap schedule records a step's tokens a turn later): their tokens agree
    as far as both got."""
    assert a.out.keys() == b.out.keys()
    # What the requests left in the prefix cache too: a request that stopped with a step ahead of
    # it gives that step's slot back first, so the tree holds the tokens the ordinary schedule cached.
    assert a.sched.live_info()["kv_cached_tokens"] == b.sched.live_info()["kv_cached_tokens"]
    for rid in a.out:
        x, y = a.out[rid], b.out[rid]
        if rid in aborted:
            n = min(len(x["ids"]), len(y["ids"]))
            assert n > 0 and x["ids"][:n] == y["ids"][:n], rid
            assert x["finish"]["type"] == y["finish"]["type"] == "abort", rid
            continue
        assert x["ids"] == y["ids"], rid
        assert x["finish"] == y["finish"], rid
        assert x["cached"] == y["cached"], rid
        for key in ("in_lp", "out_lp"):
            p, q = x[key] or [], y[key] or []
            assert [t for _, t in p] == [t for _, t in q], (rid, key)
            diffs = [abs(u - v) for (u, _), (v, _) in zip(p, q) if u is not None]
            assert max(diffs, default=0.0) <= TOL, (rid, key)


def assert_at_rest(h: Harness) -> None:
    s = h.sched
    assert s.inflight is None and not s.running and not s.waiting
    assert h.kv_free() == s.max_total_num_tokens
    assert s.req_to_token_pool.available_size() == s.total_rows


def test_every_way_of_stopping_gives_the_ordinary_outputs(ckpt):
    ref = Harness(ckpt)
    base_ids = prompt(14, 7)
    ref.submit("probe", base_ids, max_new_tokens=12, ignore_eos=True)
    run(ref)
    probe = ref.out["probe"]["ids"]
    eos = ref.sched.stop_checker.eos_ids

    def submit(h: Harness) -> None:
        for i in range(6):  # different lengths: requests leave the batch at different steps
            h.submit(f"len{i}", prompt(9 + 3 * i, 20 + i), max_new_tokens=4 + 5 * i, ignore_eos=True)
        h.submit("tok", base_ids, max_new_tokens=12, ignore_eos=True, stop_token_ids=[probe[4]])
        h.submit("eos", base_ids, max_new_tokens=12, ignore_eos=False)
        h.submit("lp", prompt(11, 3), max_new_tokens=9, return_logprob=True, logprob_start_len=2,
                 top_logprobs_num=3)
        h.submit("quiet", prompt(8, 4), max_new_tokens=7, stream=False)

    a, b = both(ckpt, submit)
    assert_same_outputs(a, b)
    assert b.out["tok"]["finish"] == {"type": "stop", "matched": probe[4]}
    assert b.out["len5"]["finish"]["type"] == "length" and len(b.out["len5"]["ids"]) == 29
    assert a.sched.stats["overlapped_decode_steps"] == 0
    assert b.sched.stats["overlapped_decode_steps"] >= 20
    assert b.sched.stats["overlap_discarded_tokens"] >= 1  # "tok" stopped with a step ahead of it
    assert_at_rest(a)
    assert_at_rest(b)
    assert eos  # the checkpoint has an EOS id; "eos" stops on it or runs to its length alike


def test_a_stop_string_gives_the_ordinary_outputs(ckpt):
    ref = Harness(ckpt)
    ids = prompt(14, 7)
    ref.submit("base", ids, max_new_tokens=12, ignore_eos=True)
    run(ref)
    tokenizer = ref.sched.stop_checker.tokenizer
    match = re.search(r"[A-Za-z]{3,}", tokenizer.decode(ref.out["base"]["ids"]))
    assert match
    stop = match.group(0)

    def submit(h: Harness) -> None:
        h.submit("str", ids, max_new_tokens=12, ignore_eos=True, stop=[stop])
        h.submit("other", prompt(10, 8), max_new_tokens=16, ignore_eos=True)

    a, b = both(ckpt, submit)
    assert_same_outputs(a, b)
    assert b.out["str"]["finish"] == {"type": "stop", "matched": stop}
    assert b.sched.stats["overlap_discarded_tokens"] == 1
    assert_at_rest(b)


def test_arrivals_and_an_abort_while_decoding(ckpt, overlap_prefill):
    def submit(h: Harness) -> None:
        h.submit("a", prompt(12, 1), max_new_tokens=25, ignore_eos=True)
        h.submit("gone", prompt(20, 3), max_new_tokens=30, ignore_eos=True)

    events = {
        4: lambda h: h.submit("b", prompt(9, 2), max_new_tokens=12, ignore_eos=True),
        7: lambda h: h.to_w.send(AbortReq(rid="gone")),
        9: lambda h: h.submit("c", prompt(30, 5), max_new_tokens=6, ignore_eos=True),
    }
    a, b = both(ckpt, submit, events)
    assert_same_outputs(a, b, aborted=("gone",))
    assert b.sched.stats["overlapped_decode_steps"] > 0
    # "b" and "c" arrive while a step is in flight: their prefills are queued behind it (the
    # default) or run once it is finished (SGLANG_OVERLAP_PREFILL=0).
    assert b.sched.stats["overlapped_prefills"] == (2 if overlap_prefill else 0)
    assert a.sched.stats["overlapped_prefills"] == 0
    assert b.sched.stats["prefill_batches"] == a.sched.stats["prefill_batches"]
    assert_at_rest(b)


def test_a_chunked_prefill_with_prompt_logprobs_arrives_while_decoding(ckpt, overlap_prefill):
    """A prompt longer than the chunk, asking for prompt and top logprobs, arrives while a step is
    in flight: its first chunk is queued behind that step, the rest follow as in the ordinary
    schedule, and every logprob matches."""
    def submit(h: Harness) -> None:
        h.submit("a", prompt(12, 1), max_new_tokens=20, ignore_eos=True)
        h.submit("b", prompt(7, 2), max_new_tokens=14, ignore_eos=True, return_logprob=True)

    events = {
        3: lambda h: h.submit("long", prompt(40, 6), max_new_tokens=6, ignore_eos=True, return_logprob=True,
                              logprob_start_len=0, top_logprobs_num=2),
        5: lambda h: h.submit("short", prompt(6, 7), max_new_tokens=4, ignore_eos=True, return_logprob=True,
                              logprob_start_len=1),
    }
    a, b = both(ckpt, submit, events, chunked_prefill_size=16)
    assert_same_outputs(a, b)
    assert len(b.out["long"]["in_lp"]) == 40 and len(b.out["short"]["in_lp"]) == 5
    assert (b.sched.stats["overlapped_prefills"] >= 1) == overlap_prefill
    assert b.sched.stats["prefill_batches"] == a.sched.stats["prefill_batches"]
    assert_at_rest(b)


def test_retraction_and_the_prefix_cache(ckpt):
    system = prompt(30, 9)

    def submit(h: Harness) -> None:
        for i in range(6):
            h.submit(f"r{i}", system + prompt(4 + i, 30 + i), max_new_tokens=14, ignore_eos=True)

    a, b = both(ckpt, submit, max_total_tokens=120)  # too few for all six at once: retraction
    assert a.sched.stats["num_retractions"] > 0 and b.sched.stats["num_retractions"] > 0
    assert_same_outputs(a, b)
    assert any(b.out[f"r{i}"]["cached"] for i in range(6))
    assert b.sched.stats["overlapped_decode_steps"] > 0
    assert b.kv_free() == b.sched.max_total_num_tokens


def test_a_full_batch_with_a_queue_keeps_overlapping(ckpt):
    """--max-running-requests 2 and five requests: while two run, the others wait and could not be
    admitted, so the steps chain (the ordinary turn would decode the same two); a request leaving
    by length lets the next one in at the same step as the ordinary schedule."""
    def submit(h: Harness) -> None:
        for i in range(5):
            h.submit(f"m{i}", prompt(8, 10 + i), max_new_tokens=5 + 2 * i, ignore_eos=True)

    a, b = both(ckpt, submit, max_running_requests=2)
    assert_same_outputs(a, b)
    assert b.max_running_seen == 2
    # 24 decode steps; 20 launched ahead (11 if a waiting request stopped the chain: the rule this
    # case checks is that a full batch does not).
    assert b.sched.stats["overlapped_decode_steps"] >= 16
    assert b.sched.stats["prefill_batches"] == a.sched.stats["prefill_batches"]


def test_seeded_sampling_draws_the_same_tokens(ckpt):
    def submit(h: Harness) -> None:
        for i in range(3):
            h.submit(f"s{i}", prompt(10 + i, 40 + i), max_new_tokens=10, ignore_eos=True, temperature=0.8,
                     top_p=0.9, seed=100 + i)

    a, b = both(ckpt, submit)
    assert_same_outputs(a, b)
    assert b.sched.stats["overlapped_decode_steps"] > 0


def test_a_failed_step_fails_only_its_requests(ckpt):
    def submit(h: Harness) -> None:
        h.submit("steady", prompt(12, 4), max_new_tokens=10, ignore_eos=True)

    events = {
        2: lambda h: h.to_w.send(FaultInjectionReq(rid_substring="boom", where="decode", after_tokens=2)),
        3: lambda h: h.submit("boom-1", prompt(9, 5), max_new_tokens=10, ignore_eos=True),
    }
    h = Harness(ckpt, enable_overlap_schedule=True, enable_test_hooks=True)
    submit(h)
    run(h, events)
    fin = h.out["boom-1"]["finish"]
    assert fin["type"] == "abort" and fin["status_code"] == 500 and "injected fault" in fin["message"]
    assert h.sched.stats["num_forward_failures"] == 1
    assert h.out["steady"]["finish"]["type"] in ("length", "abort")
    assert_at_rest(h)


def test_forward_seconds_count_every_forward_by_phase(ckpt, monkeypatch):
    """SGLANG_FORWARD_TIMES=1 (model_executor/forward_clock.py): each finished forward, ordinary or
    launched ahead, is counted once under its phase; off, /get_server_info says None."""
    def submit(h: Harness) -> None:
        for i in range(4):
            h.submit(f"r{i}", prompt(9 + 4 * i, 30 + i), max_new_tokens=6 + 3 * i, ignore_eos=True)

    assert Harness(ckpt).sched.live_info()["forward_seconds"] is None
    monkeypatch.setenv("SGLANG_FORWARD_TIMES", "1")  # read when the ModelRunner is built
    for h in both(ckpt, submit):
        timed, stats = h.sched.live_info()["forward_seconds"], h.sched.stats
        assert timed["prefill_forwards"] == stats["prefill_batches"] > 0
        assert timed["decode_forwards"] == stats["decode_steps"] > 0
        assert timed["prefill_s"] > 0 and timed["decode_s"] > 0
