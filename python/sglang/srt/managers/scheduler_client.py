"""The main process's handle on the scheduler processes (one per tensor-parallel rank).

Transport: two one-way `multiprocessing` pipes (spawn context) to rank 0, carrying the dataclasses
of `io_struct.py`; rank 0 broadcasts what it receives to the other ranks and alone replies
(DESIGN §11). Sending goes through a writer thread, because a pipe write blocks once the pipe
buffer is full (a long prompt while the scheduler is busy in a forward) and the HTTP event loop
must never block on the scheduler. Receiving runs in a reader thread that hands every message to a
callback (the tokenizer manager turns it into `loop.call_soon_threadsafe`). The rank processes
themselves (start-up handshake, watchdog, termination) are `SchedulerRanks`'s business.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import queue
import threading
from typing import Any, Callable, Optional

from sglang.srt.configs.run_configs import SchedulerConfig, TPLayout
from sglang.srt.distributed import plan_local_ranks
from sglang.srt.managers.io_struct import SchedulerFailed, ShutdownReq
from sglang.srt.managers.scheduler_process import run_scheduler_process
from sglang.srt.managers.scheduler_ranks import SchedulerRanks

logger = logging.getLogger(__name__)

_STOP = object()


class SchedulerClient:
    def __init__(self, config: SchedulerConfig, tp: TPLayout) -> None:
        self.config = config
        self.tp = tp
        self.ranks: Optional[SchedulerRanks] = None
        self._send_conn = None
        self._recv_conn = None
        self._outbox: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._writer: Optional[threading.Thread] = None
        self._reader: Optional[threading.Thread] = None
        self._closed = False
        self.exit_reason: Optional[str] = None
        # Whether rank 0's news still goes to the callbacks of start_reader; the lock makes
        # stop_delivery wait for a hand-over in progress.
        self._delivering = True
        self._delivery_lock = threading.Lock()

    @property
    def proc(self) -> Optional[mp.process.BaseProcess]:
        """Rank 0's process (the only one at tp_size 1)."""
        return self.ranks.ranks[0].proc if self.ranks and self.ranks.ranks else None

    # ------------------------------------------------------------------ start-up
    def start(self, timeout: float = 600.0) -> dict[str, Any]:
        """Spawn the rank processes and wait until every one reports ready; returns rank 0's info
        (with `tp_ranks`, one entry per rank)."""
        specs = plan_local_ranks(self.tp)
        assert specs[0].tp_rank == 0, "the scheduler client runs on the node of rank 0"
        to_child_r, to_child_w = mp.get_context("spawn").Pipe(duplex=False)
        self.ranks = SchedulerRanks(self.config, specs)
        atexit.register(self.shutdown)
        try:
            self.ranks.spawn(run_scheduler_process, to_child_r, mp.current_process().pid)
        finally:
            to_child_r.close()
        self._send_conn, self._recv_conn = to_child_w, self.ranks.ranks[0].status
        try:
            self.ranks.wait_ready(timeout)
        except BaseException:
            # A rank that is still loading reads no ShutdownReq: asking would only wait 10 s (Ctrl-C
            # during start-up). There is nothing to finish: stop them now.
            self.shutdown(ask_first=False)
            raise
        self._writer = threading.Thread(target=self._write_loop, name="sglang-sched-writer", daemon=True)
        self._writer.start()
        return self.ranks.combined_info()

    def start_reader(self, on_message: Callable[[Any], None], on_exit: Callable[[str], None]) -> None:
        """Deliver rank 0's messages to `on_message`; report the first rank that dies to `on_exit`."""

        def read_loop() -> None:
            while True:
                try:
                    msg = self._recv_conn.recv()
                except (EOFError, OSError):
                    return  # rank 0 is gone; the watchdog reports why
                if isinstance(msg, SchedulerFailed):  # rank 0's crash report, just before it exits
                    self.ranks.note_crash(0, msg.error, msg.failed_at)
                    continue
                with self._delivery_lock:
                    if not self._delivering:
                        continue  # nobody left to tell: drain the pipe until rank 0 exits
                    try:
                        on_message(msg)
                    except Exception:  # a bug in a handler must not kill the reader
                        logger.exception("error while handling a scheduler message")

        def on_failure(reason: str) -> None:
            if not self._closed:
                self.exit_reason = reason
                with self._delivery_lock:
                    if self._delivering:
                        on_exit(reason)

        self._reader = threading.Thread(target=read_loop, name="sglang-sched-reader", daemon=True)
        self._reader.start()
        self.ranks.watch(on_failure, rank0_reader=self._reader)

    def stop_delivery(self) -> None:
        """Stop handing rank 0's messages (and a rank's exit) to start_reader's callbacks, for a
        receiver that is going away: the HTTP server calls it before its event loop closes. Rank 0
        keeps sending news of the requests it was running until the shutdown that follows reaches
        it, and each such message would otherwise fail on the closed loop with a traceback in the
        log. Returns once no callback is running; idempotent."""
        with self._delivery_lock:
            self._delivering = False

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
                return  # the child is gone; the watchdog reports it

    # ------------------------------------------------------------------ state and shutdown
    def is_alive(self) -> bool:
        return self.ranks is not None and self.ranks.alive() and self.exit_reason is None

    def shutdown(self, timeout: float = 10.0, ask_first: bool = True) -> None:
        """Ask the scheduler to exit (rank 0 passes it on to every rank), then make sure every rank
        does (terminate, kill); `ask_first` False kills them at once. Idempotent."""
        if self._closed:
            return
        self._closed = True
        ranks = self.ranks
        if ranks is not None:
            ranks.stopping = True
            if ask_first and ranks.alive() and self._send_conn is not None:
                try:
                    if self._writer is not None:
                        self._outbox.put(ShutdownReq())
                        self._outbox.put(_STOP)
                        self._writer.join(timeout=2.0)
                    else:
                        self._send_conn.send(ShutdownReq())
                except (OSError, ValueError):
                    pass
                ranks.join(timeout)
            if any(r.proc.is_alive() for r in ranks.ranks):
                if ask_first:
                    logger.warning("The scheduler did not exit in time; terminating it.")
                ranks.terminate()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout=2.0)  # it sees EOF once the child is gone
        if ranks is not None:
            ranks.close()
        try:
            if self._send_conn is not None:
                self._send_conn.close()
        except OSError:
            pass
        try:
            atexit.unregister(self.shutdown)
        except Exception:
            pass
