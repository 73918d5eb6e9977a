"""The bad-input matrix of test_bad_input.py: one `Case` per request, grouped by endpoint.

Each case is one request and the reply it must get: a status (4xx, or 200 for inputs the server
must accept) and a piece of text the error message must contain, so a vague message fails too.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional

import requests

API_KEY = "sk-reliability"
NAN, INF = float("nan"), float("inf")
GEN = ("/generate", "/v1/completions", "/v1/chat/completions")
LOAD = ("/load_lora_adapter", "/v1/load_lora_adapter")
UNLOAD = ("/unload_lora_adapter", "/v1/unload_lora_adapter")
MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
TOOL_TURN = MSG + [{"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}]
TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error"}


@dataclass
class Case:
    path: str
    body: Any  # a JSON value, or str/bytes sent as they are
    status: int
    needle: str  # must appear in the error message (case-insensitive)
    method: str = "POST"
    headers: Optional[dict] = None

    def send(self, url: str) -> requests.Response:
        if isinstance(self.body, (str, bytes)):
            data = self.body
        else:
            data = json.dumps(self.body)  # allow_nan: NaN / Infinity are sent as JS literals
        return requests.request(self.method, f"{url}{self.path}", data=data, headers=self.headers or {},
                                timeout=60)

    def __str__(self) -> str:
        body = self.body if isinstance(self.body, (str, bytes)) else json.dumps(self.body)
        return f"{self.method} {self.path} {body[:90]!r}"


# ---------------------------------------------------------------------------- the matrix
def body_cases() -> list[Case]:
    """Bodies that are not a JSON object, on every POST endpoint."""
    out = []
    for path in GEN + LOAD + UNLOAD + ("/abort_request", "/debug/inject_fault"):
        out += [
            Case(path, '{"text": "hi"', 400, "not valid JSON"),
            Case(path, "", 400, "not valid JSON"),
            Case(path, b"\xff\xfe\x00{\x80}", 400, "not valid JSON"),
            Case(path, "[" * 100_000 + "]" * 100_000, 400, "nested too deeply"),
            Case(path, [1, 2], 400, "object"),
            Case(path, "null", 400, "object"),
        ]
    return out


def generate_cases() -> list[Case]:
    def g(body: dict, needle: str, status: int = 400) -> Case:
        return Case("/generate", body, status, needle)

    def sp(params: dict, needle: str) -> Case:
        return g({"text": "hi", "sampling_params": params}, needle)

    return [
        g({}, "exactly one of 'text' and 'input_ids'"),
        g({"text": "hi", "input_ids": [1]}, "exactly one of 'text' and 'input_ids'"),
        g({"text": 5}, "'text' must be a string"),
        g({"text": ["a", 5]}, "'text' must be a string"),
        g({"text": ""}, "prompt is empty"),
        g({"text": []}, "the batch is empty"),
        g({"input_ids": []}, "'input_ids' must be a non-empty list"),
        g({"input_ids": [[5, 6], []]}, "prompt is empty"),
        g({"input_ids": [-1]}, "outside the vocabulary"),
        g({"input_ids": [10**30]}, "outside the vocabulary"),
        g({"input_ids": [1.5]}, "'input_ids' must be"),
        g({"input_ids": [True]}, "'input_ids' must be"),
        g({"input_ids": [[[1]]]}, "'input_ids' must be"),
        g({"input_ids": [[7]] * 5000}, "at most 4096"),
        g({"input_ids": [7] * 5000}, "context length"),
        g({"text": "hi " * 3000}, "context length"),
        g({"text": "a\ud800b"}, "not valid Unicode"),
        g({"text": "hi", "sampling_params": "greedy"}, "'sampling_params' has an invalid value"),
        g({"text": ["a", "b"], "sampling_params": [{}]}, "has 1 entries but the batch has 2"),
        sp({"max_new_tokens": -1}, "max_new_tokens"),
        sp({"max_new_tokens": 10**12}, "exceeds the model's maximum context length"),
        sp({"max_new_tokens": "10"}, "max_new_tokens"),
        sp({"max_new_tokens": True}, "max_new_tokens"),
        sp({"max_new_tokens": 2.5}, "max_new_tokens"),
        sp({"max_new_tokens": NAN}, "max_new_tokens"),
        sp({"temperature": NAN}, "temperature"),
        sp({"temperature": INF}, "temperature must be a finite number"),
        sp({"temperature": -INF}, "temperature"),
        sp({"temperature": "hot"}, "temperature"),
        sp({"temperature": True}, "temperature"),
        sp({"top_p": 0}, "top_p"),
        sp({"top_p": NAN}, "top_p"),
        sp({"top_k": 0}, "top_k"),
        sp({"top_k": 1.5}, "top_k"),
        sp({"top_k": "3"}, "top_k"),
        sp({"min_p": 2}, "min_p"),
        sp({"seed": "x"}, "seed"),
        sp({"seed": 1.5}, "seed"),
        sp({"n": 10**6}, "at most 128"),
        sp({"n": 0}, "n must be a positive integer"),
        sp({"n": "2"}, "n must be a positive integer"),
        sp({"stop": 5}, "stop must be a string"),
        sp({"stop_token_ids": [-1]}, "outside the vocabulary"),
        sp({"stop_token_ids": "x"}, "stop_token_ids"),
        sp({"frequency_penalty": 3}, "frequency_penalty must be a number in [-2, 2]"),
        sp({"repetition_penalty": -1}, "repetition_penalty must be in (0, 2]"),
        sp({"min_new_tokens": 200, "max_new_tokens": 4}, "must not exceed max_new_tokens"),
        sp({"logit_bias": {"99999999": 1}}, "logit_bias: token id 99999999 is outside the vocabulary"),
        sp({"logit_bias": {"1": 1e9}}, "must be a number in [-100, 100]"),
        sp({"beam_width": 4}, "unknown field"),
        # Constrained decoding: a spec that does not compile is refused before anything is queued.
        sp({"regex": "[a-"}, "Invalid regex in 'regex': Regex parsing error"),
        sp({"regex": 5}, "regex must be a string"),
        sp({"json_schema": "{bad"}, "Invalid JSON schema in 'json_schema'"),
        sp({"json_schema": {"type": "foo"}}, "Unsupported type"),
        sp({"json_schema": ["x"]}, "json_schema must be a JSON string or an object"),
        sp({"ebnf": "root ::="}, "Invalid EBNF grammar in 'ebnf'"),
        sp({"ebnf": 'start ::= "a"'}, 'root rule with name "root" is not found'),
        sp({"regex": "a", "json_schema": "{}"}, "only one of regex, json_schema, ebnf and structural_tag"),
        sp({"structural_tag": "{}"}, "Invalid structural tag in 'structural_tag': Structural tag must have a format"),
        sp({"structural_tag": {"type": "structural_tag", "format": {"type": "foo"}}}, "Format type not recognized"),
        sp({"structural_tag": 5}, "structural_tag must be a JSON string or an object"),
        g({"text": "hi", "sampling_params": {"regex": "[0-9]{2}", "max_new_tokens": 4}}, "", 200),
        g({"text": "hi", "sampling_params": {"json_schema": {"type": "object"}, "max_new_tokens": 2}}, "", 200),
        g({"text": "hi", "sampling_params": {"max_new_tokens": 2, "structural_tag": {
            "type": "structural_tag", "format": {"type": "const_string", "value": "ok"}}}}, "", 200),
        g({"text": "hi", "return_logprob": "yes"}, "return_logprob"),
        g({"text": "hi", "logprob_start_len": -5}, "logprob_start_len"),
        g({"text": "hi", "logprob_start_len": "0"}, "logprob_start_len"),
        g({"text": "hi", "return_logprob": True, "top_logprobs_num": 1000}, "at most 20"),
        g({"text": "hi", "top_logprobs_num": -1}, "top_logprobs_num"),
        g({"text": "hi", "top_logprobs_num": True}, "top_logprobs_num"),
        g({"text": "hi", "lora_path": 5}, "lora_path"),
        g({"text": "hi", "lora_path": "nope"}, "not loaded: nope"),
        g({"text": ["a", "b"], "lora_path": ["keep"]}, "has 1 entries"),
        g({"text": "hi", "rid": 5}, "'rid'"),
        g({"text": "hi", "rid": ""}, "'rid'"),
        g({"text": "hi", "rid": ["a"]}, "'rid' must be a string"),
        g({"text": ["a", "b"], "rid": ["q-1", "q"], "sampling_params": [{}, {"n": 2}]}, "also after n > 1"),
        g({"text": "hi", "lora_path": ""}, "'lora_path' has an invalid value"),
        sp({"skip_special_tokens": "no"}, "skip_special_tokens must be a boolean"),
        sp({"no_stop_trim": "no"}, "no_stop_trim must be a boolean"),
        g({"text": "hi", "stream": "yes"}, "'stream' must be a boolean"),
        g({"text": "hi", "stream": True, "sampling_params": {"top_p": 0}}, "top_p"),
        g({"text": "hi", "priority": 1}, "unknown field"),
        g({"text": "hi", "cache_salt": 5}, "'cache_salt' must be a non-empty string"),
        g({"text": "hi", "cache_salt": ""}, "'cache_salt' must be a non-empty string"),
        g({"text": "hi", "cache_salt": "s" * 513}, "at most 512 characters, got str of 513"),
        g({"text": "hi", "cache_salt": {"tenant": 1}}, "'cache_salt'"),
        g({"text": ["a", "b"], "cache_salt": ["s", 7]}, "'cache_salt'"),
        g({"text": ["a", "b"], "cache_salt": ["s"]}, "'cache_salt' has 1 entries"),
        g({"text": "hi", "cache_salt": "s" * 512, "sampling_params": {"max_new_tokens": 1}}, "", 200),
        # A seed past 64 bits would alias a smaller one (the sampler keys by 64 bits): refused.
        g({"text": "hi", "sampling_params": {"seed": -(10**40), "max_new_tokens": 2}}, "64-bit signed integer"),
        g({"text": "hi", "sampling_params": {"seed": 2**64 + 5, "max_new_tokens": 2}}, "64-bit signed integer"),
        g({"text": "hi", "sampling_params": {"seed": -(2**63), "max_new_tokens": 2}}, "", 200),
        # A rid with a lone surrogate (a "\udcff" escape) is echoed back in a body that still encodes.
        g({"text": "hi", "rid": "r\udcff", "sampling_params": {"max_new_tokens": 1}}, "", 200),
        # Accepted: beyond-vocabulary top_k means no top-k; huge starts are clamped.
        g({"text": "hi", "sampling_params": {"top_k": 10**30, "max_new_tokens": 2}}, "", 200),
        g({"text": "hi", "return_logprob": True, "logprob_start_len": 10**12,
           "sampling_params": {"max_new_tokens": 1}}, "", 200),
    ]


def completion_cases() -> list[Case]:
    def c(extra: dict, needle: str, status: int = 400, prompt: Any = "hi") -> Case:
        body = {"model": "default", "prompt": prompt, **extra}
        if prompt is None:
            body.pop("prompt")
        return Case("/v1/completions", body, status, needle)

    return [
        c({}, "'prompt' is a required field", prompt=None),
        c({}, "prompt must be a string", prompt=5),
        c({}, "prompt must not be an empty list", prompt=[]),
        c({}, "prompt is empty", prompt=""),
        c({}, "prompt is empty", prompt=[[5], []]),
        c({}, "prompt must be a string", prompt=[1.5]),
        c({}, "prompt must be a string", prompt=[True]),
        c({}, "prompt must be a string", prompt=[1, "a"]),
        c({}, "at most 4096", prompt=[[7]] * 5000),
        c({}, "context length", prompt="hi " * 3000),
        c({}, "not valid Unicode", prompt="a\ud800b"),
        c({"n": 10**6}, "n: Input should be less than or equal to 128"),
        c({"n": 0}, "n:"),
        c({"n": True}, "n: expected a number, not a boolean"),
        c({"max_tokens": 10**12}, "exceeds the model's maximum context length"),
        c({"max_tokens": -1}, "max_tokens"),
        c({"max_tokens": "ten"}, "max_tokens: expected a number, not a string"),
        c({"max_tokens": True}, "max_tokens: expected a number, not a boolean"),
        c({"max_tokens": NAN}, "max_tokens"),
        c({"max_tokens": 1.5}, "max_tokens"),
        c({"temperature": NAN}, "temperature"),
        c({"temperature": INF}, "temperature must be a finite number"),
        c({"temperature": -0.5}, "temperature"),
        c({"temperature": "0.5"}, "temperature: expected a number"),
        c({"top_p": 0}, "top_p"),
        c({"top_p": INF}, "top_p"),
        c({"logprobs": -1}, "logprobs"),
        c({"logprobs": 1000}, "logprobs must be at most 20"),
        c({"logprobs": "2"}, "logprobs: expected a number"),
        c({"echo": "yes"}, "echo: expected true or false"),
        c({"stream": 1}, "stream: expected true or false"),
        c({"stream_options": 5}, "stream_options"),
        c({"seed": "3"}, "seed: expected a number"),
        c({"seed": 2**64}, "seed must be a 64-bit signed integer"),
        c({"stop": 5}, "stop"),
        c({"top_k": 0}, "top_k"),
        c({"min_p": -1}, "min_p"),
        c({"presence_penalty": 2.5}, "presence_penalty"),
        c({"repetition_penalty": NAN}, "repetition_penalty"),
        c({"repetition_penalty": 0}, "repetition_penalty must be in (0, 2]"),
        c({"logit_bias": {"abc": 5}}, "logit_bias: key 'abc' is not a token id"),
        c({"logit_bias": {"1": "5"}}, "logit_bias.1: expected a number"),
        c({"logit_bias": {"1": 101}}, "must be a number in [-100, 100]"),
        c({"best_of": 3}, "best_of"),
        c({"suffix": "x"}, "suffix"),
        c({}, "prompt: token id -5 is outside the vocabulary", prompt=[1, -5]),
        c({}, "outside the vocabulary", prompt=[[1], [2**40]]),
        c({"min_tokens": -1}, "min_tokens"),
        c({"min_tokens": 40, "max_tokens": 4}, "min_tokens (40) must not exceed max_tokens (4)"),
        c({"min_new_tokens": 4}, "the OpenAI routes take min_tokens"),
        c({"use_beam_search": True}, "beam search is not supported"),
        c({"use_beam_search": "false"}, "use_beam_search must be a boolean"),
        c({"use_beam_search": False, "length_penalty": 1.0, "bad_words": []}, "", 200),
        c({"length_penalty": 0.5}, "length_penalty"),
        c({"allowed_token_ids": [1, 2]}, "allowed_token_ids is not supported"),
        c({"prompt_logprobs": 1}, "echo with logprobs"),
        c({"truncate_prompt_tokens": 4}, "truncate_prompt_tokens is not supported"),
        c({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output: expected true or false"),
        c({"regex": "a+", "max_tokens": 2}, "", 200),
        c({"guided_json": {"type": "object"}, "max_tokens": 2}, "", 200),
        c({"response_format": {"type": "json_object"}, "max_tokens": 2}, "", 200),
        c({"guided_choice": ["yes", "no"], "max_tokens": 4}, "", 200),
        c({"guided_regex": "a{2,1}"}, "Invalid regex in 'guided_regex'"),
        c({"guided_json": '{"type": "object", "properties": '}, "Invalid JSON schema in 'guided_json'"),
        c({"guided_grammar": "root ::= "}, "Invalid EBNF grammar in 'guided_grammar'"),
        c({"guided_choice": []}, "guided_choice must be a non-empty list of strings"),
        c({"guided_choice": "yes"}, "guided_choice must be a non-empty list of strings"),
        c({"guided_regex": 5}, "guided_regex must be a string"),
        c({"regex": "a", "guided_json": {}}, "only one structured-output constraint"),
        c({"structured_outputs": {"json": {}, "regex": "a"}}, "json and regex"),
        c({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}}, "disable_any_whitespace is not supported"),
        c({"structured_outputs": "json"}, "structured_outputs must be an object"),
        c({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "'outlines' is not available"),
        c({"guided_decoding_backend": "xgrammar", "guided_regex": "a", "max_tokens": 1}, "", 200),
        c({"structural_tag": "{}"}, "Invalid structural tag in 'structural_tag': Structural tag must have a format"),
        c({"structural_tag": {"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}], "triggers": ["<b"]}},
          "One tag does not match any trigger"),
        c({"structured_outputs": {"structural_tag": {"structures": [], "triggers": ["<"]}}},
          "structured_outputs.structural_tag.structures must be a non-empty list"),
        c({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern is not supported"),
        c({"response_format": {"type": "yaml"}}, "response_format type must be"),
        c({"stream_options": {"include_usage": True}}, "only allowed when stream is true"),
        c({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "", 200),
        c({"stream": True, "stream_options": {"continuous_usage_stats": "yes"}}, "continuous_usage_stats"),
        c({"model": 5}, "model"),
        c({"model": "nope"}, "does not exist", 404),
        c({"model": "default:nope"}, "not loaded: nope", 404),
        c({"lora_path": "nope"}, "not loaded: nope", 404),
        c({"lora_path": ["keep", None]}, "lora_path has 2 entries"),
        # An empty adapter name is a malformed value (400, as on /generate), not an unknown model.
        c({"lora_path": ""}, "'lora_path' has an invalid value"),
        c({"lora_path": ["keep", ""]}, "'lora_path' has an invalid value", prompt=["a", "b"]),
        c({"cache_salt": 5}, "cache_salt: Input should be a valid string"),
        c({"cache_salt": "s" * 513}, "cache_salt: String should have at most 512 characters"),
        c({"cache_salt": ""}, "cache_salt: String should have at least 1 character"),
        c({"max_tokens": 1, "cache_salt": "tenant"}, "", 200),
        c({"max_tokens": 2, "top_k": 10**30, "temperature": 0}, "", 200),
    ]


def chat_cases() -> list[Case]:
    def ch(extra: dict, needle: str, status: int = 400, messages: Any = MSG) -> Case:
        body = {"model": "default", "messages": messages, **extra}
        if messages is None:
            body.pop("messages")
        return Case("/v1/chat/completions", body, status, needle)

    return [
        ch({}, "'messages' is a required field", messages=None),
        ch({}, "messages", messages=[]),
        ch({}, "messages", messages="hi"),
        ch({}, "messages", messages=[5]),
        ch({}, "messages.0.role", messages=[{"content": "hi"}]),
        ch({}, "must be one of", messages=[{"role": "wizard", "content": "hi"}]),
        ch({}, "messages.0.content", messages=[{"role": "user", "content": 5}]),
        ch({}, "only text parts", messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        ch({}, "only text parts", messages=[{"role": "user", "content": [{"type": "text"}]}]),
        ch({}, "not valid Unicode", messages=[{"role": "user", "content": "a\ud800b"}]),
        ch({}, "context length", messages=[{"role": "user", "content": "hi " * 3000}]),
        ch({"n": 10**6}, "n: Input should be less than or equal to 128"),
        ch({"max_tokens": 10**12}, "exceeds the model's maximum context length"),
        ch({"max_completion_tokens": -1}, "max_completion_tokens"),
        ch({"max_tokens": False}, "max_tokens: expected a number, not a boolean"),
        ch({"temperature": INF}, "temperature must be a finite number"),
        ch({"temperature": NAN}, "temperature"),
        ch({"top_logprobs": 1000, "logprobs": True}, "top_logprobs must be at most 20"),
        ch({"top_logprobs": -1, "logprobs": True}, "top_logprobs"),
        ch({"top_logprobs": 2}, "requires logprobs"),
        # Tool calling (this server has no --tool-call-parser): definitions and tool_choice are
        # checked first, then the missing parser is named; tool_choice "none" needs none.
        ch({"tools": [TOOL]}, "start the server with --tool-call-parser"),
        ch({"tools": [TOOL], "tool_choice": "auto"}, "start the server with --tool-call-parser"),
        ch({"tools": [TOOL], "tool_choice": "none", "max_tokens": 1}, "", 200),
        ch({"tools": [{"type": "function"}]}, "tools[0].function must be an object"),
        ch({"tools": [{"type": "function", "function": {"description": "x"}}]}, "name must be a non-empty string"),
        ch({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
           "parameters must be a JSON Schema object"),
        ch({"tools": [TOOL, TOOL]}, "duplicate tool name 'get_weather'"),
        ch({"tools": [{"type": "retrieval"}]}, 'tools[0].type must be "function"'),
        ch({"tools": "get_weather"}, "tools: Input should be a valid list"),
        ch({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "launch"}}},
           "'launch', which is not among the request's tools"),
        ch({"tools": [TOOL], "tool_choice": "always"}, 'tool_choice must be "none", "auto", "required"'),
        # tool_choice "required" and named functions are constrained (xgrammar), no parser needed;
        # they take the request's one constraint. Strict tools under "auto" need the parser first.
        ch({"tools": [TOOL], "tool_choice": "required", "max_tokens": 2}, "", 200),
        ch({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "max_tokens": 2}, "", 200),
        ch({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
           'response_format cannot be combined with tool_choice "required"'),
        ch({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "guided_json": {"type": "object"}}, "guided_json cannot be combined with tool_choice naming"),
        ch({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
            "tool_choice": "required"}, "tools[0].function.parameters must describe an object"),
        ch({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]},
           "start the server with --tool-call-parser"),
        ch({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}], "tool_choice": "required",
            "max_tokens": 2}, "", 200),
        ch({"tools": [{"type": "function", "function": {"name": "f", "strict": 1}}]}, "strict must be a boolean"),
        ch({"tool_choice": "required"}, 'tool_choice "required" needs tools'),
        ch({"tools": [TOOL], "parallel_tool_calls": "no"}, "parallel_tool_calls: expected true or false"),
        ch({}, "messages[2].tool_call_id is required for role 'tool'", messages=TOOL_TURN + [{"role": "tool", "content": "18C"}]),
        ch({}, "tool_call_id: Input should be a valid string",
           messages=TOOL_TURN + [{"role": "tool", "content": "18C", "tool_call_id": 7}]),
        ch({}, "arguments must be a JSON object encoded as a string", messages=[MSG[0], {
            "role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                 "function": {"name": "get_weather", "arguments": "{city: Paris}"}}]}]),
        ch({}, "tool_calls is only allowed on assistant messages", messages=[{**MSG[0], "tool_calls": []}]),
        ch({"max_tokens": 1}, "", 200, messages=TOOL_TURN + [{"role": "tool", "content": "18C", "tool_call_id": "c1"}]),
        ch({"separate_reasoning": "no"}, "separate_reasoning: expected true or false"),
        ch({"logprobs": 1}, "logprobs: expected true or false"),
        ch({"tools": [{"type": "function"}]}, "tools"),
        ch({"response_format": {"type": "json_object"}, "max_tokens": 2}, "", 200),
        ch({"response_format": {"type": "json_schema"}}, "response_format.json_schema must be an object"),
        ch({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema must be an object"),
        ch({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
           "Invalid JSON schema in 'response_format': Unsupported type"),
        ch({"response_format": {"type": "structural_tag"}},
           "Invalid structural tag in 'response_format': Structural tag must have a format field"),
        ch({"response_format": {"type": "structural_tag", "format": {"type": "const_string", "value": "ok"}},
            "max_tokens": 4}, "", 200),
        ch({"response_format": 5}, "response_format must be an object"),
        ch({"regex": "(", "max_tokens": 2}, "Invalid regex in 'regex'"),
        ch({"lora_path": ["keep"]}, "lora_path must be a string"),
        ch({"lora_path": ""}, "'lora_path' has an invalid value"),
        ch({"chat_template_kwargs": 5}, "chat_template_kwargs"),
        ch({"chat_template_kwargs": {"messages": []}}, "may not set ['messages']"),
        ch({"chat_template_kwargs": {"tokenize": True}}, "may not set ['tokenize']"),
        ch({"max_tokens": 1, "chat_template_kwargs": {"add_generation_prompt": False}}, "", 200),
        ch({"echo": True}, "echo is not supported on chat completions"),
        ch({"add_generation_prompt": "no"}, "add_generation_prompt: expected true or false"),
        ch({"add_generation_prompt": True, "continue_final_message": True}, "cannot both be true"),
        ch({}, "messages[0].content is required", messages=[{"role": "user"}]),
        ch({"min_tokens": 2, "max_tokens": 1}, "min_tokens (2) must not exceed max_tokens (1)"),
        ch({"logit_bias": {"-3": 1}}, "outside the vocabulary"),
        ch({"json_schema": "{}", "max_tokens": 2}, "", 200),
        ch({"cache_salt": ["a"]}, "cache_salt: Input should be a valid string"),
        ch({"cache_salt": "s" * 100_000}, "cache_salt: String should have at most 512 characters"),
        ch({"model": "nope"}, "does not exist", 404),
        ch({"model": "default:nope"}, "not loaded: nope", 404),
        ch({"max_tokens": 2, "temperature": 0}, "", 200, messages=[{"role": "user", "content": ""}]),
    ]


def adapter_cases(paths: dict[str, str], tmp: str) -> list[Case]:
    out: list[Case] = []
    for i, path in enumerate(LOAD):
        def load(name: str, lora_path: Any, needle: str, **extra: Any) -> Case:
            return Case(path, {"lora_name": name, "lora_path": lora_path, **extra}, 400, needle)

        out += [
            Case(path, {"lora_name": "x"}, 400, "must be provided"),
            Case(path, {"lora_path": paths["good"]}, 400, "must be provided"),
            load("", paths["good"], "non-empty string"),
            load(" pad ", paths["good"], "must not start or end with white space"),
            load("x\udcff", paths["good"], "'lora_name' is not valid Unicode text"),
            load(5, paths["good"], "'lora_name' must be a non-empty string"),
            load("x", 5, "'lora_path' must be a non-empty string"),
            load("x", paths["good"], "'pinned' must be a boolean", pinned="yes"),
            load("x", paths["good"], "unknown field", rank=8),
            load("keep", paths["good"], "already loaded"),
            load("default", paths["good"], "base model"),
            load("x", os.path.join(tmp, "nowhere"), "does not exist"),
            load("x", os.path.join(paths["good"], "adapter_config.json"), "not a directory"),
        ]
        for variant, needle in [
            ("no_config", "no adapter_config.json"), ("bad_config", "Cannot read"), ("zero_rank", "must be positive"),
            ("nan_alpha", "lora_alpha must be a finite number"), ("huge_alpha", "fits float32"),
            ("no_weights", "no adapter_model.safetensors"), ("truncated", "truncated or corrupt"),
            ("wrong_shape", "has shape"), ("rank32", "rank 32"), ("down", "down_proj"), ("dora", "DoRA"),
            ("modules_to_save", "modules_to_save"), ("rank_pattern", "per-module"),
        ]:
            out.append(load(f"bad-{variant}-{i}", paths[variant], needle))
    for path in UNLOAD:
        out += [
            Case(path, {"lora_name": "never-loaded"}, 404, "cannot be found"),
            Case(path, {}, 400, "'lora_name'"),
            Case(path, {"lora_name": 5}, 400, "'lora_name'"),
            Case(path, {"lora_name": "keep", "force": True}, 400, "unknown field"),
        ]
    return out


def misc_cases() -> list[Case]:
    return [
        Case("/abort_request", {}, 400, "'rid'"),
        Case("/abort_request", {"rid": 5}, 400, "'rid'"),
        Case("/abort_request", {"rid": "not-running"}, 200, ""),  # nothing to abort: a no-op
        Case("/debug/inject_fault", {}, 400, "rid_substring"),
        Case("/debug/inject_fault", {"rid_substring": "zz-never", "where": "nowhere"}, 400, "'where' must be one of"),
        Case("/debug/inject_fault", {"rid_substring": "zz-never", "tp_rank": "one"}, 400, "'tp_rank' an integer"),
        Case("/generate", None, 405, "not allowed", method="GET"),
        Case("/v1/nothing-here", {}, 404, "Not found"),
        Case("/get_server_info", None, 405, "not allowed", method="POST"),
        Case("/flush_cache", {}, 200, ""),  # idle between cases: the probe then runs uncached
        Case("/flush_cache", None, 405, "not allowed", method="DELETE"),
    ]


def auth_cases() -> list[Case]:
    """Against the API-key server: every route but the probes (/health, /health_generate) and
    /metrics needs the key."""
    out = []
    posts = GEN + LOAD + UNLOAD + ("/abort_request", "/flush_cache")
    gets = ("/get_server_info", "/get_model_info", "/v1/models", "/v1/models/default")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"},
                    {"Authorization": API_KEY}, {"Authorization": f"Bearer {API_KEY}x"}):
        out += [Case(p, {"text": "hi"}, 401, "API key", headers=headers) for p in posts]
        out += [Case(p, None, 401, "API key", method="GET", headers=headers) for p in gets]
    good = {"Authorization": f"Bearer {API_KEY}"}
    out += [
        Case("/health", None, 200, "", method="GET"),
        Case("/health_generate", None, 200, "", method="GET"),
        # The scheme is case-insensitive (RFC 7235).
        Case("/get_model_info", None, 200, "", method="GET", headers={"Authorization": f"bearer {API_KEY}"}),
        Case("/v1/completions", {"model": "default", "prompt": "hi", "max_tokens": 1}, 200, "", headers=good),
        Case("/v1/completions", {"model": "default", "prompt": "hi", "max_tokens": -1}, 400, "max_tokens", headers=good),
    ]
    return out
