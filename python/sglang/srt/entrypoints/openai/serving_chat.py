"""`POST /v1/chat/completions`: the tokenizer's chat template, `n`, `logprobs`/`top_logprobs`, tool
calls and reasoning (chat_tools.py checks the request's side, chat_output.py parses the reply)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Optional

from fastapi.responses import Response

from sglang.srt.entrypoints.json_text import JSONBody
from sglang.srt.entrypoints.openai.chat_content import (
    ContentFormat,
    content_chars,
    content_for_template,
    template_content_format,
)
from sglang.srt.entrypoints.openai.chat_output import ChatOutputParser, OutputSpec, part_deltas, reply_message
from sglang.srt.entrypoints.openai.chat_tools import (
    message_tool_fields,
    needs_special_tokens,
    output_spec,
    request_plan,
    special_tokens,
    template_tools,
)
from sglang.srt.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobItem,
    ChatLogprobs,
    ChatLogprobTop,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
)
from sglang.srt.entrypoints.openai.serving_base import (
    finish_reason,
    continuous_usage,
    openai_param_names,
    prime,
    reject_unsupported,
    sse,
    streaming_response,
)
from sglang.srt.entrypoints.openai.structured_outputs import add_constraint
from sglang.srt.managers.generate_request import GenerateReqInput, InvalidRequestError
from sglang.srt.managers.tokenizer_manager import TokenizerManager


# OpenAI's roles ("developer" is its newer name for "system"); others are refused, not rendered.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# apply_chat_template's own arguments, which the server sets: not the template's variables.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tokenize", "chat_template", "tools", "documents", "return_dict",
    "return_tensors", "return_assistant_tokens_mask", "tokenizer_kwargs", "padding", "truncation", "max_length",
    "continue_final_message",
})
# The native fields an error of the shared request path may name, as this route calls them.
CHAT_PARAMS = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
               "top_logprobs_num": "top_logprobs", "input_ids": "messages",
               "text": "messages", "prompt": "messages"}


def _message_dicts(req: ChatCompletionRequest, fmt: ContentFormat) -> list[dict[str, Any]]:
    """The request's messages as the chat template takes them (`fmt`: see chat_content)."""
    out = []
    for i, msg in enumerate(req.messages):
        if msg.role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"messages[{i}].role must be one of {list(CHAT_ROLES)}, got {msg.role!r}", param=f"messages[{i}].role"
            )
        content = msg.content
        if content is None and msg.role != "assistant":  # an assistant turn may carry only tool calls
            raise InvalidRequestError(f"messages[{i}].content is required for role {msg.role!r}",
                                      param=f"messages[{i}].content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise InvalidRequestError(
                        f"messages[{i}].content: only text parts are supported, got {kind!r}",
                        param=f"messages[{i}].content",
                    )
                texts.append(part["text"])
            content = content_for_template(texts, fmt)
        item: dict[str, Any] = {"role": msg.role, "content": content if content is not None else ""}
        if msg.name:
            item["name"] = msg.name
        item.update(message_tool_fields(i, msg))
        out.append(item)
    return out


def _developer_as_system(messages: list[dict[str, Any]], template: Any) -> list[dict[str, Any]]:
    """`messages` with "developer" turns renamed "system", unless the chat template names the
    "developer" role itself. Most templates know only "system": Qwen's skip a role they do not know,
    so the instructions would silently never reach the model (sglang#40082); others render a role
    the model was never trained on. vLLM maps the role the same way for such templates."""
    if "developer" in str(template or ""):
        return messages
    return [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]


def template_messages(tm: TokenizerManager, req: Any) -> list[dict[str, Any]]:
    """The request's messages as the server's chat template gets them."""
    template = getattr(tm.tokenizer, "chat_template", None)
    return _developer_as_system(_message_dicts(req, template_content_format(template)), template)


async def chat_prompt_ids(tm: TokenizerManager, req: Any,
                          messages: Optional[list[dict[str, Any]]] = None) -> list[int]:
    """The prompt tokens of a chat request: its messages through the chat template, with
    `add_generation_prompt`, `continue_final_message`, `chat_template_kwargs` and `tools` (unless
    `tool_choice` is "none") (a ChatCompletionRequest, or /tokenize's request, which has the same
    fields). `messages`: template_messages(tm, req), where the caller has them already."""
    kwargs = dict(req.chat_template_kwargs or {})
    reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise InvalidRequestError(f"chat_template_kwargs may not set {reserved}: the server sets them",
                                  param="chat_template_kwargs")
    if req.continue_final_message and req.add_generation_prompt:
        raise InvalidRequestError("add_generation_prompt and continue_final_message cannot both be true",
                                  param="add_generation_prompt")
    add_generation_prompt = (not req.continue_final_message if req.add_generation_prompt is None
                             else req.add_generation_prompt)
    # The request's own fields first; the template's kwargs may override add_generation_prompt.
    kwargs = {"add_generation_prompt": add_generation_prompt, **kwargs}
    if req.continue_final_message:
        kwargs["continue_final_message"] = True
    if messages is None:
        messages = template_messages(tm, req)
    chars = sum(content_chars(m["content"]) for m in messages)
    tools = template_tools(req)
    if tools:
        kwargs["tools"] = tools
        chars += len(json.dumps(tools))
    # The template already holds any BOS token; do not add another.
    return await tm.off_loop(
        lambda: tm.encode(tm.apply_chat_template(messages, **kwargs), add_special_tokens=False), chars)


class OpenAIServingChat:
    def __init__(self, tokenizer_manager: TokenizerManager, tool_call_parser: Optional[str] = None,
                 reasoning_parser: Optional[str] = None) -> None:
        """`tool_call_parser`, `reasoning_parser`: the --tool-call-parser and --reasoning-parser names."""
        self.tm = tokenizer_manager
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self._special_tokens: Optional[frozenset[str]] = None  # the tokenizer's, read on first use

    def _reported(self, cached: int) -> Optional[int]:
        return cached if self.tm.config.enable_cache_report else None

    async def _build(self, req: ChatCompletionRequest) -> tuple[GenerateReqInput, OutputSpec]:
        reject_unsupported(req)
        plan = request_plan(req, self.tool_call_parser, self.reasoning_parser)  # checks tools, tool_choice
        if req.top_logprobs is not None and req.top_logprobs > 0 and not req.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
        if req.top_logprobs is not None and req.top_logprobs > self.tm.config.max_top_logprobs:
            raise InvalidRequestError(
                f"top_logprobs must be at most {self.tm.config.max_top_logprobs}", param="top_logprobs"
            )
        if isinstance(req.lora_path, list):
            raise InvalidRequestError("lora_path must be a string for a chat request", param="lora_path")
        adapter = self.tm.adapter_from_model(req.model, req.lora_path)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        sampling_params = req.sampling_params(max_tokens)
        constraint = await add_constraint(self.tm, req, sampling_params, plan.constraint)  # the tools', or the request's
        spec = output_spec(req, self.tool_call_parser, self.reasoning_parser, plan, constraint)
        input_ids = await chat_prompt_ids(self.tm, req)
        return GenerateReqInput(
            input_ids=input_ids,
            sampling_params=sampling_params,
            return_logprob=req.logprobs,
            top_logprobs_num=(req.top_logprobs or 0) if req.logprobs else 0,
            lora_path=adapter,
            stream=req.stream,
            # n > 1 samples become "<rid>-<j>": /abort_request with the rid aborts them all.
            rid=req.rid,
            cache_salt=req.cache_salt,
        ), spec

    def _keep_special_markers(self, obj: GenerateReqInput, spec: OutputSpec) -> None:
        """Detokenise with the special tokens when the markers the reply is parsed for are special
        tokens (Mistral's [TOOL_CALLS], Llama's <|python_tag|>): skipped, they would vanish."""
        if spec.plain:
            return
        if self._special_tokens is None:
            self._special_tokens = special_tokens(self.tm.tokenizer)
        if needs_special_tokens(spec, self._special_tokens):
            obj.sampling_params["skip_special_tokens"] = False

    def _logprobs(self, req: ChatCompletionRequest, out: dict, start: int = 0) -> Optional[ChatLogprobs]:
        if not req.logprobs:
            return None
        meta = out["meta_info"]
        tops = meta.get("output_top_logprobs") or []
        items = []
        for k, (lp, tid, _) in enumerate(meta.get("output_token_logprobs", [])[start:], start=start):
            token = self.tm.token_text(tid)
            top_items = [
                ChatLogprobTop(token=self.tm.token_text(t), logprob=l, bytes=self.tm.token_bytes(t))
                for l, t, _ in (tops[k] if k < len(tops) and req.top_logprobs else [])
            ]
            items.append(ChatLogprobItem(token=token, logprob=lp, bytes=self.tm.token_bytes(tid),
                                         top_logprobs=top_items))
        return ChatLogprobs(content=items)

    async def handle(self, req: ChatCompletionRequest, raw_request: Any) -> Response:
        # The rid waits from before the grammar's check: an /abort_request during a slow compile holds.
        # Errors about the output budget name the field the client sent (max_completion_tokens wins).
        names = CHAT_PARAMS if req.max_completion_tokens is None else {
            **CHAT_PARAMS, "max_new_tokens": "max_completion_tokens"}
        with openai_param_names(names), self.tm.door(req.rid) as admit:
            obj, spec = await self._build(req)
            self._keep_special_markers(obj, spec)
            req.model = self.tm.response_model_name(req.model)  # what the replies name
            admit()
            if req.stream:
                _, outs = await prime(self.tm.generate(obj, raw_request))
                return streaming_response(self._stream(req, spec, outs), source=outs)
            result = await self.tm.generate_one(obj, raw_request)
        results = result if isinstance(result, list) else [result]
        choices = []
        for i, out in enumerate(results):
            reason, matched = finish_reason(out)
            message = ChatResponseMessage(content=out["text"])
            if not spec.plain:
                parsed = spec.parser().parse(out["text"])
                message = reply_message(parsed)
                if parsed.tool_calls and reason == "stop":
                    reason = spec.calls_finish_reason
            choices.append(ChatChoice(
                index=i, message=message, logprobs=self._logprobs(req, out),
                finish_reason=reason, matched_stop=matched,
            ))
        meta = results[0]["meta_info"]
        completion = sum(r["meta_info"]["completion_tokens"] for r in results)
        usage = UsageInfo.of(meta["prompt_tokens"], completion, self._reported(meta["cached_tokens"]))
        return JSONBody(ChatCompletionResponse(model=req.model, choices=choices, usage=usage).model_dump())

    async def _stream(self, req: ChatCompletionRequest, spec: OutputSpec,
                      outs: AsyncIterator[dict]) -> AsyncIterator[str]:
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())

        continuous = continuous_usage(req)

        def chunk(choice: ChatStreamChoice) -> str:
            usage = None
            if continuous:
                usage = UsageInfo.of(prompt_tokens, sum(completion.values()), self._reported(cached_tokens))
            return sse(ChatCompletionChunk(id=rid, created=created, model=req.model, choices=[choice], usage=usage))

        sent_text: dict[int, int] = {}
        sent_lp: dict[int, int] = {}
        parsers: dict[int, ChatOutputParser] = {}  # when the reply is parsed (not spec.plain)
        sent_calls: dict[int, int] = {}  # the tool calls each choice has streamed
        prompt_tokens = cached_tokens = 0
        completion: dict[int, int] = {}
        async for out in outs:
            index = out.get("index", 0)
            reason, matched = finish_reason(out)
            prompt_tokens = out["meta_info"]["prompt_tokens"]
            if index == 0:
                cached_tokens = out["meta_info"]["cached_tokens"]
            if index not in sent_text:
                sent_text[index] = 0
                completion[index] = 0
                if not spec.plain:
                    parsers[index], sent_calls[index] = spec.parser(), 0
                yield chunk(ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content="")))
            text = out["text"]
            delta = text[sent_text[index]:]
            logprobs = self._logprobs(req, out, start=sent_lp.get(index, 0))
            sent_text[index] = len(text)
            sent_lp[index] = len(out["meta_info"].get("output_token_logprobs", []))
            completion[index] = out["meta_info"]["completion_tokens"]
            if spec.plain:
                deltas = [DeltaMessage(content=delta)] if delta else []
            else:  # held-back markup and whole tool calls: what became final in this step
                parser = parsers[index]
                parts = (parser.feed(delta) if delta else []) + (parser.finish() if reason is not None else [])
                deltas = part_deltas(parts, sent_calls[index])
                sent_calls[index] = parser.num_tool_calls
                if reason == "stop" and parser.num_tool_calls:
                    reason = spec.calls_finish_reason
            if not deltas and reason is None and not (logprobs and logprobs.content):
                continue
            deltas = deltas or [DeltaMessage()]
            for d in deltas[:-1]:
                yield chunk(ChatStreamChoice(index=index, delta=d))
            yield chunk(ChatStreamChoice(
                index=index, delta=deltas[-1], logprobs=logprobs, finish_reason=reason, matched_stop=matched,
            ))
        if req.stream_options is not None and req.stream_options.include_usage:
            usage = UsageInfo.of(prompt_tokens, sum(completion.values()), self._reported(cached_tokens))
            yield sse(ChatCompletionChunk(id=rid, created=created, model=req.model, choices=[], usage=usage))
