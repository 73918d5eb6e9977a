"""`sglang.Engine` at the edges of its lifetime: `shutdown()` while other threads still wait on it.

Calls in flight when the engine is shut down (a blocking `generate` in another thread, a stream
being read, an `async_generate` awaited from another loop) must end, with a reply that says the
engine was shut down, instead of waiting forever for news from a scheduler that has exited; a
stream first read after the shutdown, and every method called after it, must raise at once.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any, Callable

import pytest

from server_helpers import PYTHON_DIR, cache_dir_for_tests, server_env

# Far more tokens than the demo model decodes while the engine shuts down (about 0.5 s).
LONG = {"max_new_tokens": 1800, "ignore_eos": True}


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict]:
    """Run `fn` in a daemon thread (a hang fails the test instead of blocking it); its result or
    exception lands in the returned dict."""
    out: dict = {}

    def body() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            out["error"] = e

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, out


def test_shutdown_ends_calls_in_flight_and_later_calls_raise(monkeypatch) -> None:
    from sglang import Engine

    monkeypatch.setenv("SGLANG_CACHE_DIR", cache_dir_for_tests())
    eng = Engine(model_path="demo", device="cpu", max_total_tokens=16384, decode_log_interval=10**6)
    try:
        blocking, blocking_out = in_thread(lambda: eng.generate("A blocking call", LONG))
        batch, batch_out = in_thread(lambda: eng.generate(["One of a batch", "Two of a batch"], LONG))
        stream = eng.generate("An open stream", LONG, stream=True)
        first = next(stream)  # the stream's request runs
        never_read = eng.generate("A stream read only after the shutdown", LONG, stream=True)

        async def awaited() -> list[dict]:
            async def last_chunk() -> dict:
                return [c async for c in await eng.async_generate("An async stream", LONG, stream=True)][-1]

            return list(await asyncio.gather(eng.async_generate("An async call", LONG), last_chunk()))

        async_calls, async_out = in_thread(lambda: asyncio.run(awaited()))
        deadline = time.monotonic() + 120
        while eng.get_server_info()["num_running_reqs"] < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.get_server_info()["num_running_reqs"] == 6  # all of them run when the engine stops
    finally:
        eng.shutdown()

    # A call that waits for the exited scheduler waits forever: the joins' generous limits only
    # keep a loaded machine's slow wake-ups from reading as one.
    streamed, stream_out = in_thread(lambda: [first] + list(stream))
    for thread in (blocking, batch, streamed, async_calls):
        thread.join(60)
        assert not thread.is_alive(), "a call in flight still waits after Engine.shutdown()"
    for out in (blocking_out, batch_out, stream_out, async_out):
        assert "error" not in out, out
    replies = [blocking_out["value"], *batch_out["value"], stream_out["value"][-1], *async_out["value"]]
    for reply in replies:  # cut short, and saying why
        reason = reply["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "shut down" in reason["message"], reason
        assert reply["meta_info"]["completion_tokens"] < LONG["max_new_tokens"]

    late, late_out = in_thread(lambda: next(never_read))
    late.join(30)
    assert not late.is_alive(), "a stream first read after Engine.shutdown() waits forever"
    assert isinstance(late_out.get("error"), RuntimeError) and "shut down" in str(late_out["error"])
    for call in (lambda: eng.generate("x", {"max_new_tokens": 1}), eng.get_server_info, eng.flush_cache,
                 lambda: eng.unload_lora_adapter("demo-qv-r8"),
                 lambda: asyncio.run(eng.async_generate("x", {"max_new_tokens": 1}))):
        with pytest.raises(RuntimeError, match="shut down"):
            call()
    eng.shutdown()  # a second shutdown is a no-op


def test_an_engine_nobody_references_shuts_its_scheduler_down(monkeypatch) -> None:
    """`__del__` shuts an unreferenced Engine down: nothing of the engine (its loop thread) may
    keep it alive, and with it a scheduler process, until the interpreter exits."""
    import gc

    from sglang import Engine

    monkeypatch.setenv("SGLANG_CACHE_DIR", cache_dir_for_tests())
    eng = Engine(model_path="demo", device="cpu", max_total_tokens=512, decode_log_interval=10**6)
    assert eng.generate("Hello", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] <= 2
    scheduler, thread = eng.tokenizer_manager.client.proc, eng._thread
    del eng
    gc.collect()
    scheduler.join(60)  # kept alive, it would live until the interpreter exits: generous limits
    thread.join(30)
    assert not scheduler.is_alive() and not thread.is_alive()


def test_a_script_that_fails_with_a_global_engine_exits_promptly(tmp_path) -> None:
    """The interpreter exiting shuts a global Engine down (its __del__) without waiting on the
    engine's loop thread, which no longer runs then."""
    script = tmp_path / "fails.py"
    script.write_text(textwrap.dedent("""
        import time
        from sglang import Engine
        eng = Engine(model_path="demo", device="cpu", max_total_tokens=512, decode_log_interval=10**6)
        eng.generate("Hello", {"max_new_tokens": 2})
        print(time.time(), flush=True)
        raise ValueError("the script fails")
    """))
    env = {**os.environ, "PYTHONPATH": PYTHON_DIR, **server_env()}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    exit_seconds = time.time() - float(out.stdout.split()[0])
    assert out.returncode == 1 and "the script fails" in out.stderr, out.stderr[-3000:]
    # Waiting on the loop thread costs 15 s (Engine.shutdown: the calls in flight's 10 s, then the
    # thread's join, 5 s), and a scheduler that does not exit 10 s (SchedulerClient.shutdown); a
    # prompt exit takes ~1.5 s on an idle 2-core machine, and a few times that on a loaded one (the
    # scheduler process's own exit and the interpreter's clean-up), so the bound sits under 10 s.
    assert exit_seconds < 9, f"exiting took {exit_seconds:.1f} s"
    assert "Traceback" not in out.stderr.split("ValueError: the script fails")[-1], out.stderr[-3000:]
