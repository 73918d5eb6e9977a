"""The unfolded expand's tile plan (csgmv, triton_ops/sgemm_lora_b.py) at the shapes where it costs most.

    PYTHONPATH=$PWD/python python benchmark/lora/bench_expand_tiles.py [--out f.md]
    PYTHONPATH=$PWD/python python benchmark/lora/bench_expand_tiles.py --cpu-dry-run   # interpreter, tiny

A 64-slot server unfolds qkv_proj and gate_up_proj (lora/fold.py), and at a decode batch of 64 requests
on many distinct adapters the expand walks up to 64 one-row segments. With 128-wide column tiles (the
plan before 2026-12-02) each program then reads one 4 KB tile of B: the kernel is bound by its
programs' start-up, not by bytes. This measures plans of (BLOCK_N, warps[, "b-early": B loaded with
the rank and rows]) against each other: GPU µs
per launch of one CUDA graph holding the expand of every layer (each layer its own B, so the weights
come from HBM as in a real step), Qwen3-4B shapes, rank 16, 64 slots, on decode batches of 64 rows on
1, 8, 32 and 64 adapters, on a 8 x 256 prefill on 8 adapters and on one 128-token prefill. Every
plan's output is checked equal, bit for bit, to the default's (the plan must not change a sum).
The decode rows on 1 and 8 adapters run twice more with the segment capacity (the grid's segment
axis) of a 9-slot server: the same live work, fewer empty programs, so the difference is what a
64-slot graph bucket's empty segments cost.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "python"))
sys.path.insert(0, str(HERE.parent))  # benchmark/: bench_util
if "--cpu-dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

from bench_util import add_output_args, emit_table, graph_us  # noqa: E402
from sglang.srt.lora.segments import build_segments, int32_tensor, segment_capacity  # noqa: E402
from sglang.srt.lora.triton_ops.sgemm_lora_b import EXPAND_TILES, segmented_expand  # noqa: E402
from sglang.srt.lora.utils import LoRABatchInfo  # noqa: E402

# (module, slice widths) at the Qwen3-4B shape: q 32 x 128, kv 8 x 128; intermediate 9728.
MODULES = {"qkv_proj": (4096, 1024, 1024), "gate_up_proj": (9728, 9728)}
# The default first (the others are checked against its bits), then the candidates: one segment per
# program (measured on 2026-12-02; several 128-wide tiles per program, and on 2026-12-04 several
# segments per program, lost: see RESULTS.md), and "b-early": B's first rank block loaded with the
# rank and the rows, before the dot's other operands.
CANDIDATES = [(256, 4), (256, 4, "b-early"), (256, 8, "b-early"), (128, 4, "b-early"), (512, 8, "b-early")]
PLANS = [EXPAND_TILES] + [plan for plan in CANDIDATES if plan != EXPAND_TILES]
CHUNK = 16  # csgmv's --max-lora-chunk-size default


def batch_info(req_slots: list[int], req_lens: list[int], num_slots: int, rank: int, device: str
               ) -> tuple[LoRABatchInfo, int]:
    """The static-capacity metadata a graph of this many rows would hold (empty segments past the live ones)."""
    rows = sum(req_lens)
    ranks = [rank] * (num_slots - 1) + [0]  # the last slot: the base model
    segs = build_segments(req_slots, req_lens, ranks, CHUNK, rows, idle_slot=num_slots - 1)
    cap = segment_capacity(rows, CHUNK, num_slots)
    pad = cap - segs.num_segments
    indptr = segs.seg_indptr + [segs.seg_indptr[-1]] * pad
    slots = segs.weight_indices + [num_slots - 1] * pad
    info = LoRABatchInfo(
        rows, torch.tensor(ranks, dtype=torch.int32, device=device),
        torch.full((num_slots,), 2.0, dtype=torch.float32, device=device), use_cuda_graph=True, bs=cap,
        num_segments=segs.num_segments, max_len=CHUNK, seg_indptr=int32_tensor(indptr).to(device),
        weight_indices=int32_tensor(slots).to(device), permutation=segs.permutation.to(device),
    )
    return info, rows


def run_case(widths: tuple[int, ...], info: LoRABatchInfo, rows: int, layers: int, num_slots: int, rank: int,
             plans: list, device: str, dtype: torch.dtype) -> dict:
    out_dim = sum(widths)
    g = torch.Generator(device="cpu").manual_seed(0)
    bs = [(torch.randn(num_slots, out_dim, rank, generator=g) * 0.05).to(device, dtype) for _ in range(layers)]
    xa = (torch.randn(rows, len(widths) * rank, generator=g)).to(device, dtype)
    base = (torch.randn(rows, out_dim, generator=g)).to(device, dtype)
    offsets = None
    if len(set(widths)) > 1:
        offsets = torch.tensor([0, *torch.tensor(widths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    outs = [base.clone() for _ in range(layers)]

    def launch(plan: tuple[int, int], layer: int) -> None:
        segmented_expand(xa, bs[layer], info, outs[layer], len(widths), slice_offsets=offsets,
                         max_slice_width=max(widths) if offsets is not None else None, tiles=plan)

    results, reference = {}, None
    for plan in plans:
        for o in outs:
            o.copy_(base)
        for layer in range(layers):  # compiles; the values the check compares
            launch(plan, layer)
        got = torch.stack([o.clone() for o in outs])
        if reference is None:
            reference = got
        us = graph_us(lambda layer: launch(plan, layer), calls=layers) if device == "cuda" else float("nan")
        results[plan] = (us, bool(torch.equal(got, reference)))
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_args(p)
    args = p.parse_args()
    dry = args.cpu_dry_run
    device = "cpu" if dry else "cuda"
    dtype = torch.float32 if dry else torch.bfloat16
    layers, num_slots, rank = (1, 9, 4) if dry else (36, 65, 16)
    modules = {"qkv_proj": (32, 16, 16)} if dry else MODULES
    plans = PLANS[:3] if dry else PLANS
    cases = [("decode 64 x 1", [0] * 64, [1] * 64), ("decode 64 x 8", [i % 8 for i in range(64)], [1] * 64),
             ("decode 64 x 32", [i % 32 for i in range(64)], [1] * 64),
             ("decode 64 x 64", list(range(64)), [1] * 64), ("prefill 8 x 256 x 8", list(range(8)), [256] * 8),
             ("prefill 128 x 1", [0], [128]),
             # The same live segments in a 9-slot server's capacity (14 segments for 64 rows, not 69).
             ("decode 64 x 1, 9-slot capacity", [0] * 64, [1] * 64, 9),
             ("decode 64 x 8, 9-slot capacity", [i % 8 for i in range(64)], [1] * 64, 9)]
    if dry:
        cases = [("decode 8 x 8", list(range(8)), [1] * 8), ("prefill 2 x 20 x 2", [0, 1], [20, 20]),
                 ("decode 8 x 2, 3-slot capacity", [0, 1] * 4, [1] * 8, 3)]
    lines = [f"### Expand tile plans, {torch.cuda.get_device_name(0) if not dry else 'CPU (interpreter)'}, "
             f"torch {torch.__version__} ({time.strftime('%Y-%m-%d')})", "",
             "GPU µs per launch (one graph of the expand of every layer), rank 16, 64 slots; plan = "
             "(BLOCK_N, warps[, 'b-early']); `same` = equal, bit for bit, to the first plan's.", "",
             "| module | case | " + " | ".join(str(pl) for pl in plans) + " | all same |",
             "|---|---|" + "---:|" * len(plans) + "---|"]
    for name, widths in modules.items():
        for label, slots, lens, *capacity_slots in cases:
            slots = [s % (num_slots - 1) for s in slots]
            info, rows = batch_info(slots, lens, capacity_slots[0] if capacity_slots else num_slots, rank, device)
            res = run_case(widths, info, rows, layers, num_slots, rank, plans, device, dtype)
            cells = [f"{res[pl][0]:.1f}" for pl in plans]
            lines.append(f"| {name} | {label} | " + " | ".join(cells) + f" | {all(s for _, s in res.values())} |")
            print(lines[-1], flush=True)
    emit_table(lines, args.out)


if __name__ == "__main__":
    main()
