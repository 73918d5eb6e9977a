"""`Engine`: offline generation in-process, through the same scheduler child process as the server.

    from sglang import Engine
    with Engine(model_path="demo", device="cpu") as engine:
        out = engine.generate("Hello", {"max_new_tokens": 8, "temperature": 0})
        # in a coroutine: out = await engine.async_generate("Hello", {"max_new_tokens": 8})

The tokenizer manager runs on a private event loop in a background thread; the blocking methods
submit coroutines to it, so an `Engine` works from plain scripts and from inside other event loops,
and `async_generate` awaits its replies from the caller's own loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import sys
import threading
import time
from typing import Any, AsyncIterator, Iterator, Optional, Union

from sglang.srt.configs.tokenizer import start_tokenizer_load
from sglang.srt.managers.generate_request import GenerateReqInput
from sglang.srt.managers.scheduler_client import SchedulerClient
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.server_args import ServerArgs
from sglang.srt.server_configs import build_run_configs

logger = logging.getLogger(__name__)

# The reply's finish message for calls still in flight at Engine.shutdown(), and the error of calls after it.
SHUT_DOWN = "this Engine has been shut down"


def launch_runtime(server_args: ServerArgs) -> TokenizerManager:
    """Start the scheduler processes (one per TP rank) and build the tokenizer manager in front."""
    if server_args.node_rank != 0:
        raise ValueError(
            f"--node-rank {server_args.node_rank}: only node 0 serves requests; start the other "
            "nodes with `python -m sglang.launch_server ... --node-rank K`"
        )
    configs = build_run_configs(server_args)  # every check that needs no process, before any starts
    client = SchedulerClient(configs.scheduler, configs.tp)
    # The tokenizer loads while the scheduler starts, not after it is ready. The rank processes
    # are spawned, not forked, so a thread here is safe.
    t0 = time.perf_counter()
    tokenizer = start_tokenizer_load(configs.tokenizer_manager.tokenizer)
    info = client.start()
    logger.info("Scheduler ready after %.1f s", time.perf_counter() - t0)
    try:
        return TokenizerManager(configs.tokenizer_manager, client, info, tokenizer=tokenizer)
    except BaseException:
        client.shutdown()
        raise


def _request(prompt: Any, sampling_params: Any, input_ids: Any, return_logprob: Any, logprob_start_len: Any,
             top_logprobs_num: Any, lora_path: Any, stream: bool, return_text_in_logprobs: bool, rid: Any,
             cache_salt: Any) -> GenerateReqInput:
    """The `/generate` request of `Engine.generate`'s arguments (its defaults: /generate's)."""
    return GenerateReqInput(
        text=prompt, input_ids=input_ids, sampling_params=sampling_params,
        return_logprob=return_logprob,
        logprob_start_len=-1 if logprob_start_len is None else logprob_start_len,
        top_logprobs_num=0 if top_logprobs_num is None else top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs, lora_path=lora_path, stream=stream, rid=rid,
        cache_salt=cache_salt,
    )


def _serve_loop(loop: asyncio.AbstractEventLoop) -> None:
    """The engine's loop thread. Once shutdown() stops the loop it is closed, so that a call
    submitted later fails at once instead of waiting for a loop that will never run it."""
    loop.run_forever()
    loop.close()


class Engine:
    def __init__(self, server_args: Optional[ServerArgs] = None, **kwargs: Any) -> None:
        if server_args is None:
            server_args = ServerArgs(**kwargs)
        elif kwargs:
            raise ValueError("pass either server_args or keyword arguments, not both")
        self._closed = False
        self.server_args = server_args
        self.tokenizer_manager = launch_runtime(server_args)
        self.loop = asyncio.new_event_loop()
        # The thread must not hold the Engine: an Engine nobody references is shut down by __del__.
        self._thread = threading.Thread(target=_serve_loop, args=(self.loop,), name="sglang-engine-loop", daemon=True)
        self._thread.start()
        started = threading.Event()

        def start() -> None:
            self.tokenizer_manager.start(self.loop)
            started.set()

        self.loop.call_soon_threadsafe(start)
        started.wait()

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompt: Optional[Union[str, list[str]]] = None,
        sampling_params: Optional[Union[dict, list[dict]]] = None,
        input_ids: Optional[Union[list[int], list[list[int]]]] = None,
        return_logprob: Union[bool, list[bool]] = False,
        logprob_start_len: Optional[Union[int, list[int]]] = None,
        top_logprobs_num: Optional[Union[int, list[int]]] = None,
        lora_path: Optional[Union[str, list[Optional[str]]]] = None,
        stream: bool = False,
        return_text_in_logprobs: bool = False,
        rid: Optional[Union[str, list[str]]] = None,
        cache_salt: Optional[Union[str, list[Optional[str]]]] = None,
    ) -> Union[dict, list[dict], Iterator[dict]]:
        """Same replies as `POST /generate`: a dict, a list for a batch, or (stream=True) a
        generator of cumulative dicts."""
        self._check_open()
        obj = _request(prompt, sampling_params, input_ids, return_logprob, logprob_start_len, top_logprobs_num,
                       lora_path, stream, return_text_in_logprobs, rid, cache_salt)
        if stream:
            return self._stream(obj)
        return self._run(self.tokenizer_manager.generate_one(obj))

    async def async_generate(
        self,
        prompt: Optional[Union[str, list[str]]] = None,
        sampling_params: Optional[Union[dict, list[dict]]] = None,
        input_ids: Optional[Union[list[int], list[list[int]]]] = None,
        return_logprob: Union[bool, list[bool]] = False,
        logprob_start_len: Optional[Union[int, list[int]]] = None,
        top_logprobs_num: Optional[Union[int, list[int]]] = None,
        lora_path: Optional[Union[str, list[Optional[str]]]] = None,
        stream: bool = False,
        return_text_in_logprobs: bool = False,
        rid: Optional[Union[str, list[str]]] = None,
        cache_salt: Optional[Union[str, list[Optional[str]]]] = None,
    ) -> Union[dict, list[dict], AsyncIterator[dict]]:
        """`generate` for a coroutine, as upstream SGLang's: the reply, or (stream=True) an async
        iterator of cumulative dicts. Many may run at once from the caller's loop (they batch
        together); cancelling one aborts its request."""
        self._check_open()
        obj = _request(prompt, sampling_params, input_ids, return_logprob, logprob_start_len, top_logprobs_num,
                       lora_path, stream, return_text_in_logprobs, rid, cache_salt)
        if stream:
            return self._async_stream(obj)
        # The request runs on the engine's loop; a cancelled await cancels it there (an abort).
        return await asyncio.wrap_future(
            asyncio.run_coroutine_threadsafe(self.tokenizer_manager.generate_one(obj), self.loop))

    async def _async_stream(self, obj: GenerateReqInput) -> AsyncIterator[dict]:
        self._check_open()  # first iterated after shutdown: the loop no longer runs
        caller = asyncio.get_running_loop()
        items: "asyncio.Queue[tuple[str, Any]]" = asyncio.Queue()

        def hand_over(kind: str, value: Any) -> None:
            try:
                caller.call_soon_threadsafe(items.put_nowait, (kind, value))
            except RuntimeError:
                pass  # the caller's loop is closed: nobody reads any more

        async def pump() -> None:
            try:
                async for out in self.tokenizer_manager.generate(obj):
                    hand_over("item", out)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's loop
                hand_over("error", e)
            finally:
                hand_over("end", None)

        fut = asyncio.run_coroutine_threadsafe(pump(), self.loop)
        try:
            while True:
                kind, value = await items.get()
                if kind == "item":
                    yield value
                elif kind == "error":
                    raise value
                else:
                    return
        finally:
            if not fut.done():
                fut.cancel()  # the caller stopped early: the request is aborted, its KV freed

    def _stream(self, obj: GenerateReqInput) -> Iterator[dict]:
        self._check_open()  # first iterated after shutdown: the loop no longer runs
        items: "queue.Queue[tuple[str, Any]]" = queue.Queue()

        async def pump() -> None:
            try:
                async for out in self.tokenizer_manager.generate(obj):
                    items.put(("item", out))
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                items.put(("error", e))
            finally:
                items.put(("end", None))

        fut = asyncio.run_coroutine_threadsafe(pump(), self.loop)
        try:
            while True:
                kind, value = items.get()
                if kind == "item":
                    yield value
                elif kind == "error":
                    raise value
                else:
                    return
        finally:
            if not fut.done():
                fut.cancel()  # the caller stopped early: the request is aborted, its KV freed

    # ------------------------------------------------------------------ adapters
    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> dict[str, Any]:
        """Load a PEFT adapter at run time. Returns `{success, error_message, loaded_adapters}`
        like `POST /load_lora_adapter`; a refused adapter changes nothing."""
        self._check_open()
        out, _ = self._run(self.tokenizer_manager.load_lora_adapter(lora_name, lora_path, pinned))
        return dataclasses.asdict(out)

    def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """Unload an adapter once its in-flight requests finish; same reply as `load_lora_adapter`."""
        self._check_open()
        out, _ = self._run(self.tokenizer_manager.unload_lora_adapter(lora_name))
        return dataclasses.asdict(out)

    def flush_cache(self) -> dict[str, Any]:
        """Empty the prefix cache, like `POST /flush_cache`: `{success, message}`; refused
        (success False) while requests run."""
        self._check_open()
        return dataclasses.asdict(self._run(self.tokenizer_manager.flush_cache()))

    def get_server_info(self) -> dict[str, Any]:
        self._check_open()
        return self._run(self.tokenizer_manager.server_info())

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(SHUT_DOWN)

    # ------------------------------------------------------------------ lifetime
    async def _end_in_flight(self) -> None:
        """On the loop, once the scheduler has exited: calls still waiting on it (a generate in
        another thread, an open stream) end now, their replies cut short with SHUT_DOWN."""
        self.tokenizer_manager.close(SHUT_DOWN)
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if others:
            # Let them hand their last replies over; whatever still runs after that is cancelled.
            _, pending = await asyncio.wait(others, timeout=5.0)
            for task in pending:
                task.cancel()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.tokenizer_manager.client.shutdown()
        # Waiting on the loop thread is pointless (and would hang until its timeout) from the loop
        # thread itself (__del__ run by the GC there) and while the interpreter exits (__del__ of a
        # global: daemon threads no longer run, and no caller is left waiting).
        can_wait = threading.current_thread() is not self._thread and not sys.is_finalizing()
        if not self.loop.is_running():
            return
        if can_wait:
            try:
                asyncio.run_coroutine_threadsafe(self._end_in_flight(), self.loop).result(timeout=10.0)
            except Exception:  # noqa: BLE001 - shutting down regardless
                logger.exception("Ending the calls in flight at shutdown failed")
        self.loop.call_soon_threadsafe(self.loop.stop)
        if can_wait:
            self._thread.join(timeout=5.0)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass
