"""The choice of a grammar backend (`--grammar-backend`): its default, the advice a refused request
gets, and the one place a backend is created (xgrammar imported only then)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from sglang.srt.constrained.base import GRAMMAR_BACKENDS, XGRAMMAR_REQUIREMENT, GrammarBackend, xgrammar_available


def default_grammar_backend() -> str:
    """`--grammar-backend`'s default: xgrammar where it is installed, else none."""
    return "xgrammar" if xgrammar_available() else "none"


def how_to_enable() -> str:
    """The advice a refused constrained request carries."""
    if xgrammar_available():
        return "start the server with --grammar-backend xgrammar"
    return f"install xgrammar (pip install {XGRAMMAR_REQUIREMENT}) and restart the server"


def create_grammar_backend(name: str, tokenizer: Any, vocab_size: int,
                           stop_token_ids: Sequence[int]) -> Optional[GrammarBackend]:
    """The backend `name` for `tokenizer` over the model's `vocab_size` logits (None for "none").
    `stop_token_ids`: the tokens that end a complete grammar (the model's EOS ids)."""
    if name == "none":
        return None
    if name != "xgrammar":
        raise ValueError(f"unknown grammar backend {name!r}; choose one of {list(GRAMMAR_BACKENDS)}")
    # Imported here, not at the top: xgrammar is optional, and only a server that constrains loads it.
    from sglang.srt.constrained.xgrammar_backend import XGrammarBackend

    return XGrammarBackend(tokenizer, vocab_size, stop_token_ids)
