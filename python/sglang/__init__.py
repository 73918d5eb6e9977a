"""sglang: a compact LLM serving engine (multi-LoRA serving under CUDA graphs).

`import sglang` stays light: `sglang.Engine` (and its heavy imports: torch, transformers) is loaded
on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Engine", "ServerArgs", "__version__"]

if TYPE_CHECKING:
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.server_args import ServerArgs


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from sglang.srt.entrypoints.engine import Engine

        return Engine
    if name == "ServerArgs":
        from sglang.srt.server_args import ServerArgs

        return ServerArgs
    raise AttributeError(f"module 'sglang' has no attribute {name!r}")
