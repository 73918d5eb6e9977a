"""The entry point of a scheduler process: one per tensor-parallel rank (DESIGN §2, §11).

Start-up: NVLink multicast off, join the TP group, build the Scheduler (and its ModelRunner, this
rank's shard of the model), then report on `status_conn`: `SchedulerReady` with this rank's facts,
or `SchedulerFailed` with the reason. A rank that crashes later reports `SchedulerFailed` with the
traceback before it exits, so the parent can name the cause. Rank 0's status pipe is also the pipe
that carries its replies; the other ranks have no request pipe (rank 0 broadcasts the messages).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Optional

from sglang.srt.distributed import (
    NVLINK_MULTICAST_OFF,
    RankSpec,
    disable_nvlink_multicast,
    init_tensor_parallel,
)
from sglang.srt.managers.io_struct import SchedulerFailed, SchedulerReady
from sglang.srt.configs.run_configs import SchedulerConfig
from sglang.srt.utils import configure_logger

logger = logging.getLogger(__name__)

# Test hooks (with --enable-test-hooks only): the TP rank named here fails during start-up; every
# rank stalls this many seconds during start-up (a long weight load, to interrupt).
FAIL_AT_START_TEST_ENV = "SGLANG_TEST_TP_FAIL_AT_START"
STALL_AT_START_TEST_ENV = "SGLANG_TEST_STALL_AT_START_S"


def _watch_parent(parent_pid: int) -> None:
    """Exit when the parent process is gone, so the child never outlives it (even after a
    SIGKILL of the parent, when nothing else would tell us)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(0.5)


# How long a SIGTERM'd scheduler keeps serving before it exits on its own. A SIGTERM to the whole
# process group (systemd's stop, `kill -TERM -PGID`) reaches the scheduler together with the server,
# which gives the requests in flight a grace period and then sends every rank a ShutdownReq: the
# scheduler must keep running meanwhile. Sent to the scheduler alone, it still stops, after this.
# (The parent's own last resort, SchedulerRanks.terminate, is a SIGKILL.)
SIGTERM_EXIT_AFTER_S = 10.0


class _DeferredSigterm:
    """The SIGTERM handler. The first signal arms a timer thread, which signals the main thread
    again once SIGTERM_EXIT_AFTER_S has passed; that delivery leaves the event loop by SystemExit
    (its `finally` blocks and the interpreter's clean-up run), with the status of a SIGTERM death's
    shell convention, 143."""

    def __init__(self, tp_size: int) -> None:
        self.tp_size = tp_size
        self.armed = False
        self.expired = False

    def __call__(self, signum: int, frame: Any) -> None:
        if self.expired:
            logger.warning("SIGTERM %.0f s ago and no shutdown from the server: exiting.", SIGTERM_EXIT_AFTER_S)
            if self.tp_size > 1:  # as on a crash: never tear down a group whose peers may wait for us
                logging.shutdown()
                os._exit(128 + signal.SIGTERM)
            raise SystemExit(128 + signal.SIGTERM)
        if not self.armed:
            self.armed = True
            main = threading.main_thread().ident
            threading.Thread(target=self._expire, args=(main,), name="sigterm-timer", daemon=True).start()

    def _expire(self, main_ident: int) -> None:
        time.sleep(SIGTERM_EXIT_AFTER_S)
        self.expired = True
        signal.pthread_kill(main_ident, signal.SIGTERM)  # also interrupts a blocking wait


def _watch_progress(scheduler: Any, timeout: float, status_conn: Any) -> None:
    """--watchdog-timeout: a rank whose event-loop turn has run `timeout` seconds is hung (a
    collective whose peer stopped, a kernel that never returns): report the stack it is stuck in
    as a crash and exit, so the parent stops the server instead of leaving it unanswering (a gloo
    or NCCL collective waits 30 minutes or more by default)."""
    main_ident = threading.main_thread().ident
    while True:
        time.sleep(min(5.0, timeout / 4))
        stuck_for = time.monotonic() - scheduler.heartbeat
        if stuck_for < timeout:
            continue
        frame = sys._current_frames().get(main_ident)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no stack)\n"
        error = (f"Stack of the hung scheduler:\n{stack}"
                 f"the scheduler's turn made no progress for {stuck_for:.0f} s (--watchdog-timeout {timeout:g}): "
                 "hung in a forward or a collective")
        logger.error("%s", error)
        try:
            status_conn.send(SchedulerFailed(error=error, failed_at=time.time()))
        except (OSError, ValueError):
            pass
        logging.shutdown()
        os._exit(1)


def _start_rank(config: SchedulerConfig, rank: RankSpec, recv_conn: Any, status_conn: Any) -> Any:
    # Here, in the rank process, not at the top: the main process imports this module for the
    # spawn target only and never needs the model code (torch, Triton, the models) behind these.
    import torch

    from sglang.srt.managers.scheduler import Scheduler

    if config.enable_test_hooks and os.environ.get(FAIL_AT_START_TEST_ENV) == str(rank.tp_rank):
        raise RuntimeError(f"injected start-up failure of TP rank {rank.tp_rank} ({FAIL_AT_START_TEST_ENV})")
    if config.enable_test_hooks and os.environ.get(STALL_AT_START_TEST_ENV):
        logger.info("Start-up stalls for %s s (%s)", os.environ[STALL_AT_START_TEST_ENV], STALL_AT_START_TEST_ENV)
        time.sleep(float(os.environ[STALL_AT_START_TEST_ENV]))
    if rank.backend == "gloo" and rank.tp_size > 1:
        # The ranks of one CPU share its cores: without this each would start a thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // rank.tp_size))
    tp_group = init_tensor_parallel(rank)
    reply_conn = status_conn if rank.tp_rank == 0 else None
    return Scheduler(config, recv_conn, reply_conn, tp_group=tp_group, gpu_id=rank.local_rank)


def run_scheduler_process(
    config: SchedulerConfig,
    recv_conn: Optional[Any],
    status_conn: Any,
    parent_pid: int,
    rank: RankSpec,
) -> None:
    disable_nvlink_multicast()
    # Ctrl-C reaches the whole process group; the parent decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _DeferredSigterm(rank.tp_size))
    # tqdm's default lock (its progress bars: weights, adapters, capture) is a multiprocessing
    # semaphore, which the resource tracker reports as leaked after a rank's os._exit. Our bars
    # never cross processes: a thread lock is enough.
    import tqdm

    tqdm.tqdm.set_lock(threading.RLock())
    configure_logger(config.log_level, prefix=" Scheduler" + (f" TP{rank.tp_rank}" if rank.tp_size > 1 else ""))
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watchdog", daemon=True).start()
    try:
        scheduler = _start_rank(config, rank, recv_conn, status_conn)
    except ValueError as e:
        # A configuration the user can fix (e.g. a bad --lora-paths adapter): the message is the
        # whole story, a traceback would only bury it.
        logger.error("Scheduler start-up failed: %s", e)
        logger.debug("%s", traceback.format_exc())
        status_conn.send(SchedulerFailed(error=str(e), user_error=True))
        return
    except Exception:
        logger.error("Scheduler start-up failed:\n%s", traceback.format_exc())
        status_conn.send(SchedulerFailed(error=traceback.format_exc()))
        return
    facts = {"tp_rank": rank.tp_rank, "pid": os.getpid(), "device": str(scheduler.model_runner.device),
             "env": {k: os.environ.get(k) for k in NVLINK_MULTICAST_OFF}}
    status_conn.send(SchedulerReady(info={**scheduler.ready_info(), "rank": facts}))
    if rank.tp_rank != 0 and config.log_level != "debug":
        # Every rank makes the same decisions: one copy of the batch logs (rank 0's) is enough.
        logging.getLogger().setLevel(logging.WARNING)
    if config.watchdog_timeout > 0:
        threading.Thread(target=_watch_progress, args=(scheduler, config.watchdog_timeout, status_conn),
                         name="progress-watchdog", daemon=True).start()
    try:
        scheduler.event_loop()
    except (EOFError, OSError, BrokenPipeError):
        return  # the parent closed the pipes: it is gone or shutting down
    except Exception:
        logger.error("Scheduler crashed:\n%s", traceback.format_exc())
        try:
            status_conn.send(SchedulerFailed(error=traceback.format_exc(), failed_at=time.time()))
        except (OSError, ValueError):
            pass
        if rank.tp_size > 1:
            # Exit now: the interpreter's shutdown would tear down a process group whose peers
            # may be stuck in a collective with us, and could block. The parent sees the exit,
            # names this rank and stops the others.
            logging.shutdown()
            os._exit(1)
        raise
    # A clean shutdown (every rank got the same ShutdownReq). The ranks of a group leave without
    # tearing it down: they exit in no fixed order, and a gloo group whose store (hosted by rank 0)
    # is already gone can abort in its C++ teardown ("terminate called without an active
    # exception", SIGABRT), which made a rank of a cleanly stopped group look failed.
    if rank.tp_size > 1:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(0)
