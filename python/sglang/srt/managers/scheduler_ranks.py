"""The scheduler processes of this node, one per tensor-parallel rank: spawn, start-up handshake,
watchdog, termination.

Each rank process reports on its own status pipe (`SchedulerReady` / `SchedulerFailed`, see
scheduler_process.py). `wait_ready` waits for every rank to be ready and, if any rank fails, exits or
stays silent past the timeout, terminates them all and raises an error naming that rank and its
cause. After start-up, `watch` runs a watchdog thread: the first rank process to exit while the
ranks are not being shut down is reported (rank, pid, signal or exit code, the last line of its
crash report), and every other rank is terminated, so a dead rank never leaves the others hanging
in a collective and no process outlives the server.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import signal
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterator, Optional

from sglang.srt.distributed import RankSpec
from sglang.srt.managers.io_struct import SchedulerFailed, SchedulerReady
from sglang.srt.configs.run_configs import SchedulerConfig

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
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


def describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


@dataclass
class RankProcess:
    spec: RankSpec
    proc: mp.process.BaseProcess
    status: Connection  # rank -> parent; rank 0's also carries its replies
    info: Optional[dict[str, Any]] = None
    crash: Optional[str] = None  # the traceback of a crash report
    failed_at: float = float("inf")  # when it crashed (time.time()), from its report

    @property
    def label(self) -> str:
        return f"{self.spec.name} (pid {self.proc.pid})" if self.spec.tp_size > 1 else "the scheduler process"


class StartupError(RuntimeError):
    pass


class SchedulerRanks:
    def __init__(self, config: SchedulerConfig, specs: list[RankSpec]) -> None:
        self.config = config  # every rank's scheduler runs on it
        self.specs = specs
        self.ranks: list[RankProcess] = []
        self.stopping = False  # set once a shutdown is under way: exits are expected from then on
        self.failure: Optional[str] = None
        self._lock = threading.Lock()
        self._watchdog: Optional[threading.Thread] = None

    @property
    def tp_size(self) -> int:
        return self.specs[0].tp_size

    # ------------------------------------------------------------------ start-up
    def spawn(self, target: Callable[..., None], rank0_requests: Optional[Connection], parent_pid: int) -> None:
        ctx = mp.get_context("spawn")
        for spec in self.specs:
            status_r, status_w = ctx.Pipe(duplex=False)
            requests = rank0_requests if spec.tp_rank == 0 else None
            proc = ctx.Process(
                target=target,
                args=(self.config, requests, status_w, parent_pid, spec),
                name=f"sglang-scheduler-tp{spec.tp_rank}" if spec.tp_size > 1 else "sglang-scheduler",
                daemon=True,  # multiprocessing terminates daemonic children when the parent exits
            )
            with main_module_hidden():
                proc.start()
            status_w.close()
            self.ranks.append(RankProcess(spec, proc, status_r))

    def wait_ready(self, timeout: float) -> None:
        """Block until every rank is ready; on any failure terminate them all and raise (ValueError
        for a configuration error the user can fix, StartupError otherwise)."""
        deadline = time.monotonic() + timeout
        pending = {r.status: r for r in self.ranks}
        sentinels = {r.proc.sentinel: r for r in self.ranks}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                names = ", ".join(r.spec.name for r in pending.values())
                self._fail_start(StartupError(
                    f"The scheduler did not become ready within {timeout:.0f} s"
                    + (f" (waiting for {names})." if self.tp_size > 1 else ".")
                ))
            for obj in wait([*pending, *sentinels], timeout=min(left, 1.0)):
                if obj in pending:  # a report, or EOF: the rank died without one
                    rank = pending[obj]
                    try:
                        msg = obj.recv()
                    except (EOFError, OSError):
                        msg = None
                    if isinstance(msg, SchedulerReady):
                        rank.info = msg.info
                        del pending[obj]
                        continue
                    if isinstance(msg, SchedulerFailed):
                        self._fail_start(self._startup_error(rank, msg))
                else:  # a rank process exited
                    rank = sentinels[obj]
                    if rank.status in pending and rank.status.poll():
                        continue  # its report is read next round
                rank.proc.join(1.0)
                self._fail_start(StartupError(
                    f"{self._prefix(rank)}The scheduler exited during start-up ({describe_exit(rank.proc.exitcode)})."
                ))

    def _prefix(self, rank: RankProcess) -> str:
        return f"{rank.spec.name} (pid {rank.proc.pid}): " if self.tp_size > 1 else ""

    def _startup_error(self, rank: RankProcess, msg: SchedulerFailed) -> Exception:
        if msg.user_error:
            return ValueError(f"{rank.spec.name}: {msg.error}" if self.tp_size > 1 else msg.error)
        return StartupError(f"{self._prefix(rank)}The scheduler failed to start:\n{msg.error}")

    def _fail_start(self, error: Exception) -> None:
        self.stopping = True
        self.terminate()
        raise error

    def combined_info(self) -> dict[str, Any]:
        """Rank 0's start-up facts (the first local rank's on other nodes), plus one entry per rank."""
        infos = [dict(r.info or {}) for r in self.ranks]
        per_rank = [info.pop("rank", {}) for info in infos]
        return {**infos[0], "tp_size": self.tp_size, "tp_ranks": per_rank}

    # ------------------------------------------------------------------ watchdog
    def watch(self, on_failure: Callable[[str], None], rank0_reader: Optional[threading.Thread] = None) -> None:
        """Start the watchdog thread (see the module doc). `rank0_reader` is the thread that reads
        rank 0's pipe: a crash report of rank 0 arrives there, so it is let finish first."""

        def run() -> None:
            sentinels = {r.proc.sentinel: r for r in self.ranks}
            # Rank 0's pipe belongs to its reader; the others' carry only crash reports.
            reports = {r.status: r for r in self.ranks if not (r.spec.tp_rank == 0 and rank0_reader is not None)}
            while not self.stopping:
                try:
                    ready = wait([*sentinels, *reports], timeout=0.5)
                except (OSError, ValueError):  # the pipes were closed under us: shutting down
                    return
                dead = []
                for obj in ready:
                    if obj in reports:
                        self._read_report(reports, obj)
                    else:
                        dead.append(sentinels[obj])
                if dead and not self.stopping:
                    for rank in dead:
                        self._read_report(reports, rank.status)
                    if rank0_reader is not None and any(r.spec.tp_rank == 0 for r in dead):
                        rank0_reader.join(2.0)
                    self._report_failure(dead, on_failure)
                    return

        self._watchdog = threading.Thread(target=run, name="sglang-rank-watchdog", daemon=True)
        self._watchdog.start()

    @staticmethod
    def _read_report(reports: dict[Connection, RankProcess], conn: Connection) -> None:
        rank = reports.get(conn)
        if rank is None:
            return
        try:
            while conn.poll():
                msg = conn.recv()
                if isinstance(msg, SchedulerFailed):
                    rank.crash = msg.error
                    rank.failed_at = msg.failed_at or rank.failed_at
        except (EOFError, OSError):
            del reports[conn]  # the rank closed its end; its exit shows through the sentinel

    def note_crash(self, tp_rank: int, error: str, failed_at: float = 0.0) -> None:
        for rank in self.ranks:
            if rank.spec.tp_rank == tp_rank:
                rank.crash = error
                rank.failed_at = failed_at or rank.failed_at

    def _report_failure(self, dead: list[RankProcess], on_failure: Callable[[str], None]) -> None:
        with self._lock:
            if self.stopping or self.failure is not None:
                return
            for rank in dead:
                rank.proc.join(1.0)
            # Prefer a rank killed by a signal, then the rank that failed first: the others'
            # errors are usually the consequence (a collective whose peer is gone).
            first = min(dead, key=lambda r: ((r.proc.exitcode or 0) >= 0, r.failed_at, r.spec.tp_rank))
            reason = f"{first.label} exited unexpectedly ({describe_exit(first.proc.exitcode)})"
            if first.crash:
                reason += f": {last_line(first.crash)}"
            self.failure = reason
        logger.error("%s%s", reason[0].upper() + reason[1:], "; stopping the other ranks." if self.tp_size > 1 else ".")
        self.terminate()
        on_failure(reason)

    # ------------------------------------------------------------------ shutdown
    def alive(self) -> bool:
        return bool(self.ranks) and all(r.proc.is_alive() for r in self.ranks)

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for rank in self.ranks:
            rank.proc.join(max(0.0, deadline - time.monotonic()))

    def terminate(self) -> None:
        """SIGKILL every rank still alive and reap it. (A rank defers a SIGTERM for the server's
        shutdown, scheduler_process.SIGTERM_EXIT_AFTER_S; this is the last resort, for ranks that
        did not stop when asked or must stop now.)"""
        alive = [r for r in self.ranks if r.proc.is_alive()]
        for rank in alive:
            rank.proc.kill()
        for rank in alive:
            rank.proc.join(5.0)

    def close(self) -> None:
        self.stopping = True
        for rank in self.ranks:
            try:
                rank.status.close()
            except OSError:
                pass
