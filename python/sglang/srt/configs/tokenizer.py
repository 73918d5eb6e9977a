"""The tokenizer both processes load: where it is, and the chat template that replaces its own.

The tokenizer manager tokenises and detokenises with it; the scheduler matches stop strings with
it. Both load it from the same `TokenizerSpec`, so they agree on every id.
"""

from __future__ import annotations

import logging
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

from sglang.srt.configs.chat_templates import resolve_chat_template

logger = logging.getLogger(__name__)

# The import behind a tokenizer is seconds of Python that holds the GIL. Any other thread that gives
# the GIL up (a torch op, a file read, a CUDA call) then waits a whole switch interval to win it
# back: 5 ms by default. On this project's CPU machine 8 adapter reads took 0.37 s alone, 47 s
# beside a pure-Python thread at 5 ms, and 1.8 s at 0.5 ms (0.1 ms: the same). So the interval is
# 0.5 ms while a tokenizer loads in the background.
LOAD_SWITCH_INTERVAL_S = 0.0005


@dataclass(frozen=True)
class TokenizerSpec:
    path: str
    trust_remote_code: bool = False
    chat_template: Optional[str] = None  # --chat-template: a Jinja file or a built-in name


def load_tokenizer(spec: TokenizerSpec) -> Any:
    from transformers import AutoTokenizer  # heavy: only where a tokenizer is loaded

    try:
        tokenizer = AutoTokenizer.from_pretrained(spec.path, trust_remote_code=spec.trust_remote_code)
    except Exception as e:  # a missing or broken tokenizer: a configuration to fix, say where we looked
        raise ValueError(
            f"could not load a tokenizer from {spec.path!r} ({type(e).__name__}: {e}). Point --tokenizer-path "
            "at a tokenizer, or pass --skip-tokenizer-init to serve token ids only."
        ) from None
    template = resolve_chat_template(spec.chat_template)
    if template is not None:
        tokenizer.chat_template = template
        logger.info("Chat template: %s (--chat-template)", spec.chat_template)
    return tokenizer


def start_tokenizer_load(spec: Optional[TokenizerSpec]) -> Optional[Future]:
    """load_tokenizer(spec) in a thread of its own, begun now, so that it runs beside the rest of
    start-up (on a GPU host the transformers import behind it takes 6-10 s); None without a spec.
    The Future gives the tokenizer, or raises what load_tokenizer raised. Both processes start
    theirs this way: the tokenizer manager's beside the scheduler's start, the scheduler's beside
    the model runner's weights (the runner waits for it before the adapter reads and the graph
    capture). While it loads, the GIL switch interval is LOAD_SWITCH_INTERVAL_S (restored after)."""
    if spec is None:
        return None
    began = time.perf_counter()
    previous = sys.getswitchinterval()
    lowered = min(previous, LOAD_SWITCH_INTERVAL_S)
    sys.setswitchinterval(lowered)

    def timed_load() -> Any:
        try:
            tokenizer = load_tokenizer(spec)
        finally:
            # Only if nobody changed it since (a second load in the process may have, and restores
            # its own `previous`): the process never keeps the short interval after the loads.
            if sys.getswitchinterval() == lowered:
                sys.setswitchinterval(previous)
        logger.info("Tokenizer loaded in %.1f s, beside the rest of start-up", time.perf_counter() - began)
        return tokenizer

    pool = ThreadPoolExecutor(1, thread_name_prefix="sglang-tokenizer-load")
    try:
        return pool.submit(timed_load)
    finally:
        pool.shutdown(wait=False)  # the thread ends with its one task
