"""The main process's per-request state (managers/req_state.py): applying scheduler news,
stop trimming, and delivering every update, the last one included, to a stream."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from server_helpers import tiny_checkpoint
from sglang.srt.managers import req_state as rs
from sglang.srt.managers.detokenizer import IncrementalDetokenizer
from sglang.srt.managers.generate_request import SingleGenerateReq
from sglang.srt.managers.io_struct import BatchTokenIDOut
from sglang.srt.sampling.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tiny_checkpoint("qwen3", seed=0))


def make_state(tokenizer, event: asyncio.Event, rid: str = "a", **params) -> rs.ReqState:
    sp = SamplingParams.from_dict(params)
    req = SingleGenerateReq(rid=rid, text="x", input_ids=None, sampling_params=params, stream=True)
    return rs.ReqState(req=req, input_ids=[1, 2], params=sp, lora_id=None,
                       detok=IncrementalDetokenizer(tokenizer), event=event)


def news(rid: str, ids: list[int], done: int, finish=None) -> BatchTokenIDOut:
    return BatchTokenIDOut(rids=[rid], finished_reasons=[finish], output_ids=[ids], prompt_tokens=[2],
                           completion_tokens=[done], cached_tokens=[0])


def test_final_update_is_delivered_even_if_it_arrives_during_a_yield(tokenizer) -> None:
    ids = tokenizer.encode("one two three four", add_special_tokens=False)

    async def scenario() -> list[dict]:
        event = asyncio.Event()
        state = make_state(tokenizer, event)
        state.apply(news("a", ids[:1], 1), 0)
        chunks = []
        async for out in rs.iterate_states([state], False, True, None, tokenizer.decode):
            chunks.append(out)
            if len(chunks) == 1:
                # Everything else, finish included, lands while the consumer holds the first chunk.
                state.apply(news("a", ids[1:], len(ids), {"type": "length", "length": len(ids)}), 0)
        return chunks

    chunks = asyncio.run(scenario())
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": len(ids)}
    assert chunks[-1]["text"] == "one two three four"


def test_stop_token_and_stop_string_are_trimmed(tokenizer) -> None:
    event = asyncio.Event()
    ids = tokenizer.encode("alpha beta gamma", add_special_tokens=False)
    st = make_state(tokenizer, event, stop_token_ids=[ids[-1]])
    st.apply(news("a", ids, len(ids), {"type": "stop", "matched": ids[-1]}), 0)
    assert st.text() == tokenizer.decode(ids[:-1])
    st2 = make_state(tokenizer, event, stop=[" gam"])
    st2.apply(news("a", ids[:2], 2), 0)
    st2.apply(news("a", ids[2:], len(ids), {"type": "stop", "matched": " gam"}), 0)
    assert st2.text() == "alpha beta"
    st3 = make_state(tokenizer, event, stop=[" gam"], no_stop_trim=True)
    st3.apply(news("a", ids, len(ids), {"type": "stop", "matched": " gam"}), 0)
    assert st3.text() == "alpha beta gamma"
    # vLLM's include_stop_str_in_output keeps the stop string and ends there: not the rest of the
    # token that completed it (" gamma"), as SGLang's no_stop_trim does.
    st4 = make_state(tokenizer, event, stop=[" gam"], include_stop_str_in_output=True)
    st4.apply(news("a", ids, len(ids), {"type": "stop", "matched": " gam"}), 0)
    assert st4.text() == "alpha beta gam"
    st5 = make_state(tokenizer, event, stop_token_ids=[ids[-1]], include_stop_str_in_output=True)
    st5.apply(news("a", ids, len(ids), {"type": "stop", "matched": ids[-1]}), 0)
    assert st5.text() == "alpha beta gamma"  # a stop token's text is kept too, as vLLM keeps it


def test_batch_non_stream_yields_one_list(tokenizer) -> None:
    async def scenario():
        event = asyncio.Event()
        a, b = make_state(tokenizer, event, "a"), make_state(tokenizer, event, "b")
        asyncio.get_running_loop().call_later(0.01, b.apply, news("b", [5], 1, {"type": "length", "length": 1}), 0)
        asyncio.get_running_loop().call_later(0.02, a.apply, news("a", [6], 1, {"type": "length", "length": 1}), 0)
        return [o async for o in rs.iterate_states([a, b], True, False, None, tokenizer.decode)]

    outs = asyncio.run(scenario())
    assert len(outs) == 1 and [o["output_ids"] for o in outs[0]] == [[6], [5]]


def test_a_failed_batch_replies_at_once_with_the_others_shown_aborted(tokenizer) -> None:
    """Unstreamed, a batch whose request failed ends its wait at once; the others, which the caller
    then aborts, read as aborted without a status of their own (an Engine caller read
    finish_reason None, "still running"; a status would compete with the failure's)."""
    async def scenario():
        event = asyncio.Event()
        a, b, c = (make_state(tokenizer, event, rid) for rid in "abc")
        a.apply(news("a", [6], 1, {"type": "length", "length": 1}), 0)
        asyncio.get_running_loop().call_later(
            0.01, c.apply, news("c", [], 0, {"type": "abort", "message": "queue full", "status_code": 503}), 0)
        return [o async for o in rs.iterate_states([a, b, c], True, False, None, tokenizer.decode)], b

    outs, b = asyncio.run(scenario())
    assert len(outs) == 1 and not b.finished
    reasons = [o["meta_info"]["finish_reason"] for o in outs[0]]
    assert reasons == [{"type": "length", "length": 1}, rs.SIBLING_FAILED_ABORT,
                       {"type": "abort", "message": "queue full", "status_code": 503}]
    b.abort_for_failed_sibling()  # what the tokenizer manager then records, beside its AbortReq
    assert b.finished_reason == rs.SIBLING_FAILED_ABORT and not b.failed


class _GoneClient:
    """The part of a Starlette request the wait loop uses."""

    async def is_disconnected(self) -> bool:
        return True


def test_disconnected_client_ends_the_wait(tokenizer, monkeypatch) -> None:
    monkeypatch.setattr(rs, "DISCONNECT_POLL_S", 0.01)

    async def scenario():
        state = make_state(tokenizer, asyncio.Event())
        return [o async for o in rs.iterate_states([state], False, False, _GoneClient(), tokenizer.decode)]

    assert asyncio.run(scenario()) == []
