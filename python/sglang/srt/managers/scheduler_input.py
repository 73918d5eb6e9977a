"""The scheduler's receive step under tensor parallelism.

Rank 0 alone reads the pipe from the tokenizer manager, then broadcasts what it read (possibly
nothing) to the other ranks, so every rank handles the same messages in the same order at the same
loop turn and therefore makes the same scheduling decisions. The other ranks have no pipe and wait
in the broadcast, which is why rank 0 broadcasts on every turn, an empty list included.
"""

from __future__ import annotations

from typing import Any, Optional

from sglang.srt.distributed import TensorParallelGroup


def receive_messages(recv_conn: Optional[Any], tp_group: TensorParallelGroup, timeout: float,
                     local: Optional[list[Any]] = None) -> list[Any]:
    """Every pending message (rank 0 waits up to `timeout` for the first one), on every rank.
    `local`: rank 0's own messages, put before the pipe's (what it decided alone, such as which
    grammar compiles are done, reaches every rank at the same turn)."""
    messages: list[Any] = list(local or ())
    if recv_conn is not None:
        if messages:
            timeout = 0.0  # something to do already
        while recv_conn.poll(timeout):
            timeout = 0.0
            messages.append(recv_conn.recv())
    if tp_group.size > 1:
        messages = tp_group.broadcast_object(messages if tp_group.is_first_rank else None, src=0)
    return messages
