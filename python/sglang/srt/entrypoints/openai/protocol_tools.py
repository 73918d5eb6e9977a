"""Response models of tool calls on /v1/chat/completions (OpenAI's shapes): `message.tool_calls`
of a reply, and the `delta.tool_calls` of a stream, whose first chunk of a call carries its `id`,
`type` and `function.name` and whose next ones the `function.arguments` text."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, model_serializer


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, serialised


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _Sparse(BaseModel):
    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        # A streamed delta carries only what it adds, as OpenAI's do.
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_Sparse):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(_Sparse):
    index: int  # the call's position among the choice's calls
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: DeltaFunctionCall
