"""What each rank runs in test_tp_parity.py: the real models and LoRA under tensor parallelism.

One spawn of two gloo ranks runs everything (process start-ups are the slow part on a CPU):
  - `tp1_references`: each rank computes the tp-1 results of half the architectures (a size-1
    group, the torch_native LoRA backend: the reference);
  - `scenario` per (architecture, LoRA backend) with a tp-2 ModelRunner holding this rank's shard
    of the model and of every adapter: prompt logprobs of a mixed batch of adapters and base, one
    decode step, then (torch_native cases: the adapter bookkeeping is the same for every backend,
    and the interpreted Triton kernels are slow) an adapter loaded at run time through the
    scheduler's agreement path, a load that fails on one rank only (it must fail on both and leave
    nothing loaded), and an unload;
  - `graph_decisions`: the graph runners planned as on a GPU (not captured), with a different KV
    capacity on each rank, and the graph-or-eager decision of a range of batches.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from sglang.srt.distributed import SINGLE_RANK, TensorParallelGroup
from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.lora.lora_registry import make_lora_ref
from sglang.srt.managers.io_struct import LoadLoRAAdapterReq, UnloadLoRAAdapterReq
from sglang.srt.managers.scheduler_lora import update_adapters
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.server_args import ServerArgs
from sglang.srt.server_configs import build_run_configs

# (architecture, LoRA backend) cases of the tp-2 runs: every backend on Llama, every architecture.
CASES = [("llama", "torch_native"), ("llama", "triton"), ("llama", "csgmv"), ("qwen3", "csgmv+norms-apart"),
         ("mistral", "torch_native"), ("qwen2", "torch_native"), ("qwen3", "torch_native")]
# The Triton backends' two layouts: csgmv folds every module into its base GEMM (the default,
# --lora-fold auto, at these sizes), triton keeps separate shrink and expand kernels. With the
# default --lora-fuse-norm auto the decode step's norms before the LoRA modules compute their shrink
# (csgmv folded, triton unfolded); csgmv+norms-apart runs them apart (off).
FOLD = {"csgmv": "on", "triton": "off", "torch_native": "off", "csgmv+norms-apart": "on"}
FUSED_NORMS = {"csgmv", "triton"}  # cases whose norms fuse: 2 per layer, and the SiLU-and-mul before down_proj
# Case name -> (LoRA backend, other runner arguments).
BACKENDS = {"csgmv+norms-apart": ("csgmv", {"lora_fuse_norm": "off"})}
ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


def make_runner(ckpt: str, backend: str, paths: dict[str, str], group: TensorParallelGroup,
                **overrides: Any) -> ModelRunner:
    args = dict(model_path=ckpt, device="cpu", dtype="float32", attention_backend="torch_native",
                max_total_tokens=1024, max_running_requests=16, random_seed=0, tp_size=group.size,
                lora_backend=backend, lora_paths=[f"a={paths['a']}", f"b={paths['b']}"], max_loras_per_batch=4,
                max_lora_rank=8, lora_target_modules=["all"])
    args.update(overrides)
    # Each rank's device is the one init_tensor_parallel made current (cuda:<local rank>).
    gpu_id = torch.cuda.current_device() if args["device"] == "cuda" else 0
    return ModelRunner(build_run_configs(ServerArgs(**args)).scheduler.runner, gpu_id=gpu_id, tp_group=group)


def _logprobs(driver: Any, prompts: list[list[int]], loras: list[Optional[str]]) -> dict[str, Any]:
    """Prompt logprobs of one mixed prefill, then the logprobs and tokens of one decode step."""
    seqs = [driver.add(p, lora_id=lid) for p, lid in zip(prompts, loras)]
    try:
        out = driver.extend(seqs, logprob_start=0)
        result = {"prompt": out.input_token_logprobs, "first_ids": out.next_token_ids.tolist()}
        for seq, token in zip(seqs, result["first_ids"]):
            seq.tokens.append(token)
        step = driver.decode(seqs, return_logprob=True)
        result["decode"] = step.next_token_logprobs
        result["decode_ids"] = step.next_token_ids.tolist()
        return result
    finally:
        for seq in seqs:
            driver.release(seq)


def scenario(mr: ModelRunner, prompts: list[list[int]], paths: dict[str, str],
             group: TensorParallelGroup, adapter_updates: bool = True) -> dict[str, Any]:
    from helpers import EngineDriver

    lora = mr.lora_manager
    ids = {ref.lora_name: lid for lid, ref in lora.refs.items()}
    driver = EngineDriver(mr)
    got: dict[str, Any] = {"mixed": _logprobs(driver, [prompts[0], prompts[0], prompts[1], prompts[2]],
                                              [None, ids["a"], ids["b"], ids["a"]])}
    got["pool_shapes"] = {m: [tuple(lora.pool.A_buffer[m][0].shape), tuple(lora.pool.B_buffer[m][0].shape)]
                          for m in lora.pool.target_modules}
    got["folded"] = list(lora.pool.fold_modules)
    fused = [type(m) for m in mr.model.modules() if getattr(m, "fusion", None) is not None]
    got["fused_norms"] = sum(t is RMSNorm for t in fused)
    got["fused_acts"] = sum(t is SiluAndMul for t in fused)  # down_proj's row-wise shrink (small decode batches)
    got["num_layers"] = mr.model_config.num_hidden_layers
    if not adapter_updates:
        got["slots"] = [repr(lora_id) for lora_id in lora.pool.slot_to_lora_id]
        return got
    c = make_lora_ref(f"c={paths['c']}")
    assert update_adapters(lora, LoadLoRAAdapterReq(c), group).success
    got["with_c"] = _logprobs(driver, prompts[:3], [c.lora_id, None, ids["a"]])
    if group.size > 1:
        # A load that fails on rank 1 only (its copy of the adapter is unreadable): no rank keeps it.
        path = paths["c"] if group.rank == 0 else paths["broken"]
        out = update_adapters(lora, LoadLoRAAdapterReq(make_lora_ref(f"d={path}")), group)
        got["one_rank_failure"] = {"success": out.success, "error": out.error_message,
                                   "loaded": sorted(lora.loaded_adapters())}
    assert update_adapters(lora, UnloadLoRAAdapterReq(make_lora_ref(f"a={paths['a']}")), group).success
    got["after_unload"] = _logprobs(driver, prompts[:2], [ids["b"], c.lora_id])
    got["slots"] = [repr(lora_id) for lora_id in lora.pool.slot_to_lora_id]
    return got


def tp1_references(group: TensorParallelGroup, ckpts: dict[str, str], prompts: list[list[int]],
                   adapters: dict[str, dict[str, str]]) -> dict[str, Any]:
    """This rank's half of the architectures at tp 1 (no collectives: the ranks work side by side)."""
    mine = ARCHS[group.rank::group.size]
    return {arch: scenario(make_runner(ckpts[arch], "torch_native", adapters[arch], SINGLE_RANK), prompts,
                           adapters[arch], SINGLE_RANK)
            for arch in mine}


def graph_decisions(group: TensorParallelGroup, ckpt: str, paths: dict[str, str]) -> dict[str, Any]:
    """Plan the graph sets like a GPU start-up (no capture) with a different KV capacity on each
    rank, then decide the path of a range of batches."""
    from sglang.srt.model_executor.batch_builder import DecodeRequest, ExtendRequest, build_decode_batch, \
        build_extend_batch
    from sglang.srt.configs.cuda_graph_config import Backend
    from sglang.srt.model_executor.runner.graph_sets import agree_on_graph_plans, plan_graph_sets

    # As if rank 1's GPU had less memory left: 200 KV tokens (100 requests) instead of 1024.
    mr = make_runner(ckpt, "triton", paths, group, max_total_tokens=1024 if group.rank == 0 else 200,
                     max_running_requests=None)
    runners = plan_graph_sets(mr, Backend.BREAKABLE, Backend.BREAKABLE, lora_kernels=True)
    plans = agree_on_graph_plans(group, runners)
    a = next(iter(mr.lora_manager.refs))
    rows = mr.req_to_token_pool.size - 1

    def decode(bs: int, lora: Optional[str]):
        reqs = [DecodeRequest(i % rows, 5, 3, 1, lora_id=lora if i == 0 else None) for i in range(bs)]
        return build_decode_batch(reqs, mr.req_to_token_pool, mr.device, enable_lora=True)

    def extend(lens: list[int], lora: Optional[str]):
        reqs = [ExtendRequest(i % rows, [7] * n, 0, [1] * n, lora_id=lora if i == 0 else None)
                for i, n in enumerate(lens)]
        return build_extend_batch(reqs, mr.req_to_token_pool, mr.device, enable_lora=True)

    batches = [decode(1, None), decode(1, a), decode(100, a), decode(101, a), decode(101, None),
               extend([5], a), extend([5], None), extend([60, 70], a), extend([2] * 40, a), extend([2] * 40, None),
               extend([1100, 1100], a), extend([1100, 1100], None)]
    decisions = []
    for fb in batches:
        plan = mr.choose_forward_path(fb)
        decisions.append((plan.path, plan.lora))
    return {"plans": plans, "decisions": decisions, "max_running_requests": mr.max_running_requests}


def mismatched_graph_plans(group: TensorParallelGroup, ckpt: str, paths: dict[str, str]) -> str:
    """Rank 1 configured with other decode buckets: the start-up check must refuse before capture."""
    from sglang.srt.configs.cuda_graph_config import Backend
    from sglang.srt.model_executor.runner.graph_sets import agree_on_graph_plans, plan_graph_sets

    mr = make_runner(ckpt, "triton", paths, group, cuda_graph_bs_decode=[1, 2, 4] if group.rank == 0 else [1, 2, 8])
    runners = plan_graph_sets(mr, Backend.DISABLED, Backend.BREAKABLE, lora_kernels=True)
    try:
        agree_on_graph_plans(group, runners)
    except RuntimeError as e:
        return str(e)
    return "no error"


def all_checks(group: TensorParallelGroup, ckpts: dict[str, str], prompts: list[list[int]],
               adapters: dict[str, dict[str, str]]) -> dict[str, Any]:
    torch.manual_seed(0)
    out: dict[str, Any] = {"tp1": tp1_references(group, ckpts, prompts, adapters), "tp2": {}}
    for arch, backend in CASES:
        name, extra = BACKENDS.get(backend, (backend, {}))
        mr = make_runner(ckpts[arch], name, adapters[arch], group, lora_fold=FOLD[backend], **extra)
        out["tp2"][f"{arch}/{backend}"] = scenario(mr, prompts, adapters[arch], group,
                                                   adapter_updates=backend == "torch_native")
    out["graph_decisions"] = graph_decisions(group, ckpts["llama"], adapters["llama"])
    out["mismatched_graph_plans"] = mismatched_graph_plans(group, ckpts["llama"], adapters["llama"])
    return out
