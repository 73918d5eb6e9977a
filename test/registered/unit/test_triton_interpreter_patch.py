"""Triton's interpreter patched once per launch (layers/triton_ops/interpreter.py): kernels whose
programs call nested @triton.jit helpers compute what they computed before, the launch patches
`triton.language` once however many helper calls its programs make, a helper that sees a language
module the launch did not patch is patched and restored, and every builtin is the original again
after a launch, also one that raised. CPU only: the GPU runs compiled kernels."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest
import torch

from sglang.srt.layers.triton_ops.common import interpreting

pytestmark = pytest.mark.skipif(not interpreting(), reason="TRITON_INTERPRET=1 only (kernels on the CPU)")

if interpreting():
    import triton
    import triton.language as tl
    from triton.runtime import interpreter as interp

    from sglang.srt.layers.triton_ops.interpreter import install

    @triton.jit
    def _twice(x):
        return x * 2

    @triton.jit
    def _twice_twice(x):
        return _twice(_twice(x))

    @triton.jit
    def _nested_kernel(X, Y, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Y + offs, _twice_twice(tl.load(X + offs)) + 1)

    @triton.jit
    def _flat_kernel(X, Y, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Y + offs, tl.load(X + offs) * 4 + 1)

    @triton.jit
    def _raising_kernel(X, Y, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(Y + offs, _twice(tl.load(X + offs)))
        tl.static_assert(BLOCK < 0, "raised after a helper call")


def builtins_now() -> dict:
    """Every builtin of the language modules the interpreter patches, by identity."""
    out = {}
    for pkg in (tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base):
        for name in dir(pkg):
            member = getattr(pkg, name, None)
            if tl.core.is_builtin(member) or name in ("multiple_of", "max_contiguous", "to_ir"):
                out[(id(pkg), name)] = member
    return out


@pytest.fixture
def patch_counts(monkeypatch) -> list:
    """Counts the interpreter's patches of `triton.language` (each patches tl, tl.core, ... once)."""
    assert install()
    calls = []
    real = interp._patch_lang_core

    def counting(lang, scope):
        calls.append(lang)
        return real(lang, scope)

    monkeypatch.setattr(interp, "_patch_lang_core", counting)
    return calls


def test_nested_helpers_compute_what_they_did(patch_counts) -> None:
    x = torch.randn(4 * 16)
    y = torch.empty_like(x)
    before = builtins_now()
    _nested_kernel[(4,)](x, y, 16)
    assert torch.equal(y, x * 4 + 1)
    assert builtins_now() == before


def test_a_launch_patches_once_whatever_its_programs_call(patch_counts) -> None:
    x = torch.randn(8 * 16)
    y = torch.empty_like(x)
    _flat_kernel[(8,)](x, y, 16)
    flat = len(patch_counts)
    patch_counts.clear()
    _nested_kernel[(8,)](x, y, 16)  # 8 programs x 3 helper calls: 24 patches unpatched
    assert flat >= 1 and len(patch_counts) == flat, (flat, len(patch_counts))


def test_a_helper_seeing_another_language_module_is_patched_and_restored(tmp_path, patch_counts) -> None:
    # A helper module that sees only `triton.language.core` (not `triton.language`), as a kernel
    # library may import it: the launch (whose globals hold `tl`) did not patch it under that name.
    (tmp_path / "core_only_helpers.py").write_text(textwrap.dedent("""
        import triton
        from triton.language import core

        @triton.jit
        def plus_one(x):
            return core.where(x == x, x + 1, x)
    """))
    (tmp_path / "core_only_kernel.py").write_text(textwrap.dedent("""
        import triton
        import triton.language as tl
        from core_only_helpers import plus_one

        @triton.jit
        def kernel(X, Y, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            tl.store(Y + offs, plus_one(tl.load(X + offs)))
    """))
    sys.path.insert(0, str(tmp_path))
    try:
        kernel = importlib.import_module("core_only_kernel").kernel
        x = torch.randn(16)
        y = torch.empty_like(x)
        before = builtins_now()
        kernel[(2,)](x, y, 16)
        assert torch.equal(y, x + 1)
        assert builtins_now() == before
    finally:
        sys.path.remove(str(tmp_path))
        for name in ("core_only_kernel", "core_only_helpers"):
            sys.modules.pop(name, None)


def test_a_launch_that_raises_leaves_the_language_as_it_was(patch_counts) -> None:
    x = torch.randn(16)
    y = torch.empty_like(x)
    before = builtins_now()
    with pytest.raises(Exception):
        _raising_kernel[(1,)](x, y, 16)
    assert builtins_now() == before
    _nested_kernel[(1,)](x, y, 16)  # and the next launch runs as before
    assert torch.equal(y, x * 4 + 1)
