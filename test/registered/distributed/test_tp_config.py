"""Tensor-parallel configuration, no processes: how a model splits N ways (and why it cannot), the
flags, the rank layout, the lockstep comparison, lazy checkpoint slices, exit descriptions."""

from __future__ import annotations

import signal

import pytest
import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.configs.run_configs import TPLayout
from sglang.srt.configs.tp_split import tp_split
from sglang.srt.distributed import (
    NVLINK_MULTICAST_OFF,
    TensorParallelGroup,
    disable_nvlink_multicast,
    plan_local_ranks,
)
from sglang.srt.managers.integrity import lockstep_problems
from sglang.srt.managers.scheduler_ranks import describe_exit, last_line
from sglang.srt.server_args import ServerArgs
from sglang.srt.server_configs import check_tensor_parallel

BASE = dict(architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=1, num_attention_heads=8,
            num_key_value_heads=2, intermediate_size=96, vocab_size=1001)


def config(**overrides) -> ModelConfig:
    return ModelConfig.from_dict({**BASE, **overrides})


def layout(**flags) -> TPLayout:
    """The TP layout the flags give (ServerArgs validates them) for the BASE model."""
    args = ServerArgs(model_path="unused", device="cpu", **flags)
    return TPLayout(size=args.tp_size, nnodes=args.nnodes, node_rank=args.node_rank, device="cpu",
                    split=tp_split(config(), args.tp_size), dist_init_addr=args.dist_init_addr,
                    dist_timeout=args.dist_timeout)


def test_split_sizes() -> None:
    two = tp_split(config(), 2)
    assert (two.num_heads, two.num_kv_heads, two.num_kv_head_replicas, two.intermediate_size) == (4, 1, 1, 48)
    assert (two.vocab_size_padded, two.vocab_per_rank) == (1002, 501)  # 1001 padded to a multiple of 2
    eight = tp_split(config(), 8)  # 2 KV heads over 8 ranks: each replicated on 4
    assert (eight.num_heads, eight.num_kv_heads, eight.num_kv_head_replicas, eight.intermediate_size) == (1, 1, 4, 12)
    assert tp_split(config(), 1).num_heads == 8


def test_why_a_model_cannot_be_split_is_spelled_out() -> None:
    with pytest.raises(ValueError) as e:
        tp_split(config(intermediate_size=100), 3)
    msg = str(e.value)
    assert "cannot be split across --tp-size 3" in msg
    assert "num_attention_heads (8) is not divisible by 3" in msg
    assert "3 is not a multiple of num_key_value_heads (2)" in msg
    assert "intermediate_size (100) is not divisible by 3" in msg
    assert "Sizes that work for this model: 1, 2, 4." in msg
    with pytest.raises(ValueError, match=r"num_key_value_heads \(6\) is not divisible by 4"):
        tp_split(config(num_attention_heads=12, num_key_value_heads=6), 4)
    with pytest.raises(ValueError, match=r"intermediate_size \(90\) is not divisible by 4"):
        tp_split(config(intermediate_size=90), 4)


def test_check_tensor_parallel_splits_the_model_or_says_why(monkeypatch) -> None:
    from sglang.srt.models.registry import MODEL_REGISTRY

    assert check_tensor_parallel(config(), 1).num_heads == 8  # tp 1: the whole model
    assert check_tensor_parallel(config(), 2).num_heads == 4
    with pytest.raises(ValueError, match="not divisible by 3"):
        check_tensor_parallel(config(), 3)
    # Every served architecture shards; a model class that did not would be refused up front.
    assert all(getattr(cls, "supports_tensor_parallel", False) for cls in MODEL_REGISTRY.values())
    monkeypatch.setattr(MODEL_REGISTRY["LlamaForCausalLM"], "supports_tensor_parallel", False)
    with pytest.raises(ValueError, match="LlamaForCausalLM does not support --tp-size > 1 yet"):
        check_tensor_parallel(config(), 2)


@pytest.mark.parametrize("kwargs, match", [
    (dict(tp_size=0), "--tp-size must be a positive integer"),
    (dict(nnodes=0), "--nnodes must be a positive integer"),
    (dict(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="h:1"), "--node-rank must be in 0..1"),
    (dict(tp_size=3, nnodes=2, dist_init_addr="h:1"), "must be a multiple of --nnodes"),
    (dict(tp_size=2, nnodes=2), "--nnodes > 1 needs --dist-init-addr"),
    (dict(dist_init_addr="nohost"), "--dist-init-addr must be HOST:PORT"),
    (dict(dist_init_addr="h:99999"), "--dist-init-addr must be HOST:PORT"),
    (dict(dist_timeout=0), "--dist-timeout must be a positive integer"),
])
def test_parallel_flags_are_validated(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        ServerArgs(model_path="unused", device="cpu", **kwargs)


def test_cli_flags() -> None:
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(["--tensor-parallel-size", "4", "--nnodes", "2", "--node-rank", "1",
                                "--dist-init-addr", "10.0.0.1:5000", "--dist-timeout", "60"])
    assert (args.tp_size, args.nnodes, args.node_rank, args.dist_init_addr, args.dist_timeout) == \
        (4, 2, 1, "10.0.0.1:5000", 60)


def test_rank_layout() -> None:
    one = plan_local_ranks(layout())
    assert len(one) == 1 and one[0].tp_size == 1 and one[0].init_method is None
    two = plan_local_ranks(layout(tp_size=2))
    assert [(s.tp_rank, s.local_rank, s.backend) for s in two] == [(0, 0, "gloo"), (1, 1, "gloo")]
    assert two[0].init_method == two[1].init_method and two[0].init_method.startswith("tcp://127.0.0.1:")
    # Node 1 of 2 runs ranks 2 and 3 on its GPUs 0 and 1, meeting at node 0's address.
    node1 = plan_local_ranks(layout(tp_size=4, nnodes=2, node_rank=1, dist_init_addr="[::1]:29500",
                                    dist_timeout=30))
    assert [(s.tp_rank, s.local_rank) for s in node1] == [(2, 0), (3, 1)]
    assert node1[0].init_method == "tcp://[::1]:29500" and node1[0].timeout_s == 30.0


def test_nvlink_multicast_is_off_unless_the_user_says_otherwise() -> None:
    env = {"NCCL_NVLS_ENABLE": "1"}
    disable_nvlink_multicast(env)
    assert env == {**NVLINK_MULTICAST_OFF, "NCCL_NVLS_ENABLE": "1"}
    assert NVLINK_MULTICAST_OFF == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                    "NVSHMEM_DISABLE_NVLS": "1"}


def test_lockstep_problems_name_the_rank_and_field() -> None:
    same = {"arrivals": 3, "waiting": ["a"], "lora_slots": ["None", "'x'"]}
    assert lockstep_problems([same, dict(same)]) == []
    problems = lockstep_problems([same, {**same, "waiting": []}, dict(same)])
    assert len(problems) == 1 and problems[0][0] == "tp_lockstep"
    assert "TP rank 1 disagrees with rank 0 on waiting (rank 0: ['a'], rank 1: [])" in problems[0][1]


def test_group_without_processes() -> None:
    layout = TensorParallelGroup.layout_only(1, 2)
    with pytest.raises(RuntimeError, match="cannot run collectives"):
        layout.all_reduce(torch.ones(2))
    with pytest.raises(ValueError, match="tp rank 2 is not in 0..1"):
        TensorParallelGroup(2, 2)
    single = TensorParallelGroup()
    x = torch.ones(2)
    assert single.all_reduce(x) is x and single.all_gather(x) is x and single.broadcast_object(5) == 5


def test_checkpoint_tensor_narrows_lazily(tmp_path) -> None:
    from safetensors.torch import save_file

    from sglang.srt.model_loader.weight_utils import CheckpointTensor, safetensors_weights_iterator

    full = torch.arange(24.0).view(4, 6)
    save_file({"w": full}, str(tmp_path / "m.safetensors"))
    (name, t), = safetensors_weights_iterator([str(tmp_path / "m.safetensors")], progress=False)
    assert isinstance(t, CheckpointTensor) and t.shape == (4, 6) and t.dim() == 2
    part = t.narrow(0, 1, 2).narrow(1, 3, 3).narrow(0, 1, 1)
    assert part.shape == (1, 3) and torch.equal(part.materialize(), full[2:3, 3:6])
    with pytest.raises(ValueError, match="outside shape"):
        t.narrow(1, 4, 3)


def test_exit_descriptions() -> None:
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(3) == "exit code 3"
    assert last_line("Traceback ...\n  File x\nRuntimeError: boom\n\n") == "RuntimeError: boom"
