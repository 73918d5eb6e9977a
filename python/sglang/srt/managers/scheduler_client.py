"""The main process's handle on the scheduler child process.

Transport: two one-way `multiprocessing` pipes (spawn context), carrying the dataclasses of
`io_struct.py`. Sending goes through a writer thread, because a pipe write blocks once the pipe
buffer is full (a long prompt while the scheduler is busy in a forward) and the HTTP event loop
must never block on the scheduler. Receiving runs in a reader thread that hands every message to a
callback (the tokenizer manager turns it into `loop.call_soon_threadsafe`).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing as mp
import queue
import sys
import threading
import time
from typing import Any, Callable, Iterator, Optional

from sglang.srt.managers.io_struct import SchedulerFailed, SchedulerReady, ShutdownReq
from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

_STOP = object()


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Start a spawn child without re-running the parent's `__main__`.

    multiprocessing's spawn re-imports the parent's main script in the child unless the script
    guards itself with `if __name__ == "__main__"`; an unguarded script that creates an `Engine`
    would then start a second engine in the child and fail. The child runs a function of this
    package and needs nothing from `__main__`, so we hide where it came from while spawning.
    """
    main = sys.modules.get("__main__")
    saved = {k: getattr(main, k) for k in ("__file__", "__spec__") if main is not None and hasattr(main, k)}
    try:
        if main is not None:
            if "__file__" in saved:
                del main.__file__
            main.__spec__ = None
        yield
    finally:
        for k, v in saved.items():
            setattr(main, k, v)


class SchedulerClient:
    def __init__(self, server_args: ServerArgs) -> None:
        self.server_args = server_args
        self.proc: Optional[mp.process.BaseProcess] = None
        self._send_conn = None
        self._recv_conn = None
        self._outbox: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._writer: Optional[threading.Thread] = None
        self._reader: Optional[threading.Thread] = None
        self._closed = False
        self.exit_reason: Optional[str] = None

    # ------------------------------------------------------------------ start-up
    def start(self, timeout: float = 600.0) -> dict[str, Any]:
        """Spawn the scheduler and wait until it reports ready; returns its info dict."""
        from sglang.srt.managers.scheduler import run_scheduler_process

        ctx = mp.get_context("spawn")
        to_child_r, to_child_w = ctx.Pipe(duplex=False)
        from_child_r, from_child_w = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=run_scheduler_process,
            args=(self.server_args, to_child_r, from_child_w, mp.current_process().pid),
            name="sglang-scheduler",
            daemon=True,  # multiprocessing terminates daemonic children when the parent exits
        )
        with _main_module_hidden():
            self.proc.start()
        to_child_r.close()
        from_child_w.close()
        self._send_conn, self._recv_conn = to_child_w, from_child_r
        atexit.register(self.shutdown)

        deadline = time.monotonic() + timeout
        while True:
            if self._recv_conn.poll(0.5):
                try:
                    msg = self._recv_conn.recv()
                except (EOFError, OSError):
                    msg = None
                if isinstance(msg, SchedulerReady):
                    break
                self.shutdown()
                if isinstance(msg, SchedulerFailed):
                    if msg.user_error:
                        raise ValueError(msg.error)
                    raise RuntimeError(f"The scheduler failed to start:\n{msg.error}")
                raise RuntimeError(f"The scheduler exited during start-up (exit code {self.proc.exitcode}).")
            if not self.proc.is_alive():
                code = self.proc.exitcode
                self.shutdown()
                raise RuntimeError(f"The scheduler exited during start-up (exit code {code}).")
            if time.monotonic() > deadline:
                self.shutdown()
                raise RuntimeError(f"The scheduler did not become ready within {timeout:.0f} s.")

        self._writer = threading.Thread(target=self._write_loop, name="sglang-sched-writer", daemon=True)
        self._writer.start()
        return msg.info

    def start_reader(self, on_message: Callable[[Any], None], on_exit: Callable[[str], None]) -> None:
        def read_loop() -> None:
            while True:
                try:
                    msg = self._recv_conn.recv()
                except (EOFError, OSError):
                    break
                try:
                    on_message(msg)
                except Exception:  # a bug in a handler must not kill the reader
                    logger.exception("error while handling a scheduler message")
            if not self._closed:
                code = self.proc.exitcode if self.proc is not None else None
                self.exit_reason = f"the scheduler process exited unexpectedly (exit code {code})"
                logger.error("%s", self.exit_reason)
                on_exit(self.exit_reason)

        self._reader = threading.Thread(target=read_loop, name="sglang-sched-reader", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------------ messages
    def send(self, msg: Any) -> None:
        """Queue a message for the scheduler; never blocks."""
        if not self._closed:
            self._outbox.put(msg)

    def _write_loop(self) -> None:
        while True:
            msg = self._outbox.get()
            if msg is _STOP:
                return
            try:
                self._send_conn.send(msg)
            except (OSError, ValueError, BrokenPipeError):
                return  # the child is gone; the reader reports it

    # ------------------------------------------------------------------ state and shutdown
    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive() and self.exit_reason is None

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the scheduler to exit, then make sure it does (terminate, kill). Idempotent."""
        if self._closed:
            return
        self._closed = True
        proc = self.proc
        if proc is not None and proc.is_alive() and self._send_conn is not None:
            try:
                if self._writer is not None:
                    self._outbox.put(ShutdownReq())
                    self._outbox.put(_STOP)
                    self._writer.join(timeout=2.0)
                else:
                    self._send_conn.send(ShutdownReq())
            except (OSError, ValueError):
                pass
            proc.join(timeout)
        if proc is not None and proc.is_alive():
            logger.warning("The scheduler did not exit in time; terminating it.")
            proc.terminate()
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout=2.0)  # it sees EOF once the child is gone
        for conn in (self._send_conn, self._recv_conn):
            try:
                if conn is not None:
                    conn.close()
            except OSError:
                pass
        try:
            atexit.unregister(self.shutdown)
        except Exception:
            pass
