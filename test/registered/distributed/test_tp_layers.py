"""Tensor-parallel collectives and sharded layers on 2 real gloo ranks (CPU), against the unsharded
layers in float32 within 1e-5 (DESIGN §11). One spawn of the ranks runs every check
(tp_layer_checks.all_checks); the tests below read its results."""

from __future__ import annotations


import pytest


import tp_layer_checks as checks
from tp_testlib import run_on_ranks

TOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("tp-ckpt")
    paths = {}
    for kv in (1, 2):
        paths[kv] = str(folder / f"kv{kv}.safetensors")
        checks.write_checkpoint(paths[kv], kv)
    return run_on_ranks(checks.all_checks, paths, world_size=2)


def test_collectives(results) -> None:
    r0, r1 = (r["collectives"] for r in results)
    for r in (r0, r1):
        assert r["all_reduce"] == [[3.0] * 3] * 2 and r["in_place"]
        assert r["gather_last"] == [[0, 1, 2, 10, 11, 12], [3, 4, 5, 13, 14, 15]]
        assert r["gather_first"] == [[0, 1, 2], [3, 4, 5], [10, 11, 12], [13, 14, 15]]
        assert r["broadcast"] == [1.0] * 4
        assert r["broadcast_object"] == {"from": 0, "msgs": [1, "a"]}
        assert r["all_gather_object"] == [("rank", 0), ("rank", 1)]
        assert r["min"] == 99


@pytest.mark.parametrize("kv", [2, 1])
def test_column_parallel_layers_hold_their_slice(results, kv) -> None:
    for rank, res in enumerate(results):
        layers = res[f"layers_kv{kv}"]
        assert layers["qkv"] < TOL and layers["column"] < TOL, (rank, layers)
        # 4 query heads over 2 ranks; 2 KV heads split, 1 KV head replicated on both ranks.
        assert layers["qkv_sizes"] == ((2, 1, 1) if kv == 2 else (2, 1, 2))
        assert layers["qkv_fused_load_equal"] and layers["gate_up_fused_load_equal"]
        assert layers["qkv_partition"] and layers["gate_up_partition"] and layers["down_partition"]


@pytest.mark.parametrize("kv", [2, 1])
def test_row_parallel_all_reduce_and_its_lora_seam(results, kv) -> None:
    for res in results:
        layers = res[f"layers_kv{kv}"]
        assert layers["o_proj"] < TOL and layers["mlp"] < TOL, layers
        # A delta added to forward_partial's output before reduce() counts once, like at tp 1.
        assert layers["row_lora_seam"] < TOL and layers["row_partial_sum"] < TOL, layers


def test_vocab_parallel_embedding_and_gathered_lm_head(results) -> None:
    digests = set()
    for res in results:
        layers = res["layers_kv2"]
        assert layers["embedding"] < TOL and layers["lm_head"] < TOL, layers
        assert layers["vocab_padded"] == (12, 6, True)  # 11 rows padded to 12; rank 1's pad row is 0
        digests.add(layers["lm_head_digest"])
    assert len(digests) == 1, "every rank must sample from the same logits"


def test_dummy_weights_are_slices_of_the_tp1_dummy_model(results) -> None:
    for res in results:
        assert res["dummy"]["diff"] < TOL, res["dummy"]
        assert res["dummy"]["seed_matters"] > 1e-2, res["dummy"]


@pytest.mark.parametrize("kv", [2, 1])
def test_loader_reads_only_each_ranks_slice(results, kv) -> None:
    for rank, res in enumerate(results):
        lazy = res[f"lazy_kv{kv}"]
        assert all(lazy["equal"].values()), (rank, lazy)
        assert lazy["read"] == lazy["shard_numel"] < lazy["full_numel"], lazy
