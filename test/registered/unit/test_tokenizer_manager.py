"""TokenizerManager's own machinery, on a real manager over a tiny checkpoint (its scheduler
client is never started: nothing here reaches a scheduler)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from sglang.srt.managers.generate_request import GenerateReqInput
from sglang.srt.managers.tokenizer_manager import OFF_LOOP_CHARS, TokenizerManager


@pytest.fixture(scope="module")
def tm(offline_tokenizer_manager) -> TokenizerManager:
    return offline_tokenizer_manager


def test_long_texts_are_tokenised_off_the_event_loop(tm) -> None:
    """A long tokenisation must leave the loop free for other requests: here the work waits for
    a coroutine of the loop, which can only run if the work is elsewhere (inline it would time
    out and return False)."""
    async def scenario() -> tuple[bool, str, str]:
        freed = threading.Event()

        async def other_request() -> None:
            freed.set()

        asyncio.get_running_loop().create_task(other_request())
        ran_free = await tm.off_loop(lambda: freed.wait(20), chars=OFF_LOOP_CHARS)
        long_thread = await tm.off_loop(lambda: threading.current_thread().name, chars=OFF_LOOP_CHARS)
        short_thread = await tm.off_loop(lambda: threading.current_thread().name, chars=10)
        return ran_free, long_thread, short_thread

    ran_free, long_thread, short_thread = asyncio.run(scenario())
    assert ran_free and long_thread.startswith("tokenizer") and short_thread == threading.main_thread().name


def test_a_long_prompt_is_refused_with_a_400_and_its_tokens_counted(tm) -> None:
    """Through the request path: a prompt beyond the context is tokenised (off the loop) and
    refused with the count."""
    from sglang.srt.managers.generate_request import InvalidRequestError

    async def scenario() -> None:
        obj = GenerateReqInput(text="hello world " * (OFF_LOOP_CHARS // 4), sampling_params={"max_new_tokens": 1})
        async for _ in tm.generate(obj):
            pass

    with pytest.raises(InvalidRequestError, match="longer than the model's context length"):
        asyncio.run(scenario())


def test_the_rid_of_a_request_whose_client_left_stays_taken_until_the_scheduler_ends_it(tm) -> None:
    """The client goes away: the manager sends the abort, but the scheduler still holds the rid
    until its news of the end arrives. A new request with that rid meanwhile would be dropped there
    as a duplicate (and wait forever), so it is refused; after the news it is accepted."""
    from sglang.srt.managers.generate_request import InvalidRequestError
    from sglang.srt.managers.io_struct import BatchTokenIDOut

    def request() -> GenerateReqInput:
        return GenerateReqInput(input_ids=[5, 6, 7], rid="reused", sampling_params={"max_new_tokens": 4})

    async def scenario() -> None:
        gen = tm.generate(request())
        waiting = asyncio.ensure_future(gen.__anext__())  # queued; no scheduler ever answers
        await asyncio.sleep(0.05)
        waiting.cancel()  # the client goes away
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await gen.aclose()
        assert "reused" in tm._abandoned and "reused" not in tm.rid_to_state
        with pytest.raises(InvalidRequestError, match="already running"):
            async for _ in tm.generate(request()):
                pass
        tm._handle_message(BatchTokenIDOut(
            rids=["reused"], finished_reasons=[{"type": "abort", "message": "aborted"}], output_ids=[[9, 9]],
            prompt_tokens=[3], completion_tokens=[2], cached_tokens=[0]))
        assert "reused" not in tm._abandoned

    asyncio.run(scenario())


def test_the_requests_of_one_call_reach_the_scheduler_in_one_message(tm) -> None:
    """A batch's prompts (and `n` > 1 samples) go out as one message, so the scheduler takes them
    at the same turn: sent one by one, a turn could start between two of them, and the batch's
    shape (with its rows' float sums) would hang on the timing."""
    from sglang.srt.managers.io_struct import (AbortReq, BatchTokenIDOut, TokenizedBatchReqInput,
                                               TokenizedGenerateReqInput)

    def drain() -> list:
        sent = []
        while not tm.client._outbox.empty():
            sent.append(tm.client._outbox.get())
        return [m for m in sent if not isinstance(m, AbortReq)]

    async def send(obj: GenerateReqInput) -> list:
        gen = tm.generate(obj)
        waiting = asyncio.ensure_future(gen.__anext__())  # queued; no scheduler ever answers
        await asyncio.sleep(0.05)
        sent = drain()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await gen.aclose()
        for m in sent:  # the scheduler's news of their end (they were never run)
            for r in (m.reqs if isinstance(m, TokenizedBatchReqInput) else [m]):
                tm._handle_message(BatchTokenIDOut(
                    rids=[r.rid], finished_reasons=[{"type": "abort", "message": "aborted"}], output_ids=[[]],
                    prompt_tokens=[len(r.input_ids)], completion_tokens=[0], cached_tokens=[0]))
        return sent

    async def scenario() -> None:
        drain()
        batch = await send(GenerateReqInput(input_ids=[[5, 6], [7, 8, 9], [4]], sampling_params={"max_new_tokens": 2}))
        assert len(batch) == 1 and isinstance(batch[0], TokenizedBatchReqInput), batch
        assert [r.input_ids for r in batch[0].reqs] == [[5, 6], [7, 8, 9], [4]]
        samples = await send(GenerateReqInput(input_ids=[5, 6], sampling_params={"max_new_tokens": 2, "n": 3,
                                                                                 "temperature": 1.0}))
        assert len(samples) == 1 and len(samples[0].reqs) == 3, samples
        single = await send(GenerateReqInput(input_ids=[5, 6], sampling_params={"max_new_tokens": 2}))
        assert len(single) == 1 and isinstance(single[0], TokenizedGenerateReqInput), single

    asyncio.run(scenario())
