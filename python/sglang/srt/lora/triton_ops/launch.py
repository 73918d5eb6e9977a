"""Launch a Triton kernel through its compiled launcher, bound once per specialisation.

`kernel[grid](*args, **constexprs)` re-binds every argument on every call: it builds the
specialisation key (dtype and 16-byte alignment of each pointer, value class of each int), hashes
it with the options, looks the compiled kernel up, builds launch metadata for the hooks and only
then launches. For LoRA that is paid 8 times per decoder layer. Here it is paid once per batch:

  BoundKernel       one @triton.jit kernel with fixed constexprs and options (module level);
  PreparedLaunch    BoundKernel + grid + the int arguments of one batch (built in
                    fill_batch_info); calling it with the tensors launches.

The first call of a signature goes through `kernel[grid]` (compiling if needed) and keeps the
compiled kernel it returns; later calls hand the arguments straight to its launcher. That is
correct because a compiled kernel is reused only for calls that triton's binder would have keyed
the same way: constexprs are fixed per BoundKernel, int arguments are fixed per PreparedLaunch and
classed like the binder does (== 1, divisible by 16, 32-bit), and each call re-checks its tensors'
dtype and 16-byte alignment (cheap integer tests). CPU tensors (the interpreter) and active launch
hooks (a profiler) always take the ordinary `kernel[grid]` path.

Kernels bound this way list their parameters as: tensors, then ints, then constexprs.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch

try:  # triton >= 3.4; the hooks are a HookChain (3.5+) or a callable / None
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older triton
    _knobs = None


def _launch_hooks_active() -> bool:
    if _knobs is None:
        return True  # unknown layout: keep the ordinary path
    for hook in (_knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", None) != []:
            return True
    return False


def _int_class(value: int) -> tuple[bool, bool]:
    assert isinstance(value, int) and not isinstance(value, bool), value
    assert -(2**31) <= value < 2**31, f"{value} would be passed as a 64-bit int"
    return value == 1, value % 16 == 0


class BoundKernel:
    """A @triton.jit kernel with fixed constexprs and launch options (num_warps, launch_pdl)."""

    def __init__(self, kernel: Any, constexprs: dict[str, Any], **options: Any) -> None:
        self.kernel = kernel
        self.constexprs = dict(constexprs)
        self.options = options
        # A JITFunction and the interpreter's InterpretedFunction both keep the Python function.
        params = list(inspect.signature(getattr(kernel, "fn", kernel)).parameters.values())
        is_constexpr = ["constexpr" in str(p.annotation) for p in params]
        names = [p.name for p in params]
        first = is_constexpr.index(True)
        assert all(is_constexpr[first:]), "constexpr parameters must come last"
        assert set(names[first:]) == set(self.constexprs), (names[first:], sorted(self.constexprs))
        self.num_runtime_args = first
        # The launcher takes every parameter, constexprs included, in signature order.
        self._tail = tuple(self.constexprs[n] for n in names[first:])
        self._compiled: dict[tuple, Any] = {}
        self.fast_launches = 0  # calls that skipped triton's binder (tests, benchmark)

    def prepare(self, grid: tuple[int, ...], ints: tuple[int, ...]) -> "PreparedLaunch":
        return PreparedLaunch(self, grid, ints)


class PreparedLaunch:
    """One launch shape of a BoundKernel: grid and int arguments fixed; call with the tensors."""

    __slots__ = ("bound", "grid", "ints", "_grid3", "_ints_key")

    def __init__(self, bound: BoundKernel, grid: tuple[int, ...], ints: tuple[int, ...]) -> None:
        self.bound = bound
        self.grid = tuple(grid)
        self.ints = tuple(ints)
        self._grid3 = (self.grid + (1, 1))[:3]
        self._ints_key = tuple(_int_class(v) for v in self.ints)

    def __call__(self, *tensors: torch.Tensor) -> None:
        bound = self.bound
        assert len(tensors) + len(self.ints) == bound.num_runtime_args, (len(tensors), len(self.ints))
        first = tensors[0]
        key: Optional[tuple] = None
        if first.is_cuda and not _launch_hooks_active():
            device = first.get_device()
            key = (device, self._ints_key, tuple((t.dtype, t.data_ptr() % 16 == 0) for t in tensors))
            compiled = bound._compiled.get(key)
            if compiled is not None:
                g0, g1, g2 = self._grid3
                stream = torch._C._cuda_getCurrentRawStream(device)
                compiled.run(
                    g0, g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None,
                    *tensors, *self.ints, *bound._tail,
                )
                bound.fast_launches += 1
                return
        result = self.call_unbound(*tensors)
        if key is not None and hasattr(result, "packed_metadata"):
            bound._compiled[key] = result

    def call_unbound(self, *tensors: torch.Tensor) -> Any:
        """The ordinary `kernel[grid](...)` launch (first calls, CPU; benchmark and tests compare)."""
        bound = self.bound
        return bound.kernel[self.grid](*tensors, *self.ints, **bound.constexprs, **bound.options)
