"""Tool-call parsers (`--tool-call-parser NAME`): the model families' call syntaxes, by name.

Names are SGLang's (`qwen25`, `llama3`, `mistral`, `qwen3_coder`) plus vLLM's for the same formats
(`hermes`, `llama3_json`) and SGLang's newer `qwen`.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from sglang.srt.entrypoints.openai.tool_parsers.base import CallArguments, CallStart, ParsedCall, ToolCallFormat
from sglang.srt.entrypoints.openai.tool_parsers.hermes import HermesFormat
from sglang.srt.entrypoints.openai.tool_parsers.llama3 import Llama3Format
from sglang.srt.entrypoints.openai.tool_parsers.mistral import MistralFormat
from sglang.srt.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderFormat
from sglang.srt.entrypoints.openai.tool_parsers.stream import ToolCallStream

TOOL_CALL_PARSERS: dict[str, type[ToolCallFormat]] = {
    "qwen25": HermesFormat,
    "qwen": HermesFormat,
    "hermes": HermesFormat,
    "llama3": Llama3Format,
    "llama3_json": Llama3Format,
    "mistral": MistralFormat,
    "qwen3_coder": Qwen3CoderFormat,
}


def tool_call_format(name: str, tools: Optional[Sequence[Mapping[str, Any]]] = None) -> ToolCallFormat:
    """The format of `--tool-call-parser NAME` (names are checked when the server starts), for a
    request with these (checked) `tools`: qwen3_coder types its arguments by their schemas."""
    return TOOL_CALL_PARSERS[name](tools)


__all__ = ["TOOL_CALL_PARSERS", "CallArguments", "CallStart", "ParsedCall", "ToolCallFormat", "ToolCallStream",
           "tool_call_format"]
