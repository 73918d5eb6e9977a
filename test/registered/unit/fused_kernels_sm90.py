"""Compile the fused layer kernels for an H100/H200 (sm_90) without a GPU: Triton's code generator
and the ptxas shipped in the Triton wheel. The interpreter accepts code the GPU compiler rejects
(types, constexpr use); this catches that before a GPU run does.

Run as a script in a process *without* TRITON_INTERPRET (test_fused_kernels_compile.py does);
prints one line per compiled variant and exits non-zero on the first failure.
"""

from __future__ import annotations

import inspect
import os
import sys

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "the interpreter replaces the compiler"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from sglang.srt.layers.attention.triton_ops import decode_attention  # noqa: E402
from sglang.srt.layers.triton_ops import rmsnorm, rope, silu_and_mul, topk_topp  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def compile_kernel(kernel, types: dict[str, str], consts: dict[str, object]) -> str:
    params = list(inspect.signature(kernel.fn).parameters)
    missing = set(params) - set(types) - set(consts)
    if missing:
        raise KeyError(f"{kernel.fn.__name__}: no type for {sorted(missing)}")
    signature = {p: ("constexpr" if p in consts else types[p]) for p in params}
    constexprs = {(params.index(name),): value for name, value in consts.items()}
    ptx = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=TARGET).asm["ptx"]
    # RELEASE: the kernel lets a programmatic dependent (a LoRA shrink) start; else it must not.
    if ("griddepcontrol.launch_dependents" in ptx) != bool(consts.get("RELEASE", False)):
        raise AssertionError(f"{kernel.fn.__name__} {consts}: launch_dependents does not follow RELEASE")
    print(f"ok {kernel.fn.__name__} {consts}", flush=True)
    return ptx


def main() -> None:
    # bf16, the serving dtype (float32 runs the same code with other types); a few variants each.
    p = "*bf16"
    for residual, release, weight_first in ((True, False, False), (False, False, False), (True, True, False),
                                            (True, False, True)):
        compile_kernel(
            rmsnorm._rmsnorm_kernel,
            dict(X=p, R=p, W=p, Y=p, stride_x="i64", stride_r="i64", stride_y="i64", n_cols="i32", eps="fp32"),
            dict(BLOCK=4096, HAS_RESIDUAL=residual, EMULATE_RNE=False, RELEASE=release, WEIGHT_FIRST=weight_first),
        )
    for release in (False, True):
        compile_kernel(
            silu_and_mul._silu_and_mul_kernel,
            dict(X=p, Y=p, stride_x="i64", stride_y="i64", d="i32"),
            dict(BLOCK=1024, EMULATE_RNE=False, RELEASE=release),
        )
        compile_kernel(
            decode_attention._decode_stage2_kernel,
            dict(Part_O="*fp32", Part_LSE="*fp32", seq_lens="*i32", O=p, stride_pob="i64", stride_poh="i64",
                 stride_pos="i64", stride_lb="i64", stride_lh="i64", stride_ob="i64", stride_oh="i64"),
            dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64, NUM_KV_SPLITS=8, RELEASE=release),
        )
    rope_types = dict(
        QKV=p, stride_t="i64", POS="*i64", COS_SIN="*fp32", stride_cs="i64", QW=p, KW=p, eps="fp32",
        K_BUF=p, V_BUF=p, LOC="*i64", stride_kb_slot="i64", stride_kb_head="i64",
        stride_vb_slot="i64", stride_vb_head="i64",
    )
    # (head_dim, rotary_dim, q/k norm, KV store): Qwen3, partial rotary, a head dim that is not a
    # multiple of 16, Llama.
    for head_dim, rotary, qk_norm, store, loc_first in ((128, 128, True, True, False), (128, 64, True, True, False),
                                                        (72, 72, False, False, False), (128, 128, False, True, False),
                                                        (128, 128, True, True, True)):
        half, pass_dims = rotary // 2, head_dim - rotary
        block_half = triton.next_power_of_2(half)
        compile_kernel(
            rope._qkv_rope_kernel,
            rope_types,
            dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=head_dim, HALF=half, SIN_OFFSET=3 * half,
                 BLOCK_HALF=block_half, PASS=pass_dims, BLOCK_PASS=triton.next_power_of_2(max(pass_dims, 1)),
                 BLOCK_H=max(1, 256 // block_half), QK_NORM=qk_norm, STORE_KV=store, EMULATE_RNE=False,
                 LOC_FIRST=loc_first),
        )
    # The Sampler's top-k / top-p threshold search: its default launch, and the no-write variant.
    for write_out in (True, False):
        compile_kernel(
            topk_topp._topk_topp_threshold_kernel,
            dict(P="*fp32", TOP_K="*i64", TOP_P="*fp32", T="*fp32", OUT="*fp32", stride_p="i64", stride_o="i64",
                 n_cols="i32"),
            dict(BLOCK=topk_topp.BLOCK, N_CAND=topk_topp.N_CAND, WRITE_OUT=write_out),
        )


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # one line the test can show
        print(f"FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        raise
