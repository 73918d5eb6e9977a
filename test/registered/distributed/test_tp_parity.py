"""Tensor parallelism end to end on the CPU: tp 2 (two gloo ranks, each holding its shard of the
model and of every adapter) gives the prompt logprobs of tp 1 within 1e-4 in float32, for a mixed
batch of adapters and base requests, with each LoRA backend and every architecture; adapters
loaded and unloaded at run time act on both ranks, and a load that fails on one rank fails on all;
every rank plans the same CUDA graphs and takes the same graph-or-eager decision for every batch
(issue #13, "Done when").

One spawn of the two ranks runs every check (tp_model_checks.all_checks, the tp-1 references
included); the tests below read its results. The served path (scheduler processes, HTTP, Engine)
is test_tp_server.py's.
"""

from __future__ import annotations


import pytest


import tp_model_checks as checks
from lora_server_testlib import PROMPTS, tiny_lora_checkpoint, write_adapter
from server_helpers import tiny_checkpoint
from tp_testlib import run_on_ranks

TOL = 1e-4


def worst(got: list, want: list) -> float:
    assert len(got) == len(want)
    diffs = []
    for g, w in zip(got, want):
        if isinstance(g, list):
            assert len(g) == len(w) and g, (g, w)
            diffs.extend(abs(a - b) for a, b in zip(g, w))
        else:
            diffs.append(abs(g - w))
    return max(diffs)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("tp-parity")
    ckpts = {arch: tiny_lora_checkpoint(arch) for arch in checks.ARCHS}
    # Llama with a bias on every projection: the row-parallel ones (o_proj, down_proj) must add
    # theirs once, on rank 0, folded or not.
    ckpts["llama"] = tiny_checkpoint("llama", hidden_size=64, intermediate_size=128, attention_bias=True,
                                     mlp_bias=True)
    adapters = {}
    for arch, ckpt in ckpts.items():
        adapters[arch] = {
            "a": write_adapter(ckpt, str(root / arch / "a"), r=8, target_modules="all-linear", seed=71),
            "b": write_adapter(ckpt, str(root / arch / "b"), r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                               seed=72),
            "c": write_adapter(ckpt, str(root / arch / "c"), r=8, target_modules=["o_proj", "gate_proj"], seed=73),
            "broken": str(root / arch / "missing"),  # no adapter here
        }
    return run_on_ranks(checks.all_checks, ckpts, PROMPTS, adapters, world_size=2, timeout=600)


def reference(results: list[dict], arch: str) -> dict:
    return next(r["tp1"][arch] for r in results if arch in r["tp1"])


@pytest.mark.parametrize("arch, backend", checks.CASES)
def test_tp2_logprobs_equal_tp1(results, arch, backend) -> None:
    want = reference(results, arch)
    ranks = [r["tp2"][f"{arch}/{backend}"] for r in results]
    phases = ("mixed", "with_c", "after_unload") if backend == "torch_native" else ("mixed",)
    for phase in phases:
        for rank, got in enumerate(ranks):
            for key in ("prompt", "decode"):
                diff = worst(got[phase][key], want[phase][key])
                assert diff < TOL, f"{arch}/{backend} rank {rank} {phase}/{key}: tp 2 differs from tp 1 by {diff:.2e}"
            assert got[phase]["decode_ids"] == ranks[0][phase]["decode_ids"]  # rank 0's tokens everywhere
            assert got[phase]["prompt"] == ranks[0][phase]["prompt"]  # the same gathered logits everywhere
        assert ranks[0][phase]["first_ids"] == want[phase]["first_ids"]
    # The adapter does move the logprobs (otherwise the comparison above proves little).
    mixed = want["mixed"]["prompt"]
    assert max(abs(a - b) for a, b in zip(mixed[0], mixed[1])) > 1e-2
    # Adapter slots in lockstep; each rank's pool holds its shard (qkv: B rows; o_proj: A columns).
    assert ranks[0]["slots"] == ranks[1]["slots"]
    shapes = ranks[0]["pool_shapes"]
    full = want["pool_shapes"]
    assert shapes["qkv_proj"][0] == full["qkv_proj"][0]  # A whole
    assert shapes["qkv_proj"][1][1] < full["qkv_proj"][1][1]  # B: this rank's output rows
    assert shapes["o_proj"][0][2] * 2 == full["o_proj"][0][2]  # A: half the input columns
    # B whole ([slots, out, rank]; a folded B has no slot for the base model, so compare out and rank)
    assert shapes["o_proj"][1][1:] == full["o_proj"][1][1:]
    # csgmv ran every module folded into its base GEMM ([x_shard | partial shrink] @ [W_shard | B]^T
    # for o_proj / down_proj, before the all-reduce); the others ran separate LoRA kernels.
    folded = checks.FOLD[backend] == "on"
    assert ranks[0]["folded"] == (["down_proj", "gate_up_proj", "o_proj", "qkv_proj"] if folded else [])
    # --lora-fuse-norm auto: both norms of every layer compute their module's shrink at decode,
    # and (SGLANG_LORA_ROWWISE_DECODE=small, the default) the SiLU-and-mul down_proj's, a row-parallel
    # module whose shrink sums this rank's input columns before the all-reduce.
    fuses = backend in checks.FUSED_NORMS
    assert ranks[0]["fused_norms"] == (2 * want["num_layers"] if fuses else 0)
    assert ranks[0]["fused_acts"] == (want["num_layers"] if fuses else 0)


def test_a_load_failing_on_one_rank_fails_on_all(results) -> None:
    for res in results:
        for case, got in res["tp2"].items():
            if not case.endswith("torch_native"):
                continue  # the Triton backends run the mixed batch only
            failure = got["one_rank_failure"]
            assert not failure["success"], case
            assert "(on TP rank 1; the adapter is loaded on no rank)" in failure["error"], failure
            assert "d" not in failure["loaded"] and {"a", "b", "c"} <= set(failure["loaded"]), failure


def test_every_rank_takes_the_same_graph_decisions(results) -> None:
    r0, r1 = (r["graph_decisions"] for r in results)
    # Rank 1 had room for 100 requests, rank 0 for 512: both plan for the smaller.
    assert r0["max_running_requests"] == r1["max_running_requests"] == 100
    assert r0["plans"] == r1["plans"]
    decode_plans = [p for p in r0["plans"] if p["kind"] == "decode"]
    assert decode_plans and all(p["max_bs"] == 100 for p in decode_plans)
    assert r0["decisions"] == r1["decisions"]
    paths = [path for path, _ in r0["decisions"]]
    assert paths[:5] == ["decode_graph"] * 3 + ["eager"] * 2  # 101 requests exceed the decode graphs
    # 2200 tokens: within the LoRA set's buckets (8192), beyond the base set's (2048).
    assert paths[5:] == ["prefill_graph"] * 6 + ["eager"]
    assert [lora for _, lora in r0["decisions"]] == [False, True, True, True, False, True, False, True, True, False, True, False]


def test_ranks_that_planned_different_graphs_refuse_to_capture(results) -> None:
    for res in results:
        msg = res["mismatched_graph_plans"]
        assert msg.startswith("The tensor-parallel ranks planned different CUDA graphs"), msg
        assert "TP rank 1's decode graphs differ: buckets (rank 0: [1, 2, 4], rank 1: [1, 2, 8])" in msg, msg
