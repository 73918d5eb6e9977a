"""Where the time of the norm + shrink in one launch by segments (triton_ops/norm_segment_pack.py) goes.

    PYTHONPATH=$PWD/python python benchmark/lora/probe_norm_segment_pack.py [--out f.md]
    PYTHONPATH=$PWD/python python benchmark/lora/probe_norm_segment_pack.py --cpu-dry-run   # interpreter

GPU µs per launch under CUDA-graph replay, a folded qkv_proj / gate_up_proj of rank 16 with 9 slots,
for a prefill of one request (one adapter) and decode batches (rows on 8 adapters in turn):
`norm` rmsnorm_fwd into x_aug with the residual, `pack` shrink_pack in place, `norm+pack` both (the
default at prefill), `rowwise` the decode default norm_shrink_pack, `fused` the kernel, `seg only` /
`rows only` its grid cut to the segment / row programs, `w4` at 4 warps, `s3` num_stages 3 (1 by default), `splitN`
with K in N pieces.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from sglang.srt.layers.triton_ops.rmsnorm import rmsnorm_fwd  # noqa: E402
from sglang.srt.lora.fold import fold_extra_columns  # noqa: E402
from sglang.srt.lora.segments import segment_capacity  # noqa: E402
from sglang.srt.lora.triton_ops import norm_segment_pack as nsp  # noqa: E402
from sglang.srt.lora.triton_ops.launch import BoundKernel  # noqa: E402
from sglang.srt.lora.triton_ops.norm_shrink_pack import norm_shrink_pack  # noqa: E402
from sglang.srt.lora.triton_ops.token_lora import plan_pack, prepare_pack, token_segments, with_split  # noqa: E402

MODELS = {"qwen3-4b": {"qkv": (2560, 3), "gate_up": (2560, 2)}, "llama-3.1-8b": {"qkv": (4096, 3)}}
TINY = {"qkv": (64, 3)}
BLOCK_S, R, SLOTS = 16, 16, 9


def variant_launch(plan, rows, cap, x, a, xaug_stride, warps=None, stages=None, seg_only=False, rows_only=False):
    base = nsp.prepare_norm_pack(plan, rows, cap, 1e-6, True, x, a, xaug_stride)
    b = base.bound
    options = dict(b.options)
    if warps:
        options["num_warps"] = warps
    if stages:
        options["num_stages"] = stages
    bound = BoundKernel(b.kernel, b.constexprs, **options)
    seg_programs = plan.grid(cap)[0]
    ints = list(base.ints)
    grid = base.grid
    if seg_only:
        grid = (seg_programs,)
    if rows_only:
        ints[-1] = 0  # seg_programs = 0: every program is a row program
        grid = (rows,)
    return bound.prepare(grid, tuple(ints))


def case(K, c, rows, adapters, dtype, device, timed):
    gen = torch.Generator(device=device).manual_seed(rows + K)
    E = fold_extra_columns(SLOTS - 1, c, R)
    a = (torch.randn(SLOTS, c * R, K, generator=gen, device=device) * 0.02).to(dtype)
    ranks = torch.tensor([R] * 8 + [0], dtype=torch.int32, device=device)
    scalings = torch.tensor([0.5 + 0.1 * i for i in range(8)] + [0.0], device=device)
    row_slots = torch.tensor([(t % adapters) if adapters > 1 else 0 for t in range(rows)], dtype=torch.int32,
                             device=device)
    perm, indptr, wi, n = token_segments(row_slots, ranks, BLOCK_S)
    cap = segment_capacity(rows, BLOCK_S, SLOTS)
    indptr = torch.cat([indptr, indptr[-1:].expand(cap - n)])
    wi = torch.cat([wi, torch.full((cap - n,), SLOTS - 1, dtype=torch.int32, device=device)])
    x = torch.randn(rows, K, generator=gen, device=device).to(dtype)
    res = torch.randn(rows, K, generator=gen, device=device).to(dtype)
    res2, r_out = res.clone(), torch.empty_like(res)
    norm_w = (1 + 0.1 * torch.randn(K, generator=gen, device=device)).to(dtype)
    x_aug = torch.zeros(rows, K + E, dtype=dtype, device=device)
    plan = plan_pack(K, c, R, E, x.element_size(), BLOCK_S)
    ws = torch.empty(max(1, nsp.workspace_numel(dataclasses.replace(plan, shrink=with_split(plan.shrink, 32)), rows)),
                     device=device)
    ctr = torch.zeros(max(1, plan.shrink.num_counters(cap)), dtype=torch.int32, device=device)
    pack = prepare_pack(plan, rows, cap, x_aug[:, :K], a, x_aug.stride(0), copy_x=False)
    run = {
        "norm": lambda: rmsnorm_fwd(x, norm_w, 1e-6, residual=res2, out=x_aug[:, :K]),
        "pack": lambda: pack(x_aug[:, :K], a, x_aug, ws, ctr, perm, indptr, wi, ranks, scalings),
    }
    run["norm+pack"] = lambda: (run["norm"](), run["pack"]())
    run["rowwise"] = lambda: norm_shrink_pack(x, res, norm_w, 1e-6, a, x_aug, row_slots, ranks, scalings, c, R,
                                              residual_out=r_out)
    variants = {"fused": {}, "seg only": dict(seg_only=True), "rows only": dict(rows_only=True), "w4": dict(warps=4),
                "s3": dict(stages=3), "w4 s3": dict(warps=4, stages=3)}
    launches = {}
    for name, kw in variants.items():
        launch = launches[name] = variant_launch(plan, rows, cap, x, a, x_aug.stride(0), **kw)
        run[name] = (lambda l=launch: nsp.launch_norm_pack(l, x, res, r_out, norm_w, a, x_aug, ws, ctr, perm, indptr,
                                                           wi, ranks, scalings))
    for split in (2, 4):
        p = dataclasses.replace(plan, shrink=with_split(plan.shrink, split))
        launch = variant_launch(p, rows, cap, x, a, x_aug.stride(0))
        run[f"split{split}"] = (lambda l=launch: nsp.launch_norm_pack(l, x, res, r_out, norm_w, a, x_aug, ws, ctr,
                                                                      perm, indptr, wi, ranks, scalings))
    # err: the fused kernel's x_aug against norm + pack's (float32 in the dry run: rounding only).
    run["norm+pack"]()
    ref = x_aug.clone()
    res2.copy_(res)
    x_aug.zero_()
    run["fused"]()
    err = ((x_aug.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    for f in run.values():
        f()
    if timed and rows == 128 and c == 3:
        for name, launch in launches.items():
            for k in launch.bound._compiled.values():
                print(f"{name}: registers {k.n_regs}, spills {k.n_spills}, shared {k.metadata.shared} B", flush=True)
    if not timed:
        return list(run) + ["err"], ["-"] * len(run) + [f"{err:.1e}"]
    return list(run) + ["err"], [f"{gpu_time_us(f):.1f}" for f in run.values()] + [f"{err:.1e}"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--cpu-dry-run", action="store_true")
    args = p.parse_args()
    dry = args.cpu_dry_run
    device, dtype = ("cpu", torch.float32) if dry else ("cuda", torch.bfloat16)
    models = {"tiny": TINY} if dry else MODELS
    shapes = [(40, 1), (20, 8)] if dry else [(128, 1), (512, 1), (32, 8), (64, 8)]
    lines, header = [], None
    if not dry:
        lines.append(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    for model, mods in models.items():
        for mod, (K, c) in mods.items():
            for rows, adapters in shapes:
                names, cells = case(K, c, rows, adapters, dtype, device, timed=not dry)
                if header is None:
                    header = names
                    lines += ["", "| model | module | rows x adapters | " + " | ".join(names) + " |",
                              "|---|---|---|" + "---:|" * len(names)]
                lines.append(f"| {model} | {mod} | {rows} x {adapters} | " + " | ".join(cells) + " |")
                print(lines[-1], flush=True)
    emit_table(lines, args.out)


if __name__ == "__main__":
    main()
