"""Node K > 0 of a multi-node tensor-parallel group (`--nnodes N --node-rank K`).

It serves nothing itself: it runs this node's rank processes, which take their messages from rank
0's broadcasts (node 0 serves HTTP), until rank 0 shuts the group down, a rank fails, or this
process gets SIGINT/SIGTERM. No process outlives it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from multiprocessing.connection import wait

from sglang.srt.distributed import plan_local_ranks
from sglang.srt.managers.scheduler_process import run_scheduler_process
from sglang.srt.managers.scheduler_ranks import SchedulerRanks, describe_exit
from sglang.srt.server_args import ServerArgs
from sglang.srt.server_configs import build_run_configs

logger = logging.getLogger(__name__)


def run_worker_node(server_args: ServerArgs, timeout: float = 600.0) -> None:
    configs = build_run_configs(server_args)
    ranks = SchedulerRanks(configs.scheduler, plan_local_ranks(configs.tp))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    ranks.spawn(run_scheduler_process, None, os.getpid())
    try:
        ranks.wait_ready(timeout)
        names = ", ".join(str(r.spec.tp_rank) for r in ranks.ranks)
        logger.info("Node %d runs TP ranks %s; requests come through node 0.", server_args.node_rank, names)
        while not stop.is_set():
            wait([r.proc.sentinel for r in ranks.ranks], timeout=0.5)
            failed = [r for r in ranks.ranks if r.proc.exitcode not in (None, 0)]
            if failed:
                raise SystemExit(f"The node stopped because {failed[0].label} exited unexpectedly "
                                 f"({describe_exit(failed[0].proc.exitcode)}).")
            if all(r.proc.exitcode == 0 for r in ranks.ranks):
                logger.info("Rank 0 shut the group down; bye.")
                return
    finally:
        ranks.stopping = True
        ranks.terminate()
        ranks.close()
