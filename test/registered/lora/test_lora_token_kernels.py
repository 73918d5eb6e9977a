"""Token-major LoRA kernels (token_shrink / token_expand; shrink_pack in test_lora_fold.py) vs a torch
reference (CPU interpreter, fp32).

Same poisoning as test_lora_kernels.py: NaN past each adapter's compact prefix in A and B and past
its columns in the shrink output, sentinels in rows that must stay untouched (base rows, padding).
Layouts cover long runs of one slot (whole segments), slots interleaved row by row (decode: the
rows are regrouped into one-slot segments), rank-0 rows between adapter rows, padding (slot -1),
and split-K with its counters re-armed to zero.
"""

from __future__ import annotations

import pytest
import torch

from sglang.srt.lora.triton_ops.token_lora import (
    ExpandPlan,
    plan_expand,
    plan_shrink,
    token_expand,
    token_shrink,
    with_split,
)
from test_lora_kernels import (  # noqa: E402 (conftest puts this directory on sys.path)
    IN_DIM,
    KV,
    MAX_RANK,
    PLAIN_OUT,
    Q,
    RANKS,
    SCALINGS,
    SENTINEL,
    INTER,
    _poisoned_a,
    _poisoned_b,
)

RANKS_T = torch.tensor(RANKS, dtype=torch.int32)
SCALINGS_T = torch.tensor(SCALINGS, dtype=torch.float32)

# Per-request (length, slot) then padding rows (slot -1).
LAYOUTS = {
    # one request per tile region, an empty request, a rank-0 request, uneven lengths
    "mixed": ([5, 0, 9, 3, 4], [1, 2, 0, 3, 2], 3),
    # 40 rows of one adapter: whole tiles of one slot (fast path), then a partial tile
    "long": ([40, 1, 7], [2, 3, 1], 2),
    # decode: every row its own request, slots interleaved within one tile
    "decode": ([1] * 7, [1, 0, 2, 3, 2, 1, 3], 0),
}


def _token_slots(name: str) -> tuple[torch.Tensor, int]:
    lens, slots, pad = LAYOUTS[name]
    per_row = [s for n, s in zip(lens, slots) for _ in range(n)] + [-1] * pad
    return torch.tensor(per_row, dtype=torch.int32), len(per_row)


def _rows_of(token_slots: torch.Tensor):
    """(row, slot, rank) of every row with an active slot."""
    for row, slot in enumerate(token_slots.tolist()):
        if slot >= 0 and RANKS[slot] > 0:
            yield row, slot, RANKS[slot]


def ref_shrink(x, a, token_slots, stack, out):
    out = out.clone()
    for row, slot, r in _rows_of(token_slots):
        out[row, : stack * r] = x[row] @ a[slot, : stack * r].T
    return out


def ref_expand(xa, b, token_slots, base, bounds):
    base = base.clone()
    for row, slot, r in _rows_of(token_slots):
        for k, (lo, hi) in enumerate(bounds):
            base[row, lo:hi] += SCALINGS[slot] * (xa[row, k * r : (k + 1) * r] @ b[slot, lo:hi, :r].T)
    return base


def _assert_untouched(out: torch.Tensor, token_slots: torch.Tensor) -> None:
    touched = torch.zeros(out.shape[0], dtype=torch.bool)
    for row, _, _ in _rows_of(token_slots):
        touched[row] = True
    assert (~touched).any(), "layout must leave some rows untouched"
    assert torch.equal(out[~touched], torch.full_like(out[~touched], SENTINEL))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("stack", [1, 2, 3])
def test_token_shrink(layout, stack):
    gen = torch.Generator().manual_seed(stack)
    token_slots, rows = _token_slots(layout)
    x = torch.randn(rows, IN_DIM, generator=gen)
    a = _poisoned_a(stack, gen)
    out = torch.full((rows, stack * MAX_RANK), SENTINEL)
    got = token_shrink(x, a, token_slots, RANKS_T, stack, out=out)
    assert got.data_ptr() == out.data_ptr()
    expected = ref_shrink(x, a, token_slots, stack, torch.full((rows, stack * MAX_RANK), SENTINEL))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["mixed", "decode"])
@pytest.mark.parametrize("split", [2, 3])
def test_token_shrink_split_k_rearms_its_counters(layout, split):
    """Partial sums meet in the last program of each tile; counters are back at 0 afterwards, so
    a second launch (as a graph replay would do) gives the same result bit for bit."""
    gen = torch.Generator().manual_seed(40 + split)
    token_slots, rows = _token_slots(layout)
    in_dim = 300  # 3 K tiles of 128 (fp32), the last one partial
    x = torch.randn(rows, in_dim, generator=gen)
    a = torch.randn(len(RANKS), 2 * MAX_RANK, in_dim, generator=gen)
    for slot, r in enumerate(RANKS):
        a[slot, 2 * r :] = float("nan")
    plan = with_split(plan_shrink(in_dim, 2 * MAX_RANK, x.element_size()), split)
    assert plan.split == split
    workspace = torch.full((plan.workspace_numel(rows),), float("nan"))
    counters = torch.zeros(plan.num_counters(rows), dtype=torch.int32)
    outs = []
    for _ in range(2):
        out = torch.full((rows, 2 * MAX_RANK), SENTINEL)
        token_shrink(x, a, token_slots, RANKS_T, 2, out=out, workspace=workspace, counters=counters, plan=plan)
        assert torch.equal(counters, torch.zeros_like(counters))
        outs.append(out)
    expected = ref_shrink(x, a, token_slots, 2, torch.full((rows, 2 * MAX_RANK), SENTINEL))
    torch.testing.assert_close(outs[0], expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(outs[0], outs[1])


def test_plans_depend_on_static_shapes_only():
    """Tiles and the K split decide each row's summation order: they must not follow the row count
    (a graph replays a padded bucket, eager runs the live rows), only K and the widths."""
    down = plan_shrink(14336, 16, 2)  # Llama-8B down_proj: 56 K tiles in at most 32 pieces
    assert down.split == 28 and down.k_per_split == 512 and down.k_per_split % down.block_k == 0
    qkv = plan_shrink(4096, 48, 2)  # one 256-deep K tile per program, two 32-wide column tiles
    assert qkv.split == 16 and qkv.k_per_split == 256 and qkv.block_s == 16
    assert (qkv.block_n, qkv.n_tiles) == (32, 2)
    assert plan_shrink(40, 16, 4).split == 1  # a single K tile cannot be split
    # Only the grid follows the batch: one program column (x tiles x splits) per segment.
    assert [qkv.grid(n)[0] for n in (1, 2, 130)] == [32, 64, 4160]
    assert qkv.workspace_numel(32) == 16 * 32 * 64 and qkv.num_counters(3) == 6
    assert plan_expand(6144, 3, 16, 4096).block_s == plan_expand(128, 1, 16).block_s == 16
    assert plan_shrink(4096, 48, 2, block_s=32).block_s == 32  # csgmv's chunk


def _shrunk(rows: int, stack: int, token_slots: torch.Tensor, gen) -> torch.Tensor:
    xa = torch.randn(rows, stack * MAX_RANK, generator=gen)
    for row, slot, r in _rows_of(token_slots):
        xa[row, stack * r :] = float("nan")
    return xa


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_token_expand_plain(layout):
    gen = torch.Generator().manual_seed(11)
    token_slots, rows = _token_slots(layout)
    xa = _shrunk(rows, 1, token_slots, gen)
    b = _poisoned_b(PLAIN_OUT, gen)
    base = torch.full((rows, PLAIN_OUT), SENTINEL)
    expected = ref_expand(xa, b, token_slots, base, [(0, PLAIN_OUT)])
    got = token_expand(xa, b, token_slots, RANKS_T, SCALINGS_T, base, 1)
    assert got.data_ptr() == base.data_ptr()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    _assert_untouched(got, token_slots)


@pytest.mark.parametrize("layout", ["mixed", "decode"])
def test_token_expand_qkv_gqa_and_gate_up(layout):
    gen = torch.Generator().manual_seed(5)
    token_slots, rows = _token_slots(layout)
    xa = _shrunk(rows, 3, token_slots, gen)
    b = _poisoned_b(Q + 2 * KV, gen)
    offsets = torch.tensor([0, Q, Q + KV, Q + 2 * KV], dtype=torch.int32)
    base = torch.full((rows, Q + 2 * KV), SENTINEL)
    bounds = [(0, Q), (Q, Q + KV), (Q + KV, Q + 2 * KV)]
    expected = ref_expand(xa, b, token_slots, base, bounds)
    got = token_expand(xa, b, token_slots, RANKS_T, SCALINGS_T, base, 3, offsets, max(Q, KV))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    _assert_untouched(got, token_slots)

    xa2 = _shrunk(rows, 2, token_slots, gen)
    b2 = _poisoned_b(2 * INTER, gen)
    base2 = torch.full((rows, 2 * INTER), SENTINEL)
    expected2 = ref_expand(xa2, b2, token_slots, base2, [(0, INTER), (INTER, 2 * INTER)])
    got2 = token_expand(xa2, b2, token_slots, RANKS_T, SCALINGS_T, base2, 2)
    torch.testing.assert_close(got2, expected2, rtol=1e-5, atol=1e-4)


def test_token_expand_bucket_sized_grid_with_padding():
    """A graph's grid is sized for the bucket: tiles of padding rows (slot -1) must do nothing."""
    gen = torch.Generator().manual_seed(9)
    live = torch.tensor([2] * 20 + [1] * 30 + [0] * 5, dtype=torch.int32)
    token_slots = torch.cat([live, torch.full((73,), -1, dtype=torch.int32)])  # 128-row bucket
    rows = token_slots.numel()
    xa = _shrunk(rows, 1, token_slots, gen)
    b = _poisoned_b(PLAIN_OUT, gen)
    base = torch.full((rows, PLAIN_OUT), SENTINEL)
    plan = plan_expand(PLAIN_OUT, 1, MAX_RANK)
    assert isinstance(plan, ExpandPlan) and plan.block_s == 16
    expected = ref_expand(xa, b, token_slots, base, [(0, PLAIN_OUT)])
    got = token_expand(xa, b, token_slots, RANKS_T, SCALINGS_T, base, 1, plan=plan)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    _assert_untouched(got, token_slots)


def test_shrink_then_expand_matches_dense_lora():
    gen = torch.Generator().manual_seed(8)
    token_slots, rows = _token_slots("mixed")
    x = torch.randn(rows, IN_DIM, generator=gen)
    a = _poisoned_a(1, gen)
    b = _poisoned_b(PLAIN_OUT, gen)
    base = torch.randn(rows, PLAIN_OUT, generator=gen)
    expected = base.clone()
    for row, slot, r in _rows_of(token_slots):
        expected[row] += SCALINGS[slot] * (x[row] @ a[slot, :r].T @ b[slot, :, :r].T)
    xa = token_shrink(x, a, token_slots, RANKS_T, 1)
    got = token_expand(xa, b, token_slots, RANKS_T, SCALINGS_T, base.clone(), 1)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


# ---- launch plumbing --------------------------------------------------------------------------
def test_bound_kernel_checks_its_signature():
    from sglang.srt.lora.triton_ops.launch import BoundKernel
    from sglang.srt.lora.triton_ops.token_shrink import _token_shrink_kernel

    with pytest.raises(AssertionError):  # a constexpr missing
        BoundKernel(_token_shrink_kernel, dict(STACK=1), num_warps=4)
    plan = plan_shrink(IN_DIM, MAX_RANK, 4)
    from sglang.srt.lora.triton_ops.token_lora import prepare_shrink

    x, a = torch.zeros(16, IN_DIM), torch.zeros(len(RANKS), MAX_RANK, IN_DIM)
    launch = prepare_shrink(plan, 16, 1, x, a, MAX_RANK, 1)
    assert launch.bound.num_runtime_args == 9 + len(launch.ints)
    with pytest.raises(AssertionError):  # an int that triton would pass as 64-bit
        launch.bound.prepare(launch.grid, launch.ints[:-1] + (2**40,))


def _compile_for_hopper(kernel, tensors: dict, ints: list[str], constexprs: dict, floats: tuple[str, ...] = (),
                        asm: str = "ptx", **options):
    """Compile for sm_90 without a GPU (bundled ptxas), the way the JIT specialises real shapes:
    16-byte aligned pointers and ints divisible by 16 (`floats`: fp32 scalars after the ints).
    Returns the `asm` stage: "ptx" (text) or "cubin" (bytes). benchmark/kernel_resources.py's."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "benchmark"))
    from kernel_resources import compile_sm90

    return compile_sm90(kernel, tensors, ints, constexprs, floats, asm=asm, **options)


SEGMENT_PTRS = {"perm_ptr": "*i32", "seg_indptr_ptr": "*i32", "weight_indices_ptr": "*i32"}


def hopper_ptx_flags(use_pdl: bool) -> dict[str, bool]:
    """Compile both kernels for sm_90 and report PTX facts (run without TRITON_INTERPRET)."""
    from sglang.srt.lora.triton_ops.token_expand import _token_expand_kernel
    from sglang.srt.lora.triton_ops.token_shrink import _token_shrink_kernel

    shrink = _compile_for_hopper(
        _token_shrink_kernel,
        {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32", "counter_ptr": "*i32",
         **SEGMENT_PTRS, "lora_ranks_ptr": "*i32"},
        ["num_rows", "part_plane", "K", "k_per_split", "x_stride_t", "w_stride_s", "w_stride_n", "out_stride_t",
         "n_tiles"],
        dict(STACK=3, BLOCK_S=16, BLOCK_N=64, BLOCK_K=256, SPLIT=4, DOT_PREC="tf32", USE_PDL=use_pdl),
        num_warps=4,
    )
    expand = _compile_for_hopper(
        _token_expand_kernel,
        {"xa_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", **SEGMENT_PTRS,
         "lora_ranks_ptr": "*i32", "scalings_ptr": "*fp32", "slice_offsets_ptr": "*i32"},
        ["num_rows", "slice_width", "n_tiles", "xa_stride_t", "w_stride_s", "w_stride_n", "out_stride_t"],
        dict(HAS_OFFSETS=True, OFFSET_ALIGN=16, BLOCK_S=16, BLOCK_N=128, BLOCK_R=16, DOT_PREC="tf32", USE_PDL=use_pdl),
        num_warps=4,
        launch_pdl=use_pdl,
    )
    from sglang.srt.lora.triton_ops.shrink_pack import _shrink_pack_kernel

    pack = _compile_for_hopper(
        _shrink_pack_kernel,
        {"x_ptr": "*bf16", "w_ptr": "*bf16", "xaug_ptr": "*bf16", "part_ptr": "*fp32", "counter_ptr": "*i32",
         **SEGMENT_PTRS, "lora_ranks_ptr": "*i32", "scalings_ptr": "*fp32"},
        ["num_rows", "part_plane", "K", "k_per_split", "x_stride_t", "w_stride_s", "w_stride_n", "xaug_stride_t",
         "n_tiles"],
        dict(STACK=3, MAX_RANK=16, E_COLS=432, BLOCK_S=16, BLOCK_N=32, BLOCK_K=256, BLOCK_E=32, SPLIT=8,
             DOT_PREC="tf32", USE_PDL=use_pdl, COPY_X=True),
        num_warps=4,
        launch_pdl=use_pdl,
    )
    return {
        "ticket": "atom" in shrink and "atom" in pack,
        "launch_dependents": "griddepcontrol.launch_dependents" in shrink,
        "wait": "griddepcontrol.wait" in expand and "griddepcontrol.wait" in pack,
        "vector_rmw": "st.global.v4" in expand,
        "vector_copy": "st.global.v4" in pack,  # the copy of x into x_aug
    }


def _without_interpreter(function: str) -> list:
    """[function(False), function(True)] of this module, run in a subprocess without
    TRITON_INTERPRET (the compiler needs the real @triton.jit objects; bundled ptxas, no GPU)."""
    import json
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    python_dir = os.path.join(here, "..", "..", "..", "python")  # this checkout's package, not an installed one
    code = (
        f"import sys, json; sys.path[:0] = {[here, python_dir] + sys.path[:3]!r}; "
        f"import test_lora_token_kernels as t; print(json.dumps([t.{function}(p) for p in (False, True)]))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_token_kernels_compile_for_hopper():
    """The interpreter skips what only the compiler checks (globals, types, PDL intrinsics); the
    compiler needs the real @triton.jit objects, so this runs in a subprocess without
    TRITON_INTERPRET (bundled ptxas, no GPU needed)."""
    plain, pdl = _without_interpreter("hopper_ptx_flags")
    expected = {"ticket": True, "launch_dependents": False, "wait": False, "vector_rmw": True, "vector_copy": True}
    assert plain == expected, plain
    assert pdl == dict(expected, launch_dependents=True, wait=True), pdl


def segment_expand_ptx_facts(use_pdl: bool) -> dict[str, int]:
    """csgmv's segmented expand compiled for sm_90 (run without TRITON_INTERPRET): how many PDL
    waits it has, and how many branches come before the first (0: every program reaches it)."""
    import re

    from sglang.srt.lora.triton_ops.sgemm_lora_b import _segment_expand_kernel

    ptx = _compile_for_hopper(
        _segment_expand_kernel,
        {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "seg_indptr_ptr": "*i32",
         "weight_indices_ptr": "*i32", "lora_ranks_ptr": "*i32", "scalings_ptr": "*fp32", "perm_ptr": "*i32",
         "slice_offsets_ptr": "*i32"},
        ["x_stride_t", "x_stride_r", "x_slot_stride", "w_stride_s", "w_stride_slice", "w_stride_n", "w_stride_r",
         "out_stride_t", "out_stride_n", "slice_width", "n_tiles", "lanes"],
        dict(HAS_OFFSETS=False, OFFSET_ALIGN=1, BLOCK_S=16, BLOCK_N=256, BLOCK_R=16, R_ITERS=1, LANE_ITERS=1,
             DOT_PREC="tf32", B_EARLY=True, USE_PDL=use_pdl),
        num_warps=4,
        launch_pdl=use_pdl,
    )
    body = ptx[ptx.index(".entry"):]
    head = body.split("griddepcontrol.wait")[0]
    return {"waits": body.count("griddepcontrol.wait"), "branches_before_wait": len(re.findall(r"\bbra\b", head)),
            "loads_before_wait": len(re.findall(r"ld\.global", head))}


def test_segment_expand_as_a_dependent_waits_in_every_program():
    """Launched as a programmatic dependent (sgemm_lora_b.PDL_MAX_ROWS), the expand waits once, in
    straight-line code before any branch: also the programs with nothing to do wait before they
    leave, so the kernel never completes before the GEMM it follows. Its metadata and B loads come
    before the wait. Without PDL no wait is compiled in. (A subprocess without TRITON_INTERPRET.)"""
    plain, pdl = _without_interpreter("segment_expand_ptx_facts")
    assert plain["waits"] == 0, plain
    assert pdl["waits"] == 1 and pdl["branches_before_wait"] == 0 and pdl["loads_before_wait"] > 0, pdl
