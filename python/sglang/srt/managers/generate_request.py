"""The user-facing generate request (native `/generate` and `Engine.generate`) and its errors.

`GenerateReqInput` is what a caller sends: one prompt or a batch, text or token ids, per-prompt
options either shared or given as lists. `normalize()` validates the shapes and expands it into a
flat list of `SingleGenerateReq` (one per prompt and per sample when `n > 1`), so the tokenizer
manager only ever handles single requests.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Union


class InvalidRequestError(ValueError):
    """A user error with the HTTP status and the offending parameter."""

    status_code = 400

    def __init__(self, message: str, param: Optional[str] = None, status_code: Optional[int] = None,
                 route_terms: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        # True: raised by an OpenAI route in its own field names (else the shared request path's,
        # which name /generate's fields and which the route renames: serving_base.openai_param_names).
        self.route_terms = route_terms
        if status_code is not None:
            self.status_code = status_code


class ModelNotFoundError(InvalidRequestError):
    status_code = 404

    def __init__(self, model: str, hint: str = "") -> None:
        message = f"The model `{model}` does not exist." + (f" {hint}" if hint else "")
        super().__init__(message, param="model")


class RequestFailedError(RuntimeError):
    """The server accepted the request but could not complete it (e.g. a failed forward)."""

    def __init__(self, message: str, status_code: int = 500) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code


# A cache salt is a client's tenant key, not a payload: bounded like an identifier.
MAX_CACHE_SALT_CHARS = 512

# One call may expand into at most this many single requests (prompts x n), and n is at most
# MAX_N (OpenAI's bound too): `n=10**6` must be refused before a million requests are built.
MAX_N = 128
MAX_REQUESTS_PER_CALL = 4096


def new_rid() -> str:
    return uuid.uuid4().hex


@dataclass
class SingleGenerateReq:
    """One prompt, one sample: what the tokenizer manager turns into a scheduler message."""

    rid: str
    text: Optional[str]
    input_ids: Optional[list[int]]
    sampling_params: dict[str, Any]
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    lora_name: Optional[str] = None
    stream: bool = False
    cache_salt: Optional[str] = None
    # The rid the caller gave for the prompt or the call this request came from (None: none given).
    # /abort_request with it aborts every sample (`n` > 1) and prompt expanded from it.
    group_rid: Optional[str] = None
    log_metrics: bool = True  # False: left out of /metrics' request counts (/health_generate's probe)


def valid_cache_salt(x: Any) -> bool:
    """None (no salt) or a non-empty string of at most MAX_CACHE_SALT_CHARS characters."""
    return x is None or (isinstance(x, str) and 0 < len(x) <= MAX_CACHE_SALT_CHARS)


def cache_salt_error(value: Any) -> InvalidRequestError:
    return InvalidRequestError(
        f"'cache_salt' must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters, got "
        f"{type(value).__name__}" + (f" of {len(value)} characters" if isinstance(value, str) else ""),
        param="cache_salt",
    )


def _is_int_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


@dataclass
class GenerateReqInput:
    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[Union[dict[str, Any], list[dict[str, Any]]]] = None
    return_logprob: Union[bool, list[bool]] = False
    logprob_start_len: Union[int, list[int], None] = -1
    top_logprobs_num: Union[int, list[int], None] = 0
    return_text_in_logprobs: bool = False
    lora_path: Optional[Union[str, list[Optional[str]]]] = None
    stream: bool = False
    rid: Optional[Union[str, list[str]]] = None
    # KV is reused only between requests with the same salt (str or one per prompt; None = none).
    cache_salt: Optional[Union[str, list[Optional[str]]]] = None
    # As upstream's: False leaves the request out of /metrics' counts and histograms.
    log_metrics: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Any) -> "GenerateReqInput":
        if not isinstance(data, dict):
            raise InvalidRequestError(f"the request body must be a JSON object, got {type(data).__name__}")
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        # Accepted for compatibility with SGLang clients; they change nothing here.
        ignored = {"image_data", "modalities", "custom_logit_processor", "bootstrap_host"}
        unknown = sorted(set(data) - known - ignored)
        if unknown:
            raise InvalidRequestError(f"unknown field(s) {unknown} in the request", param=unknown[0])
        return cls(**{k: v for k, v in data.items() if k in known})

    # ------------------------------------------------------------------ normalisation
    def normalize(self) -> tuple[list[SingleGenerateReq], bool]:
        """Flatten into single requests; returns (requests, is_batch)."""
        if (self.text is None) == (self.input_ids is None):
            raise InvalidRequestError("exactly one of 'text' and 'input_ids' must be given", param="text")
        if self.text is not None:
            if isinstance(self.text, str):
                prompts: list[tuple[Optional[str], Optional[list[int]]]] = [(self.text, None)]
                is_batch = False
            elif isinstance(self.text, list) and all(isinstance(t, str) for t in self.text):
                prompts = [(t, None) for t in self.text]
                is_batch = True
            else:
                raise InvalidRequestError("'text' must be a string or a list of strings", param="text")
        else:
            if _is_int_list(self.input_ids) and self.input_ids and not isinstance(self.input_ids[0], list):
                prompts = [(None, list(self.input_ids))]
                is_batch = False
            elif isinstance(self.input_ids, list) and self.input_ids and all(_is_int_list(p) for p in self.input_ids):
                prompts = [(None, list(p)) for p in self.input_ids]
                is_batch = True
            else:
                raise InvalidRequestError(
                    "'input_ids' must be a non-empty list of integers or a list of such lists",
                    param="input_ids",
                )
        num = len(prompts)
        if num == 0:
            raise InvalidRequestError("the batch is empty", param="text")
        if not isinstance(self.stream, bool):
            raise InvalidRequestError("'stream' must be a boolean", param="stream")
        if not isinstance(self.return_text_in_logprobs, bool):
            raise InvalidRequestError("'return_text_in_logprobs' must be a boolean", param="return_text_in_logprobs")
        if not isinstance(self.log_metrics, bool):
            raise InvalidRequestError("'log_metrics' must be a boolean", param="log_metrics")

        def per_prompt(name: str, value: Any, ok: Any, default: Any, error: Any = None) -> list[Any]:
            if value is None:
                value = default
            if isinstance(value, list) and not (name == "sampling_params" and isinstance(value, dict)):
                if len(value) != num:
                    raise InvalidRequestError(
                        f"'{name}' has {len(value)} entries but the batch has {num} prompts", param=name
                    )
                items = list(value)
            else:
                items = [value] * num
            for item in items:
                if not ok(item):
                    if error is not None:  # a field with its own message
                        raise error(item)
                    raise InvalidRequestError(f"'{name}' has an invalid value {item!r}", param=name)
            return items

        is_int = lambda x: isinstance(x, int) and not isinstance(x, bool)  # noqa: E731
        params = per_prompt("sampling_params", self.sampling_params, lambda x: isinstance(x, dict), {})
        ret_lp = per_prompt("return_logprob", self.return_logprob, lambda x: isinstance(x, bool), False)
        start = per_prompt("logprob_start_len", self.logprob_start_len, lambda x: is_int(x) and x >= -1, -1)
        top = per_prompt("top_logprobs_num", self.top_logprobs_num, lambda x: is_int(x) and x >= 0, 0)
        loras = per_prompt("lora_path", self.lora_path, lambda x: x is None or (isinstance(x, str) and x != ""), None)
        salts = per_prompt("cache_salt", self.cache_salt, valid_cache_salt, None, error=cache_salt_error)
        if self.rid is None:
            rids = [new_rid() for _ in range(num)]
            groups: list[Optional[str]] = [None] * num
        elif isinstance(self.rid, str) and is_batch:
            # One rid for a whole batch names the call: prompt i becomes "<rid>-<i>".
            if not self.rid:
                raise InvalidRequestError("'rid' must be a non-empty string", param="rid")
            rids = [f"{self.rid}-{i}" for i in range(num)]
            groups = [self.rid] * num
        else:
            rids = per_prompt("rid", self.rid, lambda x: isinstance(x, str) and x != "", None)
            if not is_batch and isinstance(self.rid, list):
                raise InvalidRequestError("'rid' must be a string for a single prompt", param="rid")
            if len(set(rids)) != len(rids):
                raise InvalidRequestError("'rid' values must be unique", param="rid")
            groups = list(rids)

        ns = []
        for sp in params:
            n = sp.get("n", 1)
            n = 1 if n is None else n
            if not is_int(n) or n < 1:
                raise InvalidRequestError(f"sampling_params.n must be a positive integer, got {n!r}", param="n")
            if n > MAX_N:
                raise InvalidRequestError(f"sampling_params.n must be at most {MAX_N}, got {n}", param="n")
            ns.append(n)
        if sum(ns) > MAX_REQUESTS_PER_CALL:
            raise InvalidRequestError(
                f"the request asks for {sum(ns)} generations (prompts x n); at most {MAX_REQUESTS_PER_CALL} "
                "are allowed per call", param="n" if max(ns) > 1 else "text",
            )

        out: list[SingleGenerateReq] = []
        for i, (text, ids) in enumerate(prompts):
            sp = dict(params[i])
            sp.pop("n", None)
            n = ns[i]
            if n > 1:
                is_batch = True
            for j in range(n):
                sp_j = dict(sp)
                if j > 0 and isinstance(sp.get("seed"), int):
                    # Distinct yet reproducible samples for n > 1 with a seed.
                    # Wrapped into int64, so a valid seed near 2**63 stays valid for every sample.
                    sp_j["seed"] = (sp["seed"] + j + 2**63) % 2**64 - 2**63
                out.append(
                    SingleGenerateReq(
                        rid=rids[i] if n == 1 else f"{rids[i]}-{j}",
                        text=text,
                        input_ids=ids,
                        sampling_params=sp_j,
                        return_logprob=ret_lp[i],
                        logprob_start_len=start[i],
                        top_logprobs_num=top[i],
                        return_text_in_logprobs=self.return_text_in_logprobs,
                        lora_name=loras[i],
                        stream=self.stream,
                        cache_salt=salts[i],
                        group_rid=groups[i],
                        log_metrics=self.log_metrics,
                    )
                )
        if self.rid is not None and len({r.rid for r in out}) != len(out):
            # n > 1 turns rid R into, ...: those must not meet another prompt's rid.
            raise InvalidRequestError(
                "'rid' values must be unique, also after n > 1 expands a rid R into R-0, R-1, ...", param="rid"
            )
        return out, is_batch
