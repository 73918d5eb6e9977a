"""Decode GEMMs at batch <= 8 against the weight-read floor: cuBLAS against a candidate Triton GEMV.

    PYTHONPATH=$PWD/python python benchmark/bench_gemv.py [--models llama-3.1-8b qwen3-4b] [--bs 1 4 8] [--out f.md]
    PYTHONPATH=$PWD/python python benchmark/bench_gemv.py --cpu-dry-run      # tiny shapes, interpreter

Issue 21 measured the 8B decode GEMMs at batch 1 at 65-85% of HBM bandwidth, and cuBLAS splits K
for o_proj and down_proj, with a separate reduce kernel each. The candidate here is measured
before it is built into layers/: one program per BLOCK_N output rows streams its rows of W over
the whole K (no split, so no reduce kernel and no partial sums), the batch's rows padded to 16
for tl.dot; every row's sums depend on that row alone and on the tiles, so a graph replay and an
eager pass would agree bit for bit.

Every GEMM reads its own copy of W among enough copies to overflow the 50 MB L2 (a model's layers
never hit in L2 either), under CUDA-graph replay. Columns: µs per call, the share of the
4.8 TB/s of HBM that the weight bytes imply, for cuBLAS (`F.linear`) and for the GEMV's best
configuration (BLOCK_N, BLOCK_K, warps, stages); max |gemv - cuBLAS| relative to the output's scale.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

if "--cpu-dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench_util import add_output_args, emit_table, graph_us, model_dims, target  # noqa: E402
from sglang.srt.lora.lora_config import FUSED_MODULES, get_stacked_multiply  # noqa: E402
# Grid dependency control (Hopper PDL), for bench_decode_chain.py's variants; None where triton lacks it.
from sglang.srt.layers.triton_ops.common import gdc_launch_dependents, gdc_wait  # noqa: E402,F401

HBM_BYTES_PER_S = 4.8e12  # H200
L2_BYTES = 50 * 2**20



def gemms(shape: str) -> dict[str, tuple[int, int]]:
    """Module -> (N, K) of its weight."""
    h, q, kv, inter, vocab, _ = model_dims(shape)
    return {"qkv_proj": (q + 2 * kv, h), "o_proj": (h, q), "gate_up_proj": (2 * inter, h), "down_proj": (h, inter),
            "lm_head": (vocab, h)}


@triton.jit
def _prefetch_l2(ptrs):
    # One `prefetch.global.L2` per element (a 128-byte line each); no result is used.
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def gemv_tile(B, N, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A GEMV program's batch rows, its BLOCK_N output rows, the K offsets of a tile, and the
    batch and output masks (shared with bench_decode_chain.py's CUDA-core kernel)."""
    offs_b = tl.arange(0, BLOCK_B)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_b, offs_n, tl.arange(0, BLOCK_K), offs_b < B, offs_n < N


@triton.jit
def _gemv_kernel(X, W, Y, B, N, K, stride_x, stride_w, stride_y,
                 BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                 PREFETCH_K: tl.constexpr):
    offs_b, offs_n, offs_k, b_mask, n_mask = gemv_tile(B, N, BLOCK_B, BLOCK_N, BLOCK_K)
    if PDL:
        gdc_launch_dependents()
    if PREFETCH_K > 0:
        # Lines of 64 bf16 columns; rows past N and columns past K clamp to valid addresses.
        lines = tl.arange(0, PREFETCH_K // 64) * 64
        rows = tl.minimum(offs_n, N - 1).to(tl.int64)
        _prefetch_l2(W + rows[:, None] * stride_w + tl.minimum(lines, K - 1)[None, :])
    if PDL:
        gdc_wait()
    x_ptrs = X + offs_b[:, None] * stride_x + offs_k[None, :]
    w_ptrs = W + offs_n[None, :].to(tl.int64) * stride_w + offs_k[:, None]
    acc = tl.zeros((BLOCK_B, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k
        x = tl.load(x_ptrs, mask=b_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    tl.store(Y + offs_b[:, None] * stride_y + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=b_mask[:, None] & n_mask[None, :])


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, block_n: int, block_k: int, warps: int,
         stages: int) -> torch.Tensor:
    b, k = x.shape
    n = w.shape[0]
    assert b <= 16 and x.stride(1) == 1 and w.stride(1) == 1
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, w, out, b, n, k, x.stride(0), w.stride(0), out.stride(0),
                                              BLOCK_B=16, BLOCK_N=block_n, BLOCK_K=block_k, PDL=False, PREFETCH_K=0,
                                              num_warps=warps, num_stages=stages)
    return out


# (BLOCK_N, BLOCK_K, warps, stages): 16 configurations, ~1 min for both shapes.
CONFIGS = list(itertools.product((16, 32, 64), (256, 512), (4,), (3, 5))) + [
    (32, 256, 8, 4), (64, 256, 8, 4), (128, 128, 8, 4), (16, 1024, 4, 2)]


def fold_case(slices: int, x: torch.Tensor, ws: list[torch.Tensor], n: int, k: int, slots: int, rank: int,
              copies: int):
    """(cuBLAS(i), the engine's one-row GEMV(i), the columns both compute alike) for a module of
    `slices` output slices, folded as the engine folds it, with `slots` adapter slots of `rank` and
    the row's adapter in slot 0, over weight copy i: B-folded (x_aug [bs, K + E] against W_aug
    [N, K + E]; the row's slot block of x_aug holds its shrink, the other slots' are zero) for
    several slices (qkv_proj, gate_up_proj), A-folded ([W; A of every slot], N + slots*rank rows;
    the GEMV leaves the other slots' shrink zero) for one (o_proj, down_proj)."""
    from sglang.srt.lora.fold import fold_extra_columns
    from sglang.srt.lora.triton_ops.fold_gemv import a_fold_gemv, fold_gemv

    bs, dtype, device = x.shape[0], x.dtype, x.device
    slot = torch.zeros(1, dtype=torch.int32, device=device)
    if slices > 1:
        block, extra = slices * rank, fold_extra_columns(slots, slices, rank)
        wa = [torch.cat([w, torch.randn(n, extra, dtype=dtype, device=device) / k**0.5], 1) for w in ws]
        xa = torch.cat([x, torch.zeros(bs, extra, dtype=dtype, device=device)], 1)
        xa[:, k : k + block] = torch.randn(bs, block, dtype=dtype, device=device)
        out = torch.empty(bs, n, dtype=dtype, device=device)
        return (lambda i: torch.matmul(xa, wa[i % copies].t(), out=out),
                lambda i: fold_gemv(xa, wa[i % copies], k, slot, slots, block), n)
    wa = [torch.cat([w, torch.randn(slots * rank, k, dtype=dtype, device=device) / k**0.5], 0) for w in ws]
    out = torch.empty(bs, n + slots * rank, dtype=dtype, device=device)
    return (lambda i: torch.matmul(x, wa[i % copies].t(), out=out),
            lambda i: a_fold_gemv(x, wa[i % copies], n, slot, rank), n + rank)


def fold_times(case, bs: int, copies: int) -> tuple[float, float]:
    """(cuBLAS µs, the engine's one-row GEMV µs, or 0 past one row) of a fold_case."""
    cublas, ours, _ = case
    return graph_us(cublas, copies, 5, 50), (graph_us(ours, copies, 5, 50) if bs == 1 else 0.0)


def check_fold(case, bs: int) -> None:
    """A dry run's check: the one-row GEMV equals cuBLAS on the columns both compute alike."""
    cublas, ours, cols = case
    if bs == 1:
        ref, got = cublas(0), ours(0)
        torch.testing.assert_close(got[:, :cols], ref[:, :cols], rtol=1e-4, atol=1e-4)
        assert not got[:, cols:].any(), "the other slots' shrink must be zero"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["llama-3.1-8b", "qwen3-4b"])
    p.add_argument("--bs", nargs="+", type=int, default=[1, 4, 8])
    p.add_argument("--fold-slots", type=int, default=0,
                   help="also time cuBLAS over a LoRA-folded W_aug [N, K + slots*slices*rank] (lora/fold.py)")
    p.add_argument("--fold-rank", type=int, default=16)
    p.add_argument("--modules", nargs="+", default=None, help="a subset of the modules")
    add_output_args(p)
    args = p.parse_args()
    dry, device, dtype, models = target(args)
    configs = CONFIGS[:1] if dry else CONFIGS
    lines = [f"GEMMs at decode batch sizes ({'CPU dry run' if dry else torch.cuda.get_device_name(0)}), "
             "GPU µs per call under graph replay, weights cycled past L2", ""]
    # With --fold-slots: the module's LoRA-folded GEMM as served at 8 slots, cuBLAS over all of it
    # against the engine's one-row GEMV (lora/triton_ops/fold_gemv.py): qkv_proj / gate_up_proj B-folded
    # (x_aug [1, K + E] @ W_aug^T, fold_gemv), o_proj / down_proj A-folded (x @ [W; A of every slot]^T,
    # a_fold_gemv), the row's adapter in slot 0; and the best GEMV above over W alone against that cuBLAS.
    timed_fold = args.fold_slots and not dry  # a dry run checks the folded paths instead (check_fold)
    fold_head = (" folded: cuBLAS µs | fold_gemv µs | fold_gemv / cuBLAS | GEMV over W / cuBLAS |"
                 if timed_fold else "")
    lines += ["| model | module | N x K | bs | cuBLAS µs | cuBLAS % HBM | GEMV µs | GEMV % HBM | GEMV / cuBLAS | "
              "best config | max rel diff |" + fold_head,
              "|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|"
              + ("---:|---:|---:|---:|" if timed_fold else "")]
    gen = torch.Generator().manual_seed(0)
    for shape in models:
        for module, (n, k) in gemms(shape).items():
            if args.modules and module not in args.modules:
                continue
            nbytes = n * k * 2
            # The LoRA modules' output slices (lm_head takes no LoRA); 0: no folded GEMM to time.
            slices = get_stacked_multiply(module) if args.fold_slots and module in FUSED_MODULES else 0
            copies = 1 if dry else max(2, -(-2 * L2_BYTES // nbytes))
            ws = [(torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(device) for _ in range(copies)]
            for bs in args.bs if not dry else [1, 3]:
                x = torch.randn(bs, k, generator=gen).to(dtype).to(device)
                outs = [torch.empty(bs, n, dtype=dtype, device=device) for _ in range(copies)]
                ref = F.linear(x, ws[0])
                cfg0 = configs[0]
                got = gemv(x, ws[0], outs[0], *cfg0)
                diff = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
                if dry:
                    if slices:
                        check_fold(fold_case(slices, x, ws, n, k, args.fold_slots, args.fold_rank, copies), bs)
                    lines.append(f"| {shape} | {module} | {n} x {k} | {bs} | - | - | - | - | - | {cfg0} | {diff:.1e} |")
                    continue
                cublas = graph_us(lambda i: torch.matmul(x, ws[i % copies].t(), out=outs[i % copies]), copies, 5, 50)
                best = None
                for cfg in configs:
                    try:
                        us = graph_us(lambda i, c=cfg: gemv(x, ws[i % copies], outs[i % copies], *c), copies, 5, 50)
                    except Exception as e:  # a config the GPU cannot hold (shared memory): skip it
                        print(f"  {module} {cfg}: {type(e).__name__}", file=sys.stderr)
                        continue
                    if best is None or us < best[0]:
                        best = (us, cfg)
                us, cfg = best
                got = gemv(x, ws[0], outs[0], *cfg)
                diff = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
                pct = lambda t: 100 * nbytes / (t * 1e-6) / HBM_BYTES_PER_S  # noqa: E731
                fold = ""
                if slices:
                    case = fold_case(slices, x, ws, n, k, args.fold_slots, args.fold_rank, copies)
                    folded, ours = fold_times(case, bs, copies)
                    fold = (f" {folded:.1f} | {ours:.1f} | {ours / folded:.2f} | {us / folded:.2f} |" if ours else
                            f" {folded:.1f} | - | - | {us / folded:.2f} |")
                lines.append(f"| {shape} | {module} | {n} x {k} | {bs} | {cublas:.1f} | {pct(cublas):.0f}% | {us:.1f} | "
                             f"{pct(us):.0f}% | {us / cublas:.2f} | {cfg} | {diff:.1e} |" + fold)
                print(lines[-1], flush=True)
            ws = None  # free the copies before the next module's
    emit_table(lines, args.out)


if __name__ == "__main__":
    main()
