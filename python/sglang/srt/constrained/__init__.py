"""Constrained decoding (structured outputs): grammar backends and their compile cache.

`base.py` is the interface the managers use (compile a `GrammarSpec`, make a per-request matcher
that fills the next token's bitmask and accepts tokens); `backends.py` is the one place that
chooses and creates a backend; `xgrammar_backend.py` implements it with xgrammar, imported only
when that backend is created, so the engine starts without the package; `cache.py` keeps compiled grammars (and refusals) by spec.
"""
