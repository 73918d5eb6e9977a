"""The grammar backend interface (the choice of one, `--grammar-backend`: backends.py).

A backend compiles a `GrammarSpec` against the served tokenizer once (the result is shared by every
request with that spec) and makes a fresh matcher per request: the matcher fills the request's row
of the next-token bitmask (sampling/grammar_mask.py) and accepts the sampled token afterwards.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Protocol

import torch

from sglang.srt.sampling.grammar_spec import GrammarSpec

GRAMMAR_BACKENDS = ("xgrammar", "none")
# The version CI tests (pyproject's `grammar` extra); said in the messages that tell how to enable it.
XGRAMMAR_REQUIREMENT = "xgrammar==0.2.8"


class GrammarError(ValueError):
    """The spec is not a valid regex / JSON schema / EBNF grammar (a user error: a 400)."""


class GrammarMatcher(Protocol):
    """One request's position in its grammar."""

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the tokens allowed next into host int32 `bitmask[row]`; False when every token is
        allowed (the row needs no masking)."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and no change) if the grammar does not allow it."""

    def is_terminated(self) -> bool:
        """Whether the grammar is complete and its stop token accepted: the request ends."""


class GrammarBackend(Protocol):
    name: str

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar (opaque, immutable, shareable); raises GrammarError for a bad spec."""

    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of `compiled`."""

    def size_of(self, compiled: Any) -> int:
        """Bytes the compiled grammar holds (what the compile cache counts)."""


def xgrammar_available() -> bool:
    """Whether xgrammar can be imported (without importing it)."""
    try:
        return importlib.util.find_spec("xgrammar") is not None
    except ValueError:  # sys.modules["xgrammar"] is None: its import is blocked
        return False
