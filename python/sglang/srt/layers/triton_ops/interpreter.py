"""Triton's interpreter (TRITON_INTERPRET=1, kernels on the CPU through numpy), patched once per launch.

The interpreter swaps `triton.language`'s builtins for its own at every launch and swaps them back
after it. It also re-patches at every call of a nested `@triton.jit` function, inside every program
of the grid, though the launch has already patched the same modules: `inspect.getmembers` over
`triton.language`, `triton.language.core`, their tensor class and `math`, each time. Our kernels
call helpers (a row's RMSNorm, a rounding, a PDL wait) from every program, so about a third of an
interpreted launch went there: the CPU suite's fused-norm tests took 74 s re-patching and 51 s
patching once (triton 3.9, 2026-12-06).

`install()` makes a nested call skip the patch when the launch around it has already patched every
language module the helper sees (the same objects, so the same patch). A helper that sees one the
launch did not patch is patched as before, and restored when the launch ends, before the launch's
own patch, so every attribute gets its original back. Outside a launch (a jit function called from
plain Python) nothing changes. The values a kernel computes do not change either: the same
interpreted builtins run, only patched fewer times.

It hooks two internals (`GridExecutor.__call__`, `_patch_lang`); where a triton lacks them it
leaves the interpreter alone and says so once in the log.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from typing import Any, Callable

logger = logging.getLogger(__name__)

_installed = False


class _Launch:
    """The patches of one interpreted launch: the launch's own, then those nested helpers added."""

    def __init__(self, scope: Any, langs: frozenset) -> None:
        self.scope = scope
        self.langs = set(langs)
        self.nested: list[Any] = []

    def restore(self) -> None:
        # Nested scopes recorded the launch's patched values as their originals where they overlap:
        # undo them first, newest first, then the launch's own.
        for scope in reversed(self.nested):
            scope.restore()
        self.nested.clear()
        self.scope.restore()


class _Nothing:
    """What a nested call gets when the launch already covers it (the interpreter drops it anyway)."""

    def restore(self) -> None:
        pass


def install() -> bool:
    """Patch `triton.language` once per interpreted launch. True when installed (idempotent)."""
    global _installed
    if _installed:
        return True
    try:
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    real_patch = getattr(interp, "_patch_lang", None)
    executor = getattr(interp, "GridExecutor", None)
    if real_patch is None or executor is None or "fn" not in inspect.signature(real_patch).parameters:
        logger.info("Triton's interpreter has no _patch_lang(fn) / GridExecutor here: left as it is")
        return False

    state = threading.local()  # .pending: inside GridExecutor.__call__; .launch: its _Launch
    lang_modules = (tl, tl.core)
    langs_of_fn: dict[Callable, frozenset] = {}

    def langs_of(fn: Callable) -> frozenset:
        langs = langs_of_fn.get(fn)
        if langs is None:
            langs = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in lang_modules)
            langs_of_fn[fn] = langs
        return langs

    def patch_lang(fn: Callable) -> Any:
        launch = getattr(state, "launch", None)
        if launch is None:
            scope = real_patch(fn)
            if getattr(state, "pending", False):  # the launch's own patch: restored by its finally
                state.launch = _Launch(scope, langs_of(fn))
                return state.launch
            return scope  # a jit function called from plain Python: as before
        langs = langs_of(fn)
        if langs <= launch.langs:
            return _Nothing()
        launch.nested.append(real_patch(fn))
        launch.langs |= langs
        return _Nothing()

    real_call = executor.__call__

    @functools.wraps(real_call)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        state.pending, state.launch = True, None
        try:
            return real_call(self, *args, **kwargs)
        finally:
            state.pending, state.launch = False, None

    interp._patch_lang = patch_lang
    executor.__call__ = call
    _installed = True
    return True
