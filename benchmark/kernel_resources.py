"""What a Triton kernel holds on an H100 / H200 (sm_90), read without a GPU: registers a thread,
stack (spills), shared memory, and from them how many programs share an SM and how many waves a
grid takes. The decode LoRA kernels are latency-bound, so their waves are worth knowing before
device time is spent timing a variant.

    python benchmark/kernel_resources.py [--models qwen3-4b llama-3.1-8b] [--rows 1 8 32 64 128] [--out f.md]

Compiles with Triton's code generator and the ptxas bundled in its wheel, specialised as the JIT
specialises real shapes (16-byte aligned pointers, ints divisible by 16: without those hints the
loads are not vectorised and the counts come out about twice as high), and reads the cubin with the
bundled cuobjdump. Run without TRITON_INTERPRET (the interpreter replaces the compiler).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python"))
sys.path.insert(0, str(HERE))  # bench_util

from bench_util import emit_table, model_dims  # noqa: E402

# An H100 / H200 SM: 64K 32-bit registers, 64 resident warps, 32 resident programs, 228 KB of shared
# memory (1 KB of it reserved per program); 132 SMs on both cards.
SM_REGISTERS, SM_WARPS, SM_PROGRAMS, SM_SHARED, SMS = 65536, 64, 32, 228 * 1024, 132
REGISTER_UNIT = 256  # registers are given to a warp in units of this many


@dataclass(frozen=True)
class Usage:
    registers: int  # a thread's
    stack: int  # bytes a thread; non-zero: the kernel spills
    shared: int  # bytes a program, static

    def programs_per_sm(self, warps: int) -> int:
        per_warp = -(-self.registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
        by_registers = SM_REGISTERS // (per_warp * warps)
        by_shared = SM_SHARED // (self.shared + 1024)
        return min(by_registers, SM_WARPS // warps, SM_PROGRAMS, by_shared)


def compile_sm90(kernel, tensors: dict[str, str], ints: list[str], constexprs: dict, floats: tuple[str, ...] = (),
                 asm: str = "cubin", **options):
    """`kernel` compiled for sm_90: tensors (name -> "*bf16"...) 16-byte aligned, ints divisible by
    16, `floats` fp32 scalars; returns the `asm` stage ("cubin" bytes or "ptx" text)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "the interpreter replaces the compiler"
    sig = {**tensors, **{n: "i32" for n in ints}, **{n: "fp32" for n in floats}, **{k: "constexpr" for k in constexprs}}
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in list(tensors) + ints}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm[asm]


def usage(cubin: bytes) -> Usage:
    """The first kernel's resources in a cubin, as the bundled cuobjdump reports them."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    field = {key: int(re.search(rf"{key}:(\d+)", out).group(1)) for key in ("REG", "STACK", "SHARED")}
    return Usage(field["REG"], field["STACK"], field["SHARED"])


NORM_SHRINK_TENSORS = {**{n: "*bf16" for n in ("X", "R", "R_OUT", "NORM_W", "A", "XAUG", "Y", "D_S", "D_BT")},
                       "ROW_SLOTS": "*i32", "RANKS": "*i32", "SCALINGS": "*fp32", "D_SCALINGS": "*fp32"}
NORM_SHRINK_INTS = ["stride_x", "stride_r", "stride_ro", "stride_xaug", "stride_y", "a_stride_s", "a_stride_n",
                    "stride_ds", "dbt_stride_s", "dbt_stride_r", "K"]


def norm_shrink_rows(shape: str, rows: list[int], rank: int, slots: int) -> list[str]:
    """norm_shrink_pack before qkv_proj and gate_up_proj, folded (packed) and, as at many slots,
    unfolded: one table row each."""
    import triton

    from sglang.srt.layers.triton_ops.rmsnorm import row_warps
    from sglang.srt.lora.triton_ops import norm_shrink_pack as nsp

    hidden = model_dims(shape)[0]
    out = []
    for module, stack in (("qkv_proj", 3), ("gate_up_proj", 2)):
        for packed in (True, False):
            block_j = nsp.column_tile(hidden)
            warps = row_warps(hidden)
            cubin = compile_sm90(
                nsp._norm_shrink_pack_kernel, NORM_SHRINK_TENSORS, NORM_SHRINK_INTS,
                dict(STACK=stack, MAX_RANK=rank, E_COLS=slots * stack * rank if packed else 0,
                     BLOCK=triton.next_power_of_2(hidden), BLOCK_J=block_j, BLOCK_E=512, HAS_NORM=True,
                     HAS_RESIDUAL=True, HAS_SILU=False, PACKED=packed, EMULATE_RNE=False, USE_PDL=False,
                     DELTA_RANK=0, EARLY_LOADS=nsp.EARLY_LOADS,
                     NORM_WEIGHT_EARLY=nsp.NORM_WEIGHT_EARLY),
                floats=("eps",), num_warps=warps)
            grid_per_row = triton.cdiv(stack * rank, block_j)
            name = f"norm_shrink_pack {module} {'folded' if packed else 'unfolded'}"
            out.append(table_row(shape, name, usage(cubin), warps, [r * grid_per_row for r in rows]))
    return out


def table_row(shape: str, name: str, use: Usage, warps: int, programs: list[int]) -> str:
    per_sm = use.programs_per_sm(warps)
    waves = " / ".join(f"{p} ({-(-p // (per_sm * SMS))})" for p in programs)
    return f"| {shape} | {name} | {use.registers} | {use.stack} | {use.shared} | {warps} | {per_sm} | {waves} |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["qwen3-4b", "llama-3.1-8b"])
    p.add_argument("--rows", nargs="+", type=int, default=[1, 8, 32, 64, 128], help="decode batch rows")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--slots", type=int, default=8, help="adapter slots (a folded module's extra columns)")
    p.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = p.parse_args()
    lines = [f"Kernel resources at sm_90 (rank {args.rank}, {args.slots} slots; programs at "
             f"{' / '.join(map(str, args.rows))} rows, waves on {SMS} SMs in brackets)", "",
             "| model | kernel | registers | stack B | shared B | warps | programs an SM | programs (waves) |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for shape in args.models:
        lines += norm_shrink_rows(shape, args.rows, args.rank, args.slots)
    emit_table(lines, args.out)


if __name__ == "__main__":
    main()
