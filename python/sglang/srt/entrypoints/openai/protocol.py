"""Request and response models of the OpenAI-compatible API (completions, chat, models).

Bounds are declared on the fields, so a bad value fails validation with a message that names the
field (`max_tokens: Input should be greater than or equal to 0`). Numbers and booleans must have
their JSON type: pydantic's lax mode would read `"5"` or `true` as 5 and `"yes"` as true, which
hides client bugs (`Int`, `Num`, `Bool` below). Unknown fields are accepted and ignored, as OpenAI
clients send fields this server does not use.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_serializer, model_validator

from sglang.srt.entrypoints.openai.protocol_tools import DeltaToolCall, ToolCall
from sglang.srt.managers.generate_request import MAX_CACHE_SALT_CHARS


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "a string", list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def _number(value: Any) -> Any:
    if isinstance(value, (bool, str)):
        raise ValueError(f"expected a number, not {_json_type(value)}")
    return value


def _boolean(value: Any) -> Any:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, not {_json_type(value)}")
    return value


Int = Annotated[int, BeforeValidator(_number)]
Num = Annotated[float, BeforeValidator(_number)]
Bool = Annotated[bool, BeforeValidator(_boolean)]


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _NullMeansDefault(BaseModel):
    """An explicit JSON null on an optional field means its default, as OpenAI's spec types these
    fields ("boolean or null") and as vLLM reads them: the official client sends null for an
    argument passed as None. A required field keeps its null, so its error names it, and so does
    `max_tokens`, whose null means "until the context" (vLLM's reading)."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if not (v is None and k in fields and k != "max_tokens" and not fields[k].is_required()
                        and fields[k].get_default(call_default_factory=True) is not None)}


class StreamOptions(_NullMeansDefault):
    include_usage: Bool = False
    continuous_usage_stats: Bool = False


class _SamplingFields(_NullMeansDefault):
    """Fields shared by completions and chat, including SGLang's extensions."""

    model_config = ConfigDict(extra="allow")

    model: str = "default"
    n: Int = Field(1, ge=1, le=128)
    temperature: Optional[Num] = Field(None, ge=0.0)
    top_p: Optional[Num] = Field(None, gt=0.0, le=1.0)
    stream: Bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[Int] = None
    presence_penalty: Optional[Num] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[Num] = Field(None, ge=-2.0, le=2.0)
    user: Optional[str] = None
    # Extensions (SGLang / vLLM).
    top_k: Optional[Int] = None
    min_p: Optional[Num] = Field(None, ge=0.0, le=1.0)
    repetition_penalty: Optional[Num] = None
    min_tokens: Optional[Int] = Field(None, ge=0)  # vLLM's and SGLang's name for min_new_tokens
    logit_bias: Optional[dict[str, Num]] = None
    ignore_eos: Bool = False
    stop_token_ids: Optional[list[Int]] = None
    skip_special_tokens: Bool = True
    no_stop_trim: Bool = False
    include_stop_str_in_output: Optional[Bool] = None  # vLLM's: keep the stop string, cut after it
    lora_path: Optional[Union[str, list[Optional[str]]]] = None
    rid: Optional[str] = None
    # Prefix-cache isolation (vLLM's field): KV is reused only between requests with the same salt.
    cache_salt: Optional[str] = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # Structured outputs (OpenAI's; completions too, as vLLM): read by structured_outputs.py with
    # SGLang's and vLLM's extra fields for the same purpose.
    response_format: Optional[Any] = None

    def sampling_params(self, max_new_tokens: Optional[int]) -> dict[str, Any]:
        params: dict[str, Any] = {
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "stop": self.stop,
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "no_stop_trim": self.no_stop_trim,
            "include_stop_str_in_output": bool(self.include_stop_str_in_output),
            "n": self.n,
            # None: until EOS, a stop or the context (chat without max_tokens; an explicit null).
            "max_new_tokens": max_new_tokens,
        }
        for key in ("top_k", "min_p", "stop_token_ids", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "logit_bias"):
            value = getattr(self, key)
            if value is not None:
                params[key] = value
        if self.min_tokens is not None:
            params["min_new_tokens"] = self.min_tokens
        return params


# ---------------------------------------------------------------------------- completions
class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[Int], list[list[Int]]]
    max_tokens: Optional[Int] = Field(16, ge=0)
    logprobs: Optional[Int] = Field(None, ge=0)
    echo: Bool = False
    best_of: Optional[Int] = Field(None, ge=1)
    suffix: Optional[str] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        # One message instead of one per member of the union.
        def ids(x: Any) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(v, list) and len(v) == 0:
            raise ValueError("prompt must not be an empty list")
        if not (isinstance(v, str) or ids(v) or (isinstance(v, list) and (
                all(isinstance(p, str) for p in v) or all(ids(p) for p in v)))):
            raise ValueError("prompt must be a string, a list of strings, a list of token ids (integers) "
                             "or a list of such lists")
        return v


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Union[None, int, str] = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None

    @classmethod
    def of(cls, prompt: int, completion: int, cached: Optional[int]) -> "UsageInfo":
        """`cached` None: no prompt_tokens_details (a server without --enable-cache-report)."""
        details = None if cached is None else PromptTokensDetails(cached_tokens=cached)
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   prompt_tokens_details=details)


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


# ---------------------------------------------------------------------------- chat
class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None
    # Tool calling (checked by chat_tools.message_tool_fields).
    tool_calls: Optional[list[Any]] = None  # an assistant's calls
    tool_call_id: Optional[str] = None  # a tool result's call
    reasoning_content: Optional[str] = None  # an assistant's past reasoning (Qwen3's template reads it)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[Int] = Field(None, ge=0)
    max_completion_tokens: Optional[Int] = Field(None, ge=0)
    logprobs: Bool = False
    top_logprobs: Optional[Int] = Field(None, ge=0)  # at most --max-top-logprobs (serving_chat)
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    continue_final_message: Bool = False
    add_generation_prompt: Optional[Bool] = None  # vLLM's extension; unset: not continue_final_message
    # Tool calling and reasoning (chat_tools.py; tools and tool_choice are checked there).
    parallel_tool_calls: Optional[Bool] = None  # false: the first call only
    separate_reasoning: Bool = True  # SGLang's: false keeps the reasoning in the content
    stream_reasoning: Bool = True  # SGLang's: false sends the reasoning in one piece when it ends


class ChatLogprobTop(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatLogprobItem(ChatLogprobTop):
    top_logprobs: list[ChatLogprobTop] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobItem] = Field(default_factory=list)


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Union[None, int, str] = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Optional[UsageInfo] = None


class DeltaMessage(BaseModel):
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        # A delta carries only what changed, as OpenAI's does ({"content": "..."}).
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Union[None, int, str] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[UsageInfo] = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


# ---------------------------------------------------------------------------- models
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "sglang"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ---------------------------------------------------------------------------- tokenize / detokenize
class TokenizeRequest(BaseModel):
    """/tokenize (SGLang) and /v1/tokenize (vLLM): a prompt, a list of prompts, or chat messages
    (then the ids a chat request with the same fields would be served with)."""

    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None
    prompt: Optional[Union[str, list[str]]] = None
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1)
    add_special_tokens: Bool = True  # prompts only: a chat template holds its own special tokens
    add_generation_prompt: Optional[Bool] = None
    continue_final_message: Bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[Any]] = None  # with messages: rendered as a chat request with them renders them
    return_token_strs: Bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None
    tokens: Union[list[Int], list[list[Int]]]
    skip_special_tokens: Bool = True
