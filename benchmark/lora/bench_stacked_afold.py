"""Should qkv_proj and gate_up_proj take the A-fold? A module's LoRA as the engine runs it (the B fold)
against the A-fold's shape of it, kernels only, before anything is built on it.

    PYTHONPATH=$PWD/python python benchmark/lora/bench_stacked_afold.py [--out f.md]
    PYTHONPATH=$PWD/python python benchmark/lora/bench_stacked_afold.py --cpu-dry-run   # interpreter, tiny

Today a folded qkv_proj / gate_up_proj (8 slots of rank 16) runs, per layer:
  - prefill: the norm writes x into x_aug, `shrink_pack` adds the packed shrink, one GEMM over
    W_aug = [W | B of every slot] (K + E columns);
  - decode: `norm_shrink_pack` writes both, then the same GEMM.
The A-fold (lora/fold.py; o_proj and down_proj take it) would run the plain norm, one GEMM over
[W; A of every slot] (N + S*c*R rows: the base output and every slot's shrink), then the segmented
expand of each row's own slot into the base output (a strided view), B read in place inside W_aug.
That trades shrink_pack's launch (5-6 µs at 128 rows, H100) and W_aug's S*c*R*N extra bytes for the
expand's launch and its read-modify-write of the output (4*T*N bytes): a wide gate_up_proj may lose.

GPU µs per layer under CUDA-graph replay of LAYERS layers, each its own weights (so they come from
HBM, as in a real step): `fold` the B fold as above, `afold` the A-fold, `mm` the base GEMM alone
(the floor both add to); rows on 8 adapters in turn (one 128-token request, 4 x 128, 512, and 64
decode rows), Qwen3-4B and Llama-3.1-8B shapes. `err` is the worst |afold - fold| over the worst
|fold| (bf16 rounding of the shrink: ~1e-2).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "python"))
sys.path.insert(0, str(HERE.parent))  # benchmark/: bench_util
if "--cpu-dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench_util import add_output_args, emit_table, graph_us  # noqa: E402
from sglang.srt.layers.triton_ops.rmsnorm import rmsnorm_fwd  # noqa: E402
from sglang.srt.lora.fold import fold_extra_columns, fold_weight, folded_b  # noqa: E402
from sglang.srt.lora.segments import build_segments, int32_tensor, segment_capacity  # noqa: E402
from sglang.srt.lora.triton_ops.chunked_sgmv_expand import chunked_sgmv_lora_expand_forward  # noqa: E402
from sglang.srt.lora.triton_ops.norm_shrink_pack import norm_shrink_pack  # noqa: E402
from sglang.srt.lora.triton_ops.token_lora import plan_pack, prepare_pack  # noqa: E402
from sglang.srt.lora.utils import LoRABatchInfo  # noqa: E402

# (K, output slice widths) of qkv_proj and gate_up_proj.
MODELS = {"qwen3-4b": {"qkv_proj": (2560, (4096, 1024, 1024)), "gate_up_proj": (2560, (9728, 9728))},
          "llama-3.1-8b": {"qkv_proj": (4096, (4096, 1024, 1024)), "gate_up_proj": (4096, (14336, 14336))}}
TINY = {"qkv_proj": (64, (64, 32, 32)), "gate_up_proj": (64, (96, 96))}
CHUNK = 16  # csgmv's --max-lora-chunk-size default
RANK, ADAPTERS = 16, 8
SLOTS = ADAPTERS + 1  # and the base model's, last
LAYERS = 8
# (name, request lengths, decode): prefills of one and several requests, a decode batch.
BATCHES = (("prefill 128", [128], False), ("prefill 4x128", [128] * 4, False), ("prefill 512", [512], False),
           ("decode 64", [1] * 64, True))
TINY_BATCHES = (("prefill 20", [20], False), ("decode 6", [1] * 6, True))


def batch_info(lens: list[int], device: str) -> tuple[LoRABatchInfo, torch.Tensor]:
    """The graph-capacity segments of requests on the adapters in turn, and each row's slot."""
    req_slots = [i % ADAPTERS for i in range(len(lens))]
    ranks = [RANK] * ADAPTERS + [0]
    rows = sum(lens)
    segs = build_segments(req_slots, lens, ranks, CHUNK, rows, idle_slot=SLOTS - 1)
    cap = segment_capacity(rows, CHUNK, SLOTS)
    pad = cap - segs.num_segments
    info = LoRABatchInfo(
        rows, torch.tensor(ranks, dtype=torch.int32, device=device),
        torch.tensor([0.5 + 0.1 * i for i in range(ADAPTERS)] + [0.0], device=device), use_cuda_graph=True,
        bs=cap, num_segments=segs.num_segments, max_len=CHUNK,
        seg_indptr=int32_tensor(segs.seg_indptr + [segs.seg_indptr[-1]] * pad).to(device),
        weight_indices=int32_tensor(segs.weight_indices + [SLOTS - 1] * pad).to(device),
        permutation=segs.permutation.to(device),
    )
    row_slots = torch.tensor([s for s, n in zip(req_slots, lens) for _ in range(n)], dtype=torch.int32, device=device)
    return info, row_slots


class Layer:
    """One layer's weights in both layouts: W_aug with A's rows past N in the same buffer."""

    def __init__(self, K: int, widths: tuple[int, ...], gen: torch.Generator, device: str, dtype) -> None:
        c, N = len(widths), sum(widths)
        self.K, self.N, self.c = K, N, c
        self.E = fold_extra_columns(ADAPTERS, c, RANK)
        w = (torch.randn(N, K, generator=gen, device=device) * K ** -0.5).to(dtype)
        self.w_aug, b = fold_weight(w, widths, ADAPTERS, RANK, self.E, a_rows=SLOTS * c * RANK)
        stride = self.w_aug.stride(0)
        self.a = self.w_aug.as_strided((SLOTS, c * RANK, K), (c * RANK * stride, stride, 1),
                                       self.w_aug.storage_offset() + N * stride)
        self.w_a = self.w_aug.as_strided((N + ADAPTERS * c * RANK, K), (stride, 1), self.w_aug.storage_offset())
        for s in range(ADAPTERS):
            self.a[s].copy_((torch.randn(c * RANK, K, generator=gen, device=device) * K ** -0.5).to(dtype))
            b[s].copy_((torch.randn(N, RANK, generator=gen, device=device) * 0.1).to(dtype))
        self.b_view, self.slice_stride = folded_b(self.w_aug, K, c, RANK, ADAPTERS)
        self.norm_w = torch.ones(K, device=device, dtype=dtype)


def case(model: str, module: str, K: int, widths: tuple[int, ...], name: str, lens: list[int], decode: bool,
         device: str, dtype, timed: bool) -> str:
    gen = torch.Generator(device=device).manual_seed(K + len(lens))
    layers = [Layer(K, widths, gen, device, dtype) for _ in range(LAYERS if timed else 1)]
    L0 = layers[0]
    info, row_slots = batch_info(lens, device)
    rows, c, N, E = info.num_rows, L0.c, L0.N, L0.E
    x = torch.randn(rows, K, generator=gen, device=device).to(dtype)
    x_aug = torch.empty(rows, K + E, device=device, dtype=dtype)
    normed = torch.empty(rows, K, device=device, dtype=dtype)
    out_fold = torch.empty(rows, N, device=device, dtype=dtype)
    out_afold = torch.empty(rows, N + ADAPTERS * c * RANK, device=device, dtype=dtype)
    ranks = info.lora_ranks
    offsets = None
    if len(set(widths)) > 1:  # qkv under GQA: unequal slices
        bounds = [0]
        for wd in widths:
            bounds.append(bounds[-1] + wd)
        offsets = torch.tensor(bounds, dtype=torch.int32, device=device)
    cap = info.bs
    plan = plan_pack(K, c, RANK, E, x_aug.element_size(), CHUNK)
    ws = torch.empty(max(1, plan.shrink.workspace_numel(rows)), device=device)
    ctr = torch.zeros(max(1, plan.shrink.num_counters(cap)), dtype=torch.int32, device=device)
    pack = prepare_pack(plan, rows, cap, x_aug[:, :K], L0.a, x_aug.stride(0), copy_x=False)

    def fold(i: int) -> None:
        layer = layers[i % len(layers)]
        if decode:
            norm_shrink_pack(x, None, layer.norm_w, 1e-6, layer.a, x_aug, row_slots, ranks, info.scalings, c, RANK)
        else:
            rmsnorm_fwd(x, layer.norm_w, 1e-6, out=x_aug[:, :K])
            pack(x_aug[:, :K], layer.a, x_aug, ws, ctr, info.permutation, info.seg_indptr, info.weight_indices,
                 ranks, info.scalings)
        torch.mm(x_aug, layer.w_aug.t(), out=out_fold)

    def afold(i: int) -> None:
        layer = layers[i % len(layers)]
        rmsnorm_fwd(x, layer.norm_w, 1e-6, out=normed)
        torch.mm(normed, layer.w_a.t(), out=out_afold)
        chunked_sgmv_lora_expand_forward(
            out_afold[:, N:], layer.b_view, info, out_afold[:, :N], num_slices=c, slice_offsets=offsets,
            max_slice_size=max(widths) if offsets is not None else None, slice_stride=layer.slice_stride,
            x_slot_stride=c * RANK)

    def base(i: int) -> None:
        layer = layers[i % len(layers)]
        F.linear(normed, layer.w_aug[:, :K])

    fold(0)
    afold(0)
    ref = out_fold.float()
    err = (out_afold[:, :N].float() - ref).abs().max().item() / (ref.abs().max().item() or 1.0)
    cells = [f"{graph_us(f, calls=len(layers)):.1f}" for f in (fold, afold, base)] if timed else ["-"] * 3
    return f"| {model} | {module} | {name} | {rows} | " + " | ".join(cells) + f" | {err:.1e} |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_args(p)
    args = p.parse_args()
    dry = args.cpu_dry_run
    device, dtype = ("cpu", torch.float32) if dry else ("cuda", torch.bfloat16)
    models = {"tiny": TINY} if dry else MODELS
    lines = [] if dry else [f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"]
    lines += ["", f"{ADAPTERS} adapters of rank {RANK} (pool of {SLOTS} slots), µs per layer "
              f"({LAYERS} layers in one graph)", "",
              "| model | module | batch | rows | fold µs | afold µs | base GEMM µs | err |",
              "|---|---|---|---:|---:|---:|---:|---:|"]
    for model, mods in models.items():
        for module, (K, widths) in mods.items():
            for name, lens, decode in (TINY_BATCHES if dry else BATCHES):
                lines.append(case(model, module, K, widths, name, lens, decode, device, dtype, timed=not dry))
                print(lines[-1], flush=True)
    emit_table(lines, args.out)


if __name__ == "__main__":
    main()
