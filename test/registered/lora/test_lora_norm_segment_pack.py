"""RMSNorm + shrink_pack in one launch by segments (lora/triton_ops/norm_segment_pack.py), CPU
interpreter.

Against the two kernels it replaces (rmsnorm_fwd into x_aug, then shrink_pack over it): x_aug's
first K columns and the new residual are theirs bit for bit (the old residual untouched), the
extra columns equal the packed shrink of the normalised rows within rounding (the kernel scales
by rstd after the dot), every column is written (NaN poison disappears; NaN past an adapter's
rank in A is never read), ticket counters are re-armed, and a row's bits do not depend on the
rows beside it (a padded graph bucket and the live rows give the same x_aug).
"""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.triton_ops.rmsnorm import rmsnorm_fwd
from sglang.srt.lora.triton_ops.norm_segment_pack import (launch_norm_pack, norm_segment_pack, prepare_norm_pack,
                                                          workspace_numel)
from sglang.srt.lora.triton_ops.token_lora import plan_pack, shrink_pack, token_segments
from test_lora_fold import RANKS_T, ROW_SLOTS, SCALINGS_T, R, ref_x_aug
from test_lora_norm_shrink import EPS, inputs


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("stack", [1, 3])
@pytest.mark.parametrize("in_dim", [40, 300])  # 300: K split in two (the ticket reduction)
def test_the_norm_bit_for_bit_and_the_packed_shrink(in_dim, stack, with_residual):
    slots, x, residual, norm_w, a, extra = inputs(in_dim, stack, torch.float32, 11 * stack + in_dim)
    rows = slots.numel()
    res_in = residual.clone()
    x_aug = torch.full((rows, in_dim + extra), float("nan"))
    new_res = norm_segment_pack(x, residual if with_residual else None, norm_w, EPS, a, x_aug, slots, RANKS_T,
                                SCALINGS_T, stack, R)
    ref_res = residual.clone()
    normed = rmsnorm_fwd(x, norm_w, EPS, residual=ref_res if with_residual else None)
    assert not torch.isnan(x_aug).any()
    assert torch.equal(x_aug[:, :in_dim], normed)
    if with_residual:
        assert torch.equal(new_res, ref_res) and torch.equal(residual, res_in)
    else:
        assert new_res is None
    torch.testing.assert_close(x_aug, ref_x_aug(normed, a, ROW_SLOTS, stack, extra), rtol=1e-5, atol=1e-4)
    unfused = torch.empty_like(x_aug)
    shrink_pack(normed, a, unfused, slots, RANKS_T, SCALINGS_T, stack, R)
    torch.testing.assert_close(x_aug, unfused, rtol=1e-5, atol=1e-4)


def test_bfloat16_norm_and_residual_bit_for_bit():
    """In bf16 the rows and the new residual are rmsnorm_fwd's bits too. (The interpreter's bf16
    tl.dot is no reference: the shrink columns in bf16 are checked on the GPU,
    test_graph_runners_gpu.py's norm-segments case.)"""
    slots, x, residual, norm_w, a, extra = inputs(300, 3, torch.bfloat16, 41)
    x_aug = torch.full((slots.numel(), 300 + extra), float("nan"), dtype=torch.bfloat16)
    ref_res = residual.clone()
    new_res = norm_segment_pack(x, residual, norm_w, EPS, a, x_aug, slots, RANKS_T, SCALINGS_T, 3, R)
    normed = rmsnorm_fwd(x, norm_w, EPS, residual=ref_res)
    assert torch.equal(x_aug[:, :300], normed) and torch.equal(new_res, ref_res)


def test_rows_do_not_depend_on_the_padding_and_counters_are_re_armed():
    """A graph bucket: more rows (padding, slot -1) and more segments than the live batch; the live
    rows' bits are those of an eager pass over them alone, launch after launch."""
    slots, x, residual, norm_w, a, extra = inputs(300, 3, torch.float32, 53)
    rows, pad = slots.numel(), 13
    plan = plan_pack(300, 3, R, extra, 4)
    eager = torch.full((rows, 300 + extra), float("nan"))
    eager_res = norm_segment_pack(x, residual, norm_w, EPS, a, eager, slots, RANKS_T, SCALINGS_T, 3, R)

    slots_p = torch.cat([slots, torch.full((pad,), -1, dtype=torch.int32)])
    perm, indptr, widx, n = token_segments(slots_p, RANKS_T, 16)
    capacity = n + 3  # the bucket's capacity: empty segments past the live ones
    indptr = torch.cat([indptr, indptr[-1:].repeat(3)])
    widx = torch.cat([widx, widx[-1:].repeat(3)])
    x_p = torch.cat([x, torch.zeros(pad, 300)])
    r_p = torch.cat([residual, torch.zeros(pad, 300)])
    workspace = torch.empty(workspace_numel(plan, rows + pad))
    counters = torch.zeros(plan.shrink.num_counters(capacity), dtype=torch.int32)
    launch = prepare_norm_pack(plan, rows + pad, capacity, EPS, True, x_p, a, 300 + extra)
    for _ in range(2):
        graph = torch.full((rows + pad, 300 + extra), float("nan"))
        r_out = torch.empty_like(r_p)
        launch_norm_pack(launch, x_p, r_p, r_out, norm_w, a, graph, workspace, counters, perm, indptr, widx, RANKS_T,
                         SCALINGS_T)
        assert torch.equal(graph[:rows], eager) and torch.equal(r_out[:rows], eager_res)
        assert torch.count_nonzero(counters) == 0


def hopper_ptx(has_residual: bool) -> str:
    """The kernel compiled for sm_90 at the Qwen3-4B qkv_proj's shapes, 9 slots of rank 16 (run
    without TRITON_INTERPRET)."""
    from sglang.srt.layers.triton_ops.rmsnorm import row_warps
    from sglang.srt.lora.triton_ops.norm_segment_pack import _norm_segment_pack_kernel
    from test_lora_token_kernels import SEGMENT_PTRS, _compile_for_hopper

    bf16 = {n: "*bf16" for n in ("x_ptr", "r_ptr", "r_out_ptr", "norm_w_ptr", "w_ptr", "xaug_ptr")}
    return _compile_for_hopper(
        _norm_segment_pack_kernel,
        {**bf16, "part_ptr": "*fp32", "counter_ptr": "*i32", **SEGMENT_PTRS, "lora_ranks_ptr": "*i32",
         "scalings_ptr": "*fp32"},
        ["num_rows", "part_plane", "K", "k_per_split", "x_stride_t", "r_stride_t", "ro_stride_t", "w_stride_s",
         "w_stride_n", "xaug_stride_t", "n_tiles", "seg_programs"],
        dict(EPS=1e-6, STACK=3, MAX_RANK=16, E_COLS=432, BLOCK_S=16, BLOCK_N=32, BLOCK_K=256, BLOCK_E=32, SPLIT=10,
             DOT_PREC="tf32", HAS_RESIDUAL=has_residual, ROW_BLOCK=4096, EMULATE_RNE=False),
        num_warps=row_warps(2560),
    )


def test_compiles_for_hopper():
    """What only the compiler checks (types, scalar conditions, the early returns), in a subprocess
    without TRITON_INTERPRET (bundled ptxas, no GPU needed): tensor-core dots and the ticket."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    python_dir = os.path.join(here, "..", "..", "..", "python")  # this checkout's package, not an installed one
    code = (f"import sys; sys.path[:0] = {[here, python_dir] + sys.path[:3]!r}; "
            "import test_lora_norm_segment_pack as t; ptx = [t.hopper_ptx(r) for r in (True, False)]; "
            "print('ok', all('mma' in p and 'atom' in p and 'rsqrt' in p for p in ptx))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "True", proc.stdout
