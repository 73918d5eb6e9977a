"""Tool-call parsers (`--tool-call-parser NAME`): the model families' call syntaxes, by name.

Names are SGLang's (`qwen25`, `llama3`, `mistral`) plus vLLM's for the same formats (`hermes`,
`llama3_json`) and SGLang's newer `qwen`.
"""

from __future__ import annotations

from sglang.srt.entrypoints.openai.tool_parsers.base import ParsedCall, ToolCallFormat
from sglang.srt.entrypoints.openai.tool_parsers.hermes import HermesFormat
from sglang.srt.entrypoints.openai.tool_parsers.llama3 import Llama3Format
from sglang.srt.entrypoints.openai.tool_parsers.mistral import MistralFormat
from sglang.srt.entrypoints.openai.tool_parsers.stream import ToolCallStream

TOOL_CALL_PARSERS: dict[str, type[ToolCallFormat]] = {
    "qwen25": HermesFormat,
    "qwen": HermesFormat,
    "hermes": HermesFormat,
    "llama3": Llama3Format,
    "llama3_json": Llama3Format,
    "mistral": MistralFormat,
}


def tool_call_format(name: str) -> ToolCallFormat:
    """The format of `--tool-call-parser NAME` (names are checked when the server starts)."""
    return TOOL_CALL_PARSERS[name]()


__all__ = ["TOOL_CALL_PARSERS", "ParsedCall", "ToolCallFormat", "ToolCallStream", "tool_call_format"]
