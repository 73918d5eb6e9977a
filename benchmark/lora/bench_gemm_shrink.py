"""shrink_pack against the GEMM shrink (triton_ops/gemm_shrink.py) of a folded module, in place.

    PYTHONPATH=$PWD/python python benchmark/lora/bench_gemm_shrink.py [--out f.md]
    PYTHONPATH=$PWD/python python benchmark/lora/bench_gemm_shrink.py --cpu-dry-run   # tiny, interpreter

x already in x_aug's first K columns (SGLANG_LORA_PACK_IN_PLACE, the default), both write x_aug's E
columns. GPU µs per launch under CUDA-graph replay (a graph of 10 launches), on a graph bucket's
grid (the segment capacity), for prefill batches of requests of up to 512 tokens on 8 adapters in
turn (pool: the adapter slots, then the base model's). `gemm` = torch.mm over every slot's A plus
the pack kernel, `mm` the GEMM alone; `err` = the worst |gemm - shrink_pack| over the worst |value|
of x_aug's E columns (bf16 rounding: ~1e-2). The module shapes of Qwen3-4B and Llama-3.1-8B at
rank 16 (9 and 17 slots) and rank 64 (9 slots).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "python"))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
if "--cpu-dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

from bench_lora_kernels import gpu_time_us  # noqa: E402
from bench_util import emit_table  # noqa: E402
from sglang.srt.lora.fold import fold_extra_columns  # noqa: E402
from sglang.srt.lora.segments import segment_capacity  # noqa: E402
from sglang.srt.lora.triton_ops.gemm_shrink import gemm_shrink_pack, gemm_shrink_width  # noqa: E402
from sglang.srt.lora.triton_ops.token_lora import plan_pack, prepare_pack, token_segments  # noqa: E402

# (K, c) of the modules that take shrink_pack in place at prefill: qkv_proj, gate_up_proj, down_proj.
MODELS = {"qwen3-4b": {"qkv": (2560, 3), "gate_up": (2560, 2), "down": (9728, 1)},
          "llama-3.1-8b": {"qkv": (4096, 3), "gate_up": (4096, 2), "down": (14336, 1)}}
TINY = {"qkv": (64, 3), "gate_up": (64, 2), "down": (96, 1)}
BLOCK_S = 16  # csgmv's segment rows (--max-lora-chunk-size)


def case(K: int, c: int, R: int, slots: int, rows: int, dtype, device: str, timed: bool) -> list[str]:
    gen = torch.Generator(device=device).manual_seed(rows + K)
    fold_slots = slots - 1
    E = fold_extra_columns(fold_slots, c, R)
    adapters = min(8, fold_slots)
    a = (torch.randn(slots, c * R, K, generator=gen, device=device) * 0.02).to(dtype)
    ranks = torch.tensor([R] * adapters + [0] * (slots - adapters), dtype=torch.int32, device=device)
    scalings = torch.tensor([0.5 + 0.1 * i for i in range(adapters)] + [0.0] * (slots - adapters), device=device)
    per = min(rows, 512)
    row_slots = [(t // per) % adapters for t in range(rows)]
    perm, indptr, wi, n = token_segments(torch.tensor(row_slots, dtype=torch.int32, device=device), ranks, BLOCK_S)
    cap = segment_capacity(rows, BLOCK_S, slots)
    indptr = torch.cat([indptr, indptr[-1:].expand(cap - n)])
    wi = torch.cat([wi, torch.full((cap - n,), slots - 1, dtype=torch.int32, device=device)])
    x_aug = torch.randn(rows, K + E, generator=gen, device=device).to(dtype)
    ref = x_aug.clone()
    plan = plan_pack(K, c, R, E, x_aug.element_size(), BLOCK_S)
    ws = torch.empty(max(1, plan.shrink.workspace_numel(rows)), device=device)
    ctr = torch.zeros(max(1, plan.shrink.num_counters(cap)), dtype=torch.int32, device=device)
    pack = prepare_pack(plan, rows, cap, ref[:, :K], a, ref.stride(0), copy_x=False)
    run_pack = lambda: pack(ref[:, :K], a, ref, ws, ctr, perm, indptr, wi, ranks, scalings)  # noqa: E731
    y = torch.empty(rows, gemm_shrink_width(fold_slots, c, R), dtype=dtype, device=device)
    run_gemm = lambda: gemm_shrink_pack(x_aug, K, a, y, perm, indptr, wi, ranks, scalings, c, R,  # noqa: E731
                                        fold_slots, cap, BLOCK_S)
    a_all = a[:fold_slots].reshape(-1, K)
    run_mm = lambda: torch.mm(x_aug[:, :K], a_all.t(), out=y)  # noqa: E731
    run_pack()
    run_gemm()
    scale = ref[:, K:].abs().max().item() or 1.0
    err = (ref[:, K:].float() - x_aug[:, K:].float()).abs().max().item() / scale
    times = [f"{gpu_time_us(f):.1f}" for f in (run_pack, run_gemm, run_mm)] if timed else ["-"] * 3
    return [str(R), str(slots), str(rows), str(gemm_shrink_width(fold_slots, c, R)), *times, f"{err:.1e}"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096, 8192])
    p.add_argument("--out", default=None)
    p.add_argument("--cpu-dry-run", action="store_true")
    args = p.parse_args()
    dry = args.cpu_dry_run
    device, dtype = ("cpu", torch.float32) if dry else ("cuda", torch.bfloat16)
    models = {"tiny": TINY} if dry else MODELS
    rows_list = [20, 70] if dry else args.rows
    setups = [(16, 9), (16, 17), (64, 9)] if not dry else [(16, 9)]
    lines = []
    if not dry:
        lines.append(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    lines += ["", "| model | module | R | slots | rows | y cols | shrink_pack µs | gemm µs | mm µs | err |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for model, mods in models.items():
        for mod, (K, c) in mods.items():
            for R, slots in setups:
                for rows in rows_list:
                    cells = case(K, c, R, slots, rows, dtype, device, timed=not dry)
                    lines.append(f"| {model} | {mod} | " + " | ".join(cells) + " |")
                    print(lines[-1], flush=True)
    emit_table(lines, args.out)


if __name__ == "__main__":
    main()
