"""Tensor parallelism on two GPUs over NCCL (skipped with fewer): the sharded layers' all-reduces
captured inside CUDA graphs, whole (decode / full prefill) and breakable, replay bit for bit like
eager on every rank, and the tp-2 body tracks the tp-1 body in bf16. NVLink multicast stays off."""

from __future__ import annotations


import pytest
import torch


import tp_graph_checks
from tp_testlib import run_on_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


@pytest.fixture(scope="module")
def results() -> list[dict]:
    from sglang.srt.distributed import disable_nvlink_multicast

    disable_nvlink_multicast()  # inherited by the spawned ranks
    return run_on_ranks(tp_graph_checks.graphs_vs_eager, world_size=2, backend="nccl", timeout=600)


def test_all_reduce_inside_cuda_graphs_replays_like_eager(results) -> None:
    for rank, res in enumerate(results):
        assert res["whole"] == [True] * 3, (rank, res)
        assert res["breakable"] == [True] * 3 and res["segments"] == 2, (rank, res)
    assert results[0]["digest"] == results[1]["digest"]


def test_tp2_tracks_tp1_in_bf16(results) -> None:
    for res in results:
        assert max(res["tp_vs_tp1"]) < 0.05, res["tp_vs_tp1"]  # bf16 over 2 layers, activations O(1)
        assert res["logits_shape"] == [tp_graph_checks.TOKENS, tp_graph_checks.VOCAB]
