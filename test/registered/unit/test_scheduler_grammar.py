"""Constrained requests in the scheduler, in-process, turn by turn (real ModelRunner, real pipes,
xgrammar): retraction under KV pressure resumes every matcher where it stopped, an abort while the
grammar compiles or mid-generation leaves nothing behind, a batch with a constrained request does
not overlap its steps, a spec that fails to compile in the scheduler fails only its request, and a
repeated spec is a cache hit."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import pytest

pytest.importorskip("xgrammar")

from server_helpers import tiny_checkpoint  # noqa: E402
from sglang.srt.managers.io_struct import AbortReq  # noqa: E402
from sglang.srt.managers.scheduler_admission import MIN_NEW_TOKEN_RATIO  # noqa: E402
from test_scheduler import Harness, prompt  # noqa: E402


@pytest.fixture(scope="module")
def ckpt() -> str:
    return tiny_checkpoint("qwen3", seed=0)


# How long a test waits for a grammar compile in the scheduler's thread (~0.3 s for the slowest
# here): a generous deadline, not a count of idle turns, which a loaded machine could use up.
COMPILE_DEADLINE_S = 120.0


class GrammarHarness(Harness):
    def run(self, max_steps: int = 5000) -> None:
        """Turns until nothing runs, waits or compiles: at most `max_steps` turns that ran a batch,
        and idle turns (a compile is running in its thread) until COMPILE_DEADLINE_S."""
        s = self.sched
        deadline = time.monotonic() + COMPILE_DEADLINE_S
        ran_steps = 0
        while ran_steps < max_steps and time.monotonic() < deadline:
            ran = self.step()
            if not ran and not (s.waiting or s.grammar_queue or s.inflight or s.running):
                return
            if ran:
                ran_steps += 1
            else:
                time.sleep(0.001)  # a compile is running in its thread
        raise AssertionError("the scheduler did not finish in time")

    def text(self, rid: str) -> str:
        ids = self.out[rid]["ids"]
        eos = self.sched.stop_checker.eos_ids
        return self.sched.stop_checker.tokenizer.decode([t for t in ids if t not in eos])


def assert_clean(h: Harness) -> None:
    report = h.sched.check_integrity()
    assert report["ok"], report["problems"]
    assert report["grammar_matchers"] == 0 and report["grammar_queue"] == 0 and not h.sched._grammar_compiles


# Some end within the budget (the grammar complete, then EOS), some run into it mid-grammar.
REGEXES = [r"[a-z ]{80}", r"(ab|cd){40}", r"[0-9]{6}", r"([a-z]+ ){20}", r"(yes|no)( [a-z]{3}){3}", r"[a-z]{50}"]


def test_retraction_resumes_every_matcher_where_it_stopped(ckpt: str) -> None:
    prompts = {f"g{i}": prompt(10 + i, i) for i in range(len(REGEXES))}
    alone = {}
    ref = GrammarHarness(ckpt)
    for (rid, ids), regex in zip(prompts.items(), REGEXES):
        ref.submit(rid, ids, max_new_tokens=24, regex=regex)
        ref.run()
        alone[rid] = ref.out[rid]["ids"]
    h = GrammarHarness(ckpt, max_total_tokens=80)  # far less than the ~200 tokens all six want at once
    # Admission reserves this share of a running request's budget, as after a long run of decode
    # steps: it lets all six in, and their growth makes it retract.
    h.sched.new_token_ratio = MIN_NEW_TOKEN_RATIO
    for (rid, ids), regex in zip(prompts.items(), REGEXES):
        h.submit(rid, ids, max_new_tokens=24, regex=regex)
    h.run()
    assert h.sched.stats["num_retractions"] > 0
    stopped = 0
    for rid, regex in zip(prompts, REGEXES):
        assert h.out[rid]["ids"] == alone[rid], rid
        if h.finish_of(rid)["type"] == "stop":  # the grammar ended it: the text is a full match
            stopped += 1
            assert re.fullmatch(regex, h.text(rid)), (regex, h.text(rid))
    assert stopped == 3
    assert_clean(h)


def slow_schema(n: int = 600) -> dict[str, Any]:
    """A schema whose compile takes ~0.3 s here (a request waits for it in grammar_queue); its JSON
    (~40 KB) fits the pipe's buffer, which nobody reads while the test sends it."""
    return {"type": "object", "properties": {
        f"k{i}": {"type": "string", "pattern": f"([a-z]{{1,{i % 9 + 2}}}[0-9]{{2,{i % 5 + 3}}}){{2,4}}"}
        for i in range(n)}}


def test_abort_while_compiling_and_mid_generation_leaves_nothing(ckpt: str) -> None:
    h = GrammarHarness(ckpt)
    h.submit("slow", prompt(9, 1), max_new_tokens=8, json_schema=json.dumps(slow_schema()))
    h.submit("long", prompt(11, 2), max_new_tokens=200, regex="[a-z]{200}")
    h.sched.process_messages(block=False)
    assert [r.rid for r in h.sched.grammar_queue] == ["slow", "long"]
    compile_of_slow = h.sched._grammar_compiles[h.sched.grammar_queue[0].sampling_params.grammar]
    h.to_w.send(AbortReq(rid="slow"))
    assert not compile_of_slow.done()  # the abort reaches it in the queue
    # "long" decodes a few tokens (once its grammar compiled, after the slow one that nobody waits
    # for: one compile thread), then is aborted mid-grammar.
    deadline = time.monotonic() + COMPILE_DEADLINE_S
    while len(h.out["long"]["ids"]) < 5:
        assert time.monotonic() < deadline, "the long request never decoded"
        if not h.step():
            time.sleep(0.001)
    assert h.finish_of("slow")["type"] == "abort" and not h.out["slow"]["ids"]
    assert h.sched.grammar_matchers == 1
    h.to_w.send(AbortReq(rid="long"))
    h.run()
    assert h.finish_of("long")["type"] == "abort"
    assert_clean(h)
    # The compile nobody waits for any more ends unread; a later request with the spec compiles it again.
    h.submit("again", prompt(9, 1), max_new_tokens=4, json_schema=json.dumps(slow_schema()))
    h.run()
    assert h.finish_of("again")["type"] in ("length", "stop") and h.out["again"]["ids"]
    assert_clean(h)


def test_constrained_batches_do_not_overlap_their_steps(ckpt: str) -> None:
    ordinary, overlap = GrammarHarness(ckpt), GrammarHarness(ckpt, enable_overlap_schedule=True)
    for h in (ordinary, overlap):
        # The grammar compiled and cached first: "c" then joins the queue with "u" at once, however
        # long a compile takes on a loaded machine (else "u" could decode alone, and overlap, first).
        h.submit("warm", prompt(12, 5), max_new_tokens=2, regex="[a-z]{30}")
        h.run()
        h.submit("c", prompt(12, 3), max_new_tokens=30, regex="[a-z]{30}")
        h.submit("u", prompt(10, 4), max_new_tokens=10, ignore_eos=True)
        h.run()
    assert overlap.out == ordinary.out
    assert overlap.sched.stats["overlapped_decode_steps"] == 0  # "u" always shared its steps with "c"
    overlap.submit("u2", prompt(10, 4), max_new_tokens=10, ignore_eos=True)
    overlap.run()
    assert overlap.sched.stats["overlapped_decode_steps"] > 0  # alone, unconstrained steps chain
    assert overlap.out["u2"]["ids"] == ordinary.out["u"]["ids"]
    assert_clean(overlap)


def test_a_spec_refused_in_the_scheduler_fails_only_its_request(ckpt: str) -> None:
    """The tokenizer manager refuses bad specs first; reaching the scheduler anyway, one ends its
    request with a 400, and the scheduler goes on."""
    h = GrammarHarness(ckpt)
    h.submit("bad", prompt(9, 1), max_new_tokens=4, regex="[a-")
    h.submit("good", prompt(9, 2), max_new_tokens=4, regex="[a-z]+")
    h.run()
    finish = h.finish_of("bad")
    assert finish["type"] == "abort" and finish["status_code"] == 400 and "Invalid regex" in finish["message"]
    assert h.finish_of("good")["type"] in ("length", "stop") and h.out["good"]["ids"]
    assert_clean(h)


def test_a_repeated_spec_skips_the_compile_queue(ckpt: str) -> None:
    h = GrammarHarness(ckpt)
    h.submit("first", prompt(9, 1), max_new_tokens=4, regex="[0-9]{4}")
    h.run()
    h.submit("second", prompt(9, 2), max_new_tokens=4, regex="[0-9]{4}")
    h.sched.process_messages(block=False)
    assert not h.sched.grammar_queue and [r.rid for r in h.sched.waiting] == ["second"]
    h.run()
    assert h.sched.grammar_cache.info()["hits"] >= 1
    assert h.text("second").isdigit() and len(h.text("second")) == 4
    assert_clean(h)
