"""shrink_pack alone at a graph bucket's grid, Llama-8B modules, by pool size and column tile.

    PYTHONPATH=$PWD/python python benchmark/lora/probe_shrink_pack.py [rows]   # default 128

One request of `rows` tokens on slot 0; the pool's other adapter slots are loaded, the base model's
slot (rank 0) is last, as the pool lays them out, and the grid spans the bucket's segment
capacity (lora/segments.py), as a replay does. Columns: `first` = the kernel as it is (E's zero
stripes written before the K loop), `last` = the same stripes written after it; each with the
plan's column tile (`bndef`) and 32 / 16 wide ones. Every variant's x_aug is checked bit for bit
against the first (tiles must not change any sum) and for NaN poison left unwritten."""
from __future__ import annotations

import dataclasses
import importlib.util
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "python"))
sys.path.insert(0, str(HERE))
import torch  # noqa: E402
import triton  # noqa: E402

from bench_lora_kernels import gpu_time_us  # noqa: E402
from sglang.srt.lora.fold import fold_extra_columns  # noqa: E402
from sglang.srt.lora.segments import segment_capacity  # noqa: E402
from sglang.srt.lora.triton_ops.launch import BoundKernel  # noqa: E402
from sglang.srt.lora.triton_ops.token_lora import pack_block_e, plan_pack, token_segments  # noqa: E402

MODS = {"qkv": (4096, 6144, 3), "o": (4096, 4096, 1), "gate_up": (4096, 28672, 2), "down": (14336, 4096, 1)}
TMP = Path(tempfile.mkdtemp())


def load(name: str, src: str):
    path = TMP / f"{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod._shrink_pack_kernel


def kernels():
    new = (HERE.parents[1] / "python/sglang/srt/lora/triton_ops/shrink_pack.py").read_text()
    start = new.index("    # ---- zeros:")
    end = new.index("    offs_n = tile_n * BLOCK_N")
    zeros = new[start:end]
    last = new.replace(zeros, "").replace("    # ---- values:", zeros + "\n    # ---- values:")
    return {"first": load("first_pack", new), "last": load("last_pack", last)}


def main():
    if not torch.cuda.is_available():
        raise SystemExit("probe_shrink_pack needs a CUDA device")
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    dev, dt = "cuda", torch.bfloat16
    ks = kernels()
    cols = [(k, bn) for bn in (None, 64, 32, 16) for k in ks]
    print(f"# shrink_pack µs at {rows} rows, one request on slot 0, graph bucket grid (capacity)")
    print("| module | R | slots | E | " + " | ".join(f"{k} bn{bn or 'def'}" for k, bn in cols) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(cols))
    for name, (K, N, c) in MODS.items():
        for R in (16, 64):
            for slots in (2, 9, 17):
                E = fold_extra_columns(slots - 1, c, R)
                x_aug = torch.randn(rows, K + E, device=dev, dtype=dt)
                x = x_aug[:, :K].contiguous()
                A = torch.randn(slots, c * R, K, device=dev, dtype=dt) * 0.01
                # Adapter slots first, the base model's (rank 0, no block in E) last, as the pool has them.
                ranks = torch.tensor([R] * (slots - 1) + [0], dtype=torch.int32, device=dev)
                scal = torch.ones(slots, device=dev)
                base_plan = plan_pack(K, c, R, E, 2)
                perm, indptr, wi, nseg = token_segments(torch.zeros(rows, dtype=torch.int32, device=dev), ranks,
                                                        base_plan.shrink.block_s)
                n = segment_capacity(rows, base_plan.shrink.block_s, slots)
                ip = torch.cat([indptr, indptr[-1:].expand(n + 1 - indptr.numel())])
                w_i = torch.cat([wi, torch.full((n - wi.numel(),), slots - 1, dtype=torch.int32, device=dev)])
                res, ref = [], None
                for kname, bn in cols:
                    plan = base_plan
                    if bn is not None:
                        if bn == plan.shrink.block_n:
                            res.append("-")
                            continue
                        plan = dataclasses.replace(plan, shrink=dataclasses.replace(
                            plan.shrink, block_n=bn, n_tiles=triton.cdiv(c * R, bn)))
                    s = plan.shrink
                    bound = BoundKernel(ks[kname], dict(
                        STACK=c, MAX_RANK=R, E_COLS=E, BLOCK_S=s.block_s, BLOCK_N=s.block_n, BLOCK_K=s.block_k,
                        BLOCK_E=pack_block_e(plan), SPLIT=s.split, DOT_PREC="tf32",
                        USE_PDL=False, COPY_X=True), num_warps=4)
                    launch = bound.prepare(s.grid(n), s.ints(rows) + (x.stride(0), A.stride(0), A.stride(1),
                                                                       x_aug.stride(0), s.n_tiles))
                    ws = torch.empty(max(1, s.workspace_numel(rows)), device=dev)
                    ctr = torch.zeros(max(1, s.num_counters(n)), dtype=torch.int32, device=dev)
                    x_aug.fill_(float("nan"))
                    launch(x, A, x_aug, ws, ctr, perm, ip, w_i, ranks, scal)
                    assert not x_aug.isnan().any(), (name, kname, bn)
                    if ref is None:
                        ref = x_aug.clone()
                    elif not torch.equal(ref, x_aug):
                        print(f"  ({name} R{R} {kname} bn{bn} differs: {(ref - x_aug).abs().max().item():.3g})")
                    res.append(f"{gpu_time_us(lambda: launch(x, A, x_aug, ws, ctr, perm, ip, w_i, ranks, scal)):.1f}")
                print(f"| {name} | {R} | {slots} | {E} | " + " | ".join(res) + " |", flush=True)
                del x_aug, A
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
