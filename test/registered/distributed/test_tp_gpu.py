"""The real model with LoRA under tensor parallelism on two GPUs over NCCL (skipped with fewer), bf16:
tp 2 tracks tp 1 (the PEFT parity test's bf16 rule), and CUDA graphs (breakable and full prefill,
breakable and full decode, all-reduces captured inside) equal eager under tp 2 with LoRA. One spawn
of the two ranks runs everything (tp_gpu_checks.gpu_checks). NVLink multicast stays off."""

from __future__ import annotations


import pytest
import torch


import tp_gpu_checks as checks
from tp_testlib import run_on_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

GRAPH_VS_EAGER_TOL = 1e-2
LORA_EFFECT = 5e-2


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    from helpers import hf_model, tiny_checkpoint
    from lora_testlib import write_peft_adapter

    from sglang.srt.distributed import disable_nvlink_multicast

    root = tmp_path_factory.mktemp("tp-gpu")
    ckpt = tiny_checkpoint("qwen3", hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    paths = {
        "a": write_peft_adapter(str(root / "a"), r=16, base_model=hf_model(ckpt), seed=21, b_std=0.2),
        "b": write_peft_adapter(str(root / "b"), r=8, target_modules=["q_proj", "v_proj"], base_model=hf_model(ckpt),
                                seed=22, b_std=0.2),
    }
    disable_nvlink_multicast()  # inherited by the spawned ranks
    return run_on_ranks(checks.gpu_checks, ckpt, paths, world_size=2, backend="nccl", timeout=600)


def errors(got: list[list[float]], ref: list[list[float]]) -> list[torch.Tensor]:
    return [(torch.tensor(g, dtype=torch.float64) - torch.tensor(r, dtype=torch.float64)).abs()
            for g, r in zip(got, ref)]


def test_bf16_tp2_tracks_tp1(results) -> None:
    for rank, res in enumerate(results):
        ours, yardstick = errors(res["tp2_bf16"], res["ref32"]), errors(res["tp1_bf16"], res["ref32"])
        for i, (e2, e1) in enumerate(zip(ours, yardstick)):
            print(f"rank {rank} request {i} ({checks.NAMES[i]}): tp2 max {e2.max():.4f} mean {e2.mean():.4f}; "
                  f"tp1 bf16 max {e1.max():.4f} mean {e1.mean():.4f}")
            assert e2.max() <= 2 * e1.max() + 0.05, (rank, i, float(e2.max()), float(e1.max()))
            assert e2.mean() <= 2 * e1.mean() + 0.02, (rank, i, float(e2.mean()), float(e1.mean()))
        # Requests 0 and 1 share a prompt, base and adapter: the adapter still matters in bf16.
        effect = errors([res["tp2_bf16"][0]], [res["tp2_bf16"][1]])[0]
        assert effect.max() > LORA_EFFECT, float(effect.max())
    assert results[0]["tp2_bf16"] == results[1]["tp2_bf16"]  # the same gathered logits on every rank


@pytest.mark.parametrize("config", [f"{b}/{p}/{d}/fold-{f}" for b, p, d, f in checks.GRAPH_CONFIGS])
def test_tp2_graphs_equal_eager_with_lora(results, config) -> None:
    for rank, res in enumerate(results):
        got = res[config]
        graph_prompt, replayed = got["graph_prompt"]
        assert replayed, f"rank {rank}: the mixed prefill did not replay a graph"
        worst = max(float(e.max()) for e in errors(graph_prompt, got["eager_prompt"]))
        assert worst < GRAPH_VS_EAGER_TOL, (rank, config, worst)
        tokens, used = got["graph_greedy"]
        assert all(used), f"rank {rank}: decode steps ran eagerly: {used}"
        assert tokens == got["eager_greedy"], (rank, config)
        assert got["graph_stats"]["decode_graph_replays"] >= checks.DECODE_STEPS
        assert bool(got["folded"]) == config.endswith("fold-auto"), got["folded"]
    assert results[0][config]["graph_greedy"] == results[1][config]["graph_greedy"]
