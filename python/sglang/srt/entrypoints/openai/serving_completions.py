"""`POST /v1/completions`: prompts (text or token ids, single or batch), `n`, `echo`, `logprobs`."""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, Callable, Optional

from fastapi.responses import Response

from sglang.srt.entrypoints.json_text import JSONBody
from sglang.srt.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
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


# The native fields an error of the shared request path may name, as this route calls them.
COMPLETION_PARAMS = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
                     "top_logprobs_num": "logprobs", "input_ids": "prompt",
                     "text": "prompt"}


class OpenAIServingCompletion:
    def __init__(self, tokenizer_manager: TokenizerManager) -> None:
        self.tm = tokenizer_manager

    # ------------------------------------------------------------------ request
    def _build(self, req: CompletionRequest) -> tuple[GenerateReqInput, list[str], int]:
        reject_unsupported(req)
        if req.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise InvalidRequestError("best_of is not supported (it must equal n)", param="best_of")
        if req.logprobs is not None and req.logprobs > self.tm.config.max_top_logprobs:
            raise InvalidRequestError(
                f"logprobs must be at most {self.tm.config.max_top_logprobs}, got {req.logprobs}",
                param="logprobs",
            )
        adapter = self.tm.adapter_from_model(req.model, req.lora_path)
        prompt = req.prompt
        text: Optional[list[str]] = None
        ids: Optional[list[list[int]]] = None
        # One prompt (a string, or one list of token ids) is not a batch: its rid R runs as R, and
        # its n > 1 samples as, ... (as /generate and chat run them), so that
        # /abort_request R-1 finds sample 1. As a batch of one they ran as R-0-0, R-0-1.
        single = isinstance(prompt, str) or bool(prompt) and all(isinstance(p, int) for p in prompt)
        if isinstance(prompt, str):
            text = [prompt]
        elif all(isinstance(p, str) for p in prompt):
            text = list(prompt)
        elif all(isinstance(p, int) for p in prompt):
            ids = [list(prompt)]
        else:
            ids = [list(p) for p in prompt]
        for p in ids or ():
            self.tm.check_token_ids(p, "prompt")  # named as this route calls it, and before decode() below
        num_prompts = len(text if text is not None else ids)
        if isinstance(adapter, list) and len(adapter) != num_prompts:
            raise InvalidRequestError(
                f"lora_path has {len(adapter)} entries but there are {num_prompts} prompts", param="lora_path"
            )
        want_lp = req.logprobs is not None
        obj = GenerateReqInput(
            text=text[0] if single and text is not None else text,
            input_ids=ids[0] if single and ids is not None else ids,
            sampling_params=req.sampling_params(req.max_tokens),
            return_logprob=want_lp,
            logprob_start_len=0 if (want_lp and req.echo) else -1,
            top_logprobs_num=req.logprobs or 0,
            lora_path=adapter,
            stream=req.stream,
            # A batch's prompts become "<rid>-<i>" and n > 1 samples "<rid>-<j>": /abort_request
            # with the rid aborts them all.
            rid=req.rid or None,
            cache_salt=req.cache_salt,
        )
        if text is not None:
            prompt_texts = text
        elif (req.echo or want_lp) and self.tm.tokenizer is not None:
            # Token-id prompts are decoded only for what reads their text (echo, logprobs' offsets).
            prompt_texts = [self.tm.tokenizer.decode(p) for p in ids]
        else:
            prompt_texts = [""] * num_prompts
        return obj, prompt_texts, num_prompts

    # ------------------------------------------------------------------ logprobs
    def _logprobs(self, entries: list, tops: Optional[list], text_start: int) -> CompletionLogprobs:
        out = CompletionLogprobs()
        offset = text_start
        for k, (lp, tid, _) in enumerate(entries):
            token = self.tm.token_text(tid)
            out.tokens.append(token)
            out.token_logprobs.append(lp)
            out.text_offset.append(offset)
            offset += len(token)
            top = tops[k] if tops is not None and k < len(tops) else None
            out.top_logprobs.append(None if top is None else top_logprobs_entry(top, self.tm.token_text))
        return out

    def _choice_logprobs(self, req: CompletionRequest, out: dict, prompt_text: str, echo_part: bool,
                         out_start: int = 0, text_start: int = 0) -> Optional[CompletionLogprobs]:
        if req.logprobs is None:
            return None
        meta = out["meta_info"]
        want_top = req.logprobs > 0
        entries: list = []
        tops: list = []
        if echo_part:
            entries += meta.get("input_token_logprobs", [])
            tops += meta.get("input_top_logprobs", []) if want_top else []
        entries += meta.get("output_token_logprobs", [])[out_start:]
        tops += meta.get("output_top_logprobs", [])[out_start:] if want_top else []
        return self._logprobs(entries, tops if want_top else None, text_start)

    # ------------------------------------------------------------------ handlers
    async def handle(self, req: CompletionRequest, raw_request: Any) -> Response:
        # The rid waits from before the grammar's check: an /abort_request during a slow compile holds.
        with openai_param_names(COMPLETION_PARAMS), self.tm.door(req.rid or None) as admit:
            obj, prompt_texts, num_prompts = self._build(req)
            await add_constraint(self.tm, req, obj.sampling_params)
            req.model = self.tm.response_model_name(req.model)  # what the replies name
            admit()
            if req.stream:
                _, outs = await prime(self.tm.generate(obj, raw_request))
                return streaming_response(self._stream(req, outs, prompt_texts), source=outs)
            result = await self.tm.generate_one(obj, raw_request)
        results = result if isinstance(result, list) else [result]
        choices = []
        for i, out in enumerate(results):
            reason, matched = finish_reason(out)
            prompt_text = prompt_texts[i // req.n]
            text = (prompt_text + out["text"]) if req.echo else out["text"]
            choices.append(CompletionChoice(
                index=i, text=text, finish_reason=reason, matched_stop=matched,
                # Offsets count from the start of the prompt, as OpenAI's do.
                logprobs=self._choice_logprobs(req, out, prompt_text, req.echo,
                                               text_start=0 if req.echo else len(prompt_text)),
            ))
        usage = _usage(results, req.n, self.tm.config.enable_cache_report)
        return JSONBody(CompletionResponse(model=req.model, choices=choices, usage=usage).model_dump())

    async def _stream(self, req: CompletionRequest, outs: AsyncIterator[dict],
                      prompt_texts: list[str]) -> AsyncIterator[str]:
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        sent_text: dict[int, int] = {}
        sent_lp: dict[int, int] = {}
        # Each choice's next token offset: the last one's plus its text's length, as the whole
        # reply counts them (the text sent so far lags it while a stop string or a partial
        # character is held back).
        next_offset: dict[int, int] = {}
        finals: dict[int, dict] = {}
        latest: dict[int, dict] = {}  # each choice's last news, for continuous usage
        continuous = continuous_usage(req)
        async for out in outs:
            index = out.get("index", 0)
            reason, matched = finish_reason(out)
            first = index not in sent_text
            text = out["text"]
            delta = text[sent_text.get(index, 0):]
            n_lp = len(out["meta_info"].get("output_token_logprobs", []))
            logprobs = None
            if req.logprobs is not None:
                prompt_text = prompt_texts[index // req.n]
                start = next_offset.get(index, 0 if req.echo else len(prompt_text))
                logprobs = self._choice_logprobs(req, out, prompt_text, req.echo and first,
                                                 out_start=sent_lp.get(index, 0), text_start=start)
                if logprobs.tokens:
                    next_offset[index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
            if first and req.echo:
                delta = prompt_texts[index // req.n] + delta
            sent_text[index] = len(text)
            sent_lp[index] = n_lp
            latest[index] = out
            if not delta and reason is None and not (logprobs and logprobs.tokens):
                continue
            choice = CompletionChoice(index=index, text=delta, logprobs=logprobs, finish_reason=reason,
                                      matched_stop=matched)
            usage = None
            if continuous:
                usage = _usage(list(latest.values()), 1, self.tm.config.enable_cache_report, prompts_of=req.n)
            yield sse(CompletionChunk(id=rid, created=created, model=req.model, choices=[choice], usage=usage))
            if reason is not None:
                finals[index] = out
        if req.stream_options is not None and req.stream_options.include_usage:
            results = [finals[i] for i in sorted(finals)]
            yield sse(CompletionChunk(id=rid, created=created, model=req.model, choices=[],
                                      usage=_usage(results, req.n, self.tm.config.enable_cache_report)))


def top_logprobs_entry(top: list, token_text: Callable[[int], str]) -> dict[str, float]:
    """One position's `top_logprobs` object ({token text: logprob}) from its (logprob, id, _)
    entries, likeliest first. Tokens that decode to the same text (e.g. two pieces of UTF-8
    characters, both U+FFFD alone) share a key: the likeliest keeps it."""
    entry: dict[str, float] = {}
    for lp, tid, _ in top:
        entry.setdefault(token_text(tid), lp)
    return entry


def _usage(results: list[dict], n: int, report_cached: bool, prompts_of: int = 0) -> UsageInfo:
    """Usage of `results`, every n-th one starting a prompt; with `prompts_of` = n instead, the
    results are those of the choices begun so far (any subset), their prompt read from the index."""
    # A prompt sampled n times is counted once, as OpenAI does.
    firsts = results[::n]
    if prompts_of:
        by_prompt = {r.get("index", 0) // prompts_of: r for r in results}
        firsts = list(by_prompt.values())
    prompt = sum(r["meta_info"]["prompt_tokens"] for r in firsts)
    cached = sum(r["meta_info"]["cached_tokens"] for r in firsts)
    completion = sum(r["meta_info"]["completion_tokens"] for r in results)
    return UsageInfo.of(prompt, completion, cached if report_cached else None)
