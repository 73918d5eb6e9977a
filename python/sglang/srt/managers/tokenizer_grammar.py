"""Constrained requests checked at the door (the tokenizer manager's side of constrained decoding).

Every regex, JSON schema or EBNF grammar is compiled here, against the served tokenizer, before the
request is queued: a bad one is a 400 naming the request's field, never a failure in the scheduler.
Compiles run in a thread of their own (a schema over a large vocabulary takes tens of milliseconds
or more; the GIL is released meanwhile), one at a time, and a spec asked for by several requests
at once is compiled once. The outcome (valid, or the error) is kept per spec in an LRU, so clients
that repeat their schemas pay nothing after the first; the compiled grammar itself is not kept
here (the scheduler compiles and keeps its own).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional, Sequence, Union

from sglang.srt.constrained.backends import create_grammar_backend, how_to_enable
from sglang.srt.constrained.base import GrammarError
from sglang.srt.constrained.cache import GrammarCache
from sglang.srt.managers.generate_request import InvalidRequestError, RequestFailedError
from sglang.srt.sampling.grammar_spec import KIND_NAMES, GrammarSpec

# Outcomes kept: at most this many bytes of spec text (and error messages).
CHECK_CACHE_BYTES = 64 << 20

_VALID = True


class GrammarChecker:
    def __init__(self, backend_name: str, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.backend_name = backend_name
        self.has_tokenizer = tokenizer is not None
        self.backend = (create_grammar_backend(backend_name, tokenizer, vocab_size, stop_token_ids)
                        if tokenizer is not None else None)
        self.cache = GrammarCache(size_of=lambda _outcome: 0, max_bytes=CHECK_CACHE_BYTES)
        self._thread: Optional[ThreadPoolExecutor] = None
        self._pending: dict[GrammarSpec, Future] = {}

    def _refusal(self, spec: GrammarSpec) -> Optional[str]:
        """Why this server cannot constrain at all, or None."""
        if not self.has_tokenizer:
            return (f"constrained decoding ({spec.kind}) needs the tokenizer, and this server runs with "
                    "--skip-tokenizer-init")
        if self.backend is None:
            return (f"constrained decoding ({spec.kind}) is off on this server (--grammar-backend none); "
                    f"to enable it, {how_to_enable()}")
        return None

    def _compile(self, spec: GrammarSpec) -> Union[bool, GrammarError]:
        try:
            self.backend.compile(spec)
        except GrammarError as e:
            return e
        return _VALID

    async def check(self, spec: GrammarSpec, param: str) -> None:
        """Raise InvalidRequestError (400, naming `param`) unless `spec` compiles on this server."""
        refusal = self._refusal(spec)
        if refusal is not None:
            raise InvalidRequestError(refusal, param=param)
        outcome = self.cache.get(spec)
        if outcome is None:
            future = self._pending.get(spec)
            if future is None:
                if self._thread is None:
                    self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-check")
                future = self._pending[spec] = self._thread.submit(self._compile, spec)
            try:
                outcome = await asyncio.wrap_future(future)
            except Exception as e:  # not the spec's fault (the backend failed): a 500 naming it
                raise RequestFailedError(f"internal error while compiling the {KIND_NAMES[spec.kind]}: "
                                         f"{type(e).__name__}: {e}") from None
            finally:
                if self._pending.get(spec) is future:
                    del self._pending[spec]
            self.cache.put(spec, outcome)
        if isinstance(outcome, GrammarError):
            raise InvalidRequestError(f"Invalid {KIND_NAMES[spec.kind]} in '{param}': {outcome}", param=param)
