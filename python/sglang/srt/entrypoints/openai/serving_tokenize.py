"""/tokenize and /detokenize (also under /v1, as vLLM serves them): the server's own tokenizer and
chat template, so a client counts tokens exactly as the server will, and reads ids back as text.

Replies carry both engines' field names: `tokens`, `count`, `max_model_len` (vLLM and SGLang) and
`char_count` (SGLang) for /tokenize; `text` (SGLang) and `prompt` (vLLM) for /detokenize. A list
of prompts (or of token lists) gives lists in the same order.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.entrypoints.openai.chat_content import content_chars
from sglang.srt.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from sglang.srt.entrypoints.openai.serving_chat import chat_prompt_ids, template_messages
from sglang.srt.managers.generate_request import InvalidRequestError
from sglang.srt.managers.tokenizer_manager import TokenizerManager


class OpenAIServingTokenize:
    def __init__(self, tokenizer_manager: TokenizerManager) -> None:
        self.tm = tokenizer_manager

    def _check_model(self, model: Any) -> None:
        # Every adapter shares the base model's tokenizer; an unknown name is still a 404.
        if model:
            self.tm.adapter_from_model(model)

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequestError("exactly one of 'prompt' and 'messages' is required", param="prompt")
        if req.tools is not None and req.messages is None:
            raise InvalidRequestError("tools go with messages", param="tools")
        if req.messages is not None:
            messages = template_messages(self.tm, req)
            ids = await chat_prompt_ids(self.tm, req, messages)
            chars = sum(content_chars(m["content"]) for m in messages)
            return self._tokens_reply(req, ids, chars)
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        if not prompts:
            raise InvalidRequestError("prompt must not be an empty list", param="prompt")
        replies = []
        for text in prompts:
            ids = await self.tm.off_loop(lambda: self.tm.encode(text, req.add_special_tokens), len(text))
            replies.append(self._tokens_reply(req, ids, len(text)))
        if isinstance(req.prompt, str):
            return replies[0]
        batch = {key: [r[key] for r in replies] for key in replies[0] if key != "max_model_len"}
        return {**batch, "max_model_len": self.tm.context_len}

    def _tokens_reply(self, req: TokenizeRequest, ids: list[int], chars: int) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": ids, "count": len(ids), "char_count": chars,
                               "max_model_len": self.tm.context_len}
        if req.return_token_strs:
            out["token_strs"] = self.tm.tokenizer.convert_ids_to_tokens(ids)
        return out

    def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self._check_model(req.model)
        if self.tm.tokenizer is None:
            raise InvalidRequestError("this server runs with --skip-tokenizer-init: it has no tokenizer",
                                      param="tokens")
        batch = bool(req.tokens) and isinstance(req.tokens[0], list)
        lists = req.tokens if batch else [req.tokens]
        texts = []
        for ids in lists:
            self.tm.check_token_ids(ids, "tokens")
            texts.append(self.tm.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens))
        text = texts if batch else texts[0]
        return {"text": text, "prompt": text}
