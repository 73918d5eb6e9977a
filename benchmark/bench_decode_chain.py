"""A decode layer's kernel chain at batch <= 8: what programmatic dependent launch (PDL) and an L2
prefetch of the weights before the dependency wait buy, against cuBLAS (issue 21).

    PYTHONPATH=$PWD/python python benchmark/bench_decode_chain.py [--models qwen3-4b llama-3.1-8b] [--bs 1 8]
    PYTHONPATH=$PWD/python python benchmark/bench_decode_chain.py --cpu-dry-run   # tiny shapes, interpreter

bench_gemv.py measured one decode GEMM at a time: cuBLAS and a Triton GEMV reach only 35-60% of
HBM bandwidth on the Qwen3-4B matrices, because a 15-50 MB GEMM is over before it has filled the
machine. In a decode step the GEMMs alternate with one-row kernels (RMSNorm, attention, SiLU),
and every boundary drains the GPU. Here one graph replays `--layers` layers of the chain

    norm -> qkv GEMM -> norm (attention's stand-in) -> o GEMM -> norm -> gate_up GEMM -> SiLU -> down GEMM

with distinct weights per layer (no L2 reuse across layers), in these variants:

  cublas          F.linear and the small kernels launched plainly (the engine today)
  cublas+pdl      the small kernels launched as programmatic dependents (early trigger, wait)
  gemv            a Triton GEMV on the tensor cores (bench_gemv.py's) in place of cuBLAS, no PDL
  fma             a Triton GEMV on the CUDA cores (register tiles, no shared memory), no PDL
  best            per matrix whichever of cuBLAS, gemv and fma is fastest alone (a per-shape
                  dispatch's upper bound), no PDL
  gemv+pdl        every kernel a programmatic dependent of the one before
  gemv+pdl+pfN    and the GEMV prefetches the first N columns of its rows into L2 before it
                  waits (the weights do not depend on the previous kernel); N from `--prefetch-k`

Each GEMV kernel takes, per matrix and batch, its fastest configuration measured alone.
H200, 2026-12-02 (benchmark/RESULTS.md): PDL and the prefetch lose (1.08-1.37x the cublas
chain), and neither GEMV beats cuBLAS by more than 3% in the chain.

Columns: µs per layer, % of the HBM floor (weight bytes / 4.8 TB/s), ratio to `cublas`, and the
max |gemv - cuBLAS| of the last layer's output relative to its scale.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if "--cpu-dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench_gemv import HBM_BYTES_PER_S, _gemv_kernel, gdc_launch_dependents, gdc_wait, gemv_tile  # noqa: E402
from bench_util import add_output_args, emit_table, graph_us, model_dims, target  # noqa: E402



@triton.jit
def _gemv_fma_kernel(X, W, Y, B, N, K, stride_x, stride_w, stride_y,
                     BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The same product on the CUDA cores: each program streams BLOCK_N rows of W in
    [BLOCK_N, BLOCK_K] register tiles (no shared memory, no tensor-core layout), every row's
    products reduced over K per tile in float32."""
    offs_b, offs_n, offs_k, b_mask, n_mask = gemv_tile(B, N, BLOCK_B, BLOCK_N, BLOCK_K)
    x_ptrs = X + offs_b[:, None] * stride_x + offs_k[None, :]
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :]
    acc = tl.zeros((BLOCK_B, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0, eviction_policy="evict_first")
        x = tl.load(x_ptrs, mask=b_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :], axis=2)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    tl.store(Y + offs_b[:, None] * stride_y + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=b_mask[:, None] & n_mask[None, :])


@triton.jit
def _row_kernel(X, Y, N_IN, N_OUT, stride_x, stride_y, BLOCK: tl.constexpr, SILU: tl.constexpr, PDL: tl.constexpr):
    """A one-row kernel: RMS-normalise (SILU: silu(gate) * up of X = [gate | up]) one row."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N_OUT
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    if SILU:
        g = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(X + row * stride_x + N_OUT + offs, mask=mask, other=0.0).to(tl.float32)
        y = g / (1 + tl.exp(-g)) * u
    else:
        x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        y = x * tl.math.rsqrt(tl.sum(x * x, axis=0) / N_OUT + 1e-6)
    tl.store(Y + row * stride_y + offs, y.to(Y.dtype.element_ty), mask=mask)


def row_op(x: torch.Tensor, out: torch.Tensor, silu: bool, pdl: bool) -> None:
    n_out = out.shape[1]
    kwargs = {"launch_pdl": True} if pdl else {}
    _row_kernel[(x.shape[0],)](x, out, x.shape[1], n_out, x.stride(0), out.stride(0),
                               BLOCK=triton.next_power_of_2(n_out), SILU=silu, PDL=pdl,
                               num_warps=4 if n_out >= 1024 else 2, **kwargs)


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, cfg: tuple, pdl: bool, prefetch_k: int) -> None:
    block_n, block_k, warps, stages = cfg[:4]
    if len(cfg) > 4:  # an FMA configuration
        b, k = x.shape
        n = w.shape[0]
        _gemv_fma_kernel[(triton.cdiv(n, block_n),)](x, w, out, b, n, k, x.stride(0), w.stride(0), out.stride(0),
                                                      BLOCK_B=triton.next_power_of_2(b), BLOCK_N=block_n,
                                                      BLOCK_K=block_k, num_warps=warps, num_stages=stages)
        return
    b, k = x.shape
    n = w.shape[0]
    kwargs = {"launch_pdl": True} if pdl else {}
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, w, out, b, n, k, x.stride(0), w.stride(0), out.stride(0),
                                              BLOCK_B=16, BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl,
                                              PREFETCH_K=prefetch_k, num_warps=warps, num_stages=stages, **kwargs)


# (BLOCK_N, BLOCK_K, warps, stages), searched per matrix on its own (weights cycled past L2).
CONFIGS = [(16, 256, 4, 3), (16, 512, 4, 3), (32, 256, 4, 3), (32, 256, 4, 4), (32, 512, 4, 3), (64, 256, 4, 3)]
# (BLOCK_N, BLOCK_K, warps, stages, "fma"): the CUDA-core kernel's candidates (register tiles of
# BLOCK_B x BLOCK_N x BLOCK_K products).
FMA_CONFIGS = [(2, 4096, 4, 1, "fma"), (4, 2048, 4, 1, "fma"), (4, 4096, 8, 1, "fma"), (8, 1024, 4, 2, "fma"),
               (8, 512, 4, 3, "fma"), (16, 512, 8, 2, "fma"), (4, 1024, 4, 3, "fma"), (2, 2048, 4, 2, "fma"),
               (1, 4096, 4, 1, "fma"), (4, 512, 4, 4, "fma")]
VARIANTS = ("cublas", "cublas+pdl", "gemv", "fma", "best", "gemv+pdl")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["qwen3-4b", "llama-3.1-8b"])
    p.add_argument("--bs", nargs="+", type=int, default=[1, 8])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prefetch-k", type=int, nargs="*", default=[])
    add_output_args(p)
    args = p.parse_args()
    dry, device, dtype, models = target(args)
    can_pdl = not dry and gdc_wait is not None and torch.cuda.get_device_capability()[0] >= 9
    variants = [v for v in VARIANTS + tuple(f"gemv+pdl+pf{n}" for n in args.prefetch_k)
                if can_pdl or "pdl" not in v]
    lines = [f"A decode layer's chain ({'CPU dry run' if dry else torch.cuda.get_device_name(0)}), "
             f"{args.layers} layers of distinct weights in one graph, µs per layer", ""]
    lines += ["| model | bs | variant | µs per layer | % HBM floor | / cublas | max rel diff |",
              "|---|---:|---|---:|---:|---:|---:|"]
    gen = torch.Generator().manual_seed(0)
    picks: list[str] = []
    for shape in models:
        h, q, kv, inter, _, _ = model_dims(shape)
        mats = {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * inter, h), "down": (h, inter)}
        layers = 1 if dry else args.layers
        ws = [{m: (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(device) for m, (n, k) in mats.items()}
              for _ in range(layers)]
        layer_bytes = sum(n * k * 2 for n, k in mats.values())
        for bs in args.bs if not dry else [1, 3]:
            # Each matrix's best configuration of either kernel at this batch, measured alone, and
            # which of cuBLAS and the two kernels is fastest alone (the `best` variant's pick).
            best, best_fma, choice = {}, {}, {}
            for m, (n, k) in mats.items():
                x = torch.randn(bs, k, generator=gen).to(dtype).to(device)
                out = torch.empty(bs, n, dtype=dtype, device=device)
                alone = {"cublas": (float("nan") if dry else
                                    graph_us(lambda i: torch.matmul(x, ws[i][m].t(), out=out), layers, 5, 30), None)}
                for name, table, configs in (("gemv", best, CONFIGS), ("fma", best_fma, FMA_CONFIGS)):
                    if dry:
                        table[m] = configs[0]
                        alone[name] = (float("nan"), configs[0])
                        continue
                    timed = []
                    for cfg in configs:
                        try:
                            timed.append((graph_us(lambda i, c=cfg: gemv(x, ws[i][m], out, c, False, 0), layers, 5, 30),
                                          cfg))
                        except Exception as e:  # a config the GPU cannot hold
                            print(f"  {m} {cfg}: {type(e).__name__}", file=sys.stderr)
                    table[m] = min(timed)[1]
                    alone[name] = min(timed)
                    print(f"{shape} bs {bs} {m}: " + ", ".join(f"{c[:4]} {us:.1f}" for us, c in sorted(timed)[:4]),
                          flush=True)
                # A dry run has no timings: it takes each kernel in turn, so every dispatch is checked.
                pick = list(alone)[len(choice) % 3] if dry else min(alone, key=lambda name: alone[name][0])
                choice[m] = (pick, alone[pick][1])
                picks.append(f"{shape} bs {bs} {m}: " + ", ".join(f"{name} {us:.1f}" for name, (us, _) in alone.items())
                             + f" µs alone -> {pick}")
            hidden = torch.randn(bs, h, generator=gen).to(dtype).to(device)
            buf = {"n1": torch.empty(bs, h, dtype=dtype, device=device),
                   "qkv": torch.empty(bs, q + 2 * kv, dtype=dtype, device=device),
                   "att": torch.empty(bs, q, dtype=dtype, device=device),
                   "o": torch.empty(bs, h, dtype=dtype, device=device),
                   "n2": torch.empty(bs, h, dtype=dtype, device=device),
                   "gu": torch.empty(bs, 2 * inter, dtype=dtype, device=device),
                   "act": torch.empty(bs, inter, dtype=dtype, device=device),
                   "down": torch.empty(bs, h, dtype=dtype, device=device)}

            def layer(i: int, variant: str) -> None:
                w = ws[i % layers]
                pdl = "pdl" in variant
                pf = int(variant.split("+pf")[1]) if "+pf" in variant else 0  # columns prefetched

                def mm(x, m, out):
                    kind, cfg = choice[m] if variant == "best" else (variant, None)
                    if kind.startswith("cublas"):
                        torch.matmul(x, w[m].t(), out=out)
                    elif kind == "fma":
                        gemv(x, w[m], out, best_fma[m], False, 0)
                    elif kind == "gemv" and cfg is not None:
                        gemv(x, w[m], out, cfg, False, 0)
                    else:
                        n, k = mats[m]
                        gemv(x, w[m], out, best[m], pdl, min(triton.next_power_of_2(k), pf))

                row_op(hidden if i == 0 else buf["down"], buf["n1"], False, pdl)
                mm(buf["n1"], "qkv", buf["qkv"])
                row_op(buf["qkv"], buf["att"], False, pdl)  # attention's stand-in: one row kernel
                mm(buf["att"], "o", buf["o"])
                row_op(buf["o"], buf["n2"], False, pdl)
                mm(buf["n2"], "gate_up", buf["gu"])
                row_op(buf["gu"], buf["act"], True, pdl)
                mm(buf["act"], "down", buf["down"])

            results = {}
            for variant in variants:
                layer(0, variant)
                if variant == "cublas":
                    ref = buf["down"].float().clone()
                diff = float((buf["down"].float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                us = float("nan") if dry else graph_us(lambda i, v=variant: layer(i, v), layers, 5, 50)
                results[variant] = us
                floor_us = layer_bytes / HBM_BYTES_PER_S * 1e6
                lines.append(f"| {shape} | {bs} | {variant} | {us:.1f} | {100 * floor_us / us:.0f}% | "
                             f"{us / results['cublas']:.2f} | {diff:.1e} |")
                print(lines[-1], flush=True)
        del ws
    lines += ["", "Each matrix alone (weights cycled past L2), the fastest configuration of each kernel:", "",
              *[f"- {line}" for line in picks]]
    emit_table(lines, args.out)


if __name__ == "__main__":
    main()
