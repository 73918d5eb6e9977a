"""Per-request sampling parameters and their validation (user errors raise ValueError)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from sglang.srt.sampling.grammar_spec import GRAMMAR_KINDS, GrammarSpec, normalize_constraint

_FIELDS = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "seed",
    "skip_special_tokens",
    "n",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "no_stop_trim",
    "include_stop_str_in_output",
    "spaces_between_special_tokens",
    "min_new_tokens",
    "logit_bias",
    "regex",
    "json_schema",
    "ebnf",
    "structural_tag",
}

# OpenAI's ranges for the two additive penalties and for a logit bias; SGLang's (and vLLM's
# former) upper bound of the repetition penalty.
PENALTY_RANGE = 2.0
LOGIT_BIAS_RANGE = 100.0
REPETITION_MAX = 2.0
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's /generate default when the field is left out


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


_TOKEN_KEY = re.compile(r"-?[0-9]+")  # a minus is let through to be told "outside the vocabulary"


def _parse_logit_bias(raw: Any, vocab_size: Optional[int]) -> dict[int, float]:
    """{token id: bias}; the ids may be strings of integers, as JSON objects (and OpenAI) send them."""
    if not isinstance(raw, dict):
        raise ValueError(f"logit_bias must be an object mapping token ids to numbers, got {type(raw).__name__}")
    out: dict[int, float] = {}
    for key, bias in raw.items():
        token: Any = key
        if isinstance(key, str):
            # Decimal ASCII digits only: int() would also take "1_0", "+5" or other scripts' digits.
            if not _TOKEN_KEY.fullmatch(key):
                raise ValueError(f"logit_bias: key {key!r} is not a token id")
            token = int(key)
        if not _is_int(token) or token < 0 or (vocab_size is not None and token >= vocab_size):
            where = f"the vocabulary [0, {vocab_size})" if vocab_size is not None else "the vocabulary"
            raise ValueError(f"logit_bias: token id {key!r} is outside {where}")
        if not _is_number(bias) or not math.isfinite(bias) or abs(bias) > LOGIT_BIAS_RANGE:
            raise ValueError(f"logit_bias: the bias of token {token} must be a number in "
                             f"[-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}], got {bias!r}")
        if token in out:
            raise ValueError(f"logit_bias: token id {token} is given twice (as {key!r} and another key)")
        out[token] = float(bias)
    return out


@dataclass
class SamplingParams:
    # None (an explicit null, or an OpenAI chat request without max_tokens) is SGLang's and vLLM's
    # "until EOS, a stop or the context": the tokenizer manager turns it into the room the prompt
    # leaves, so that past validation it is always an int.
    max_new_tokens: Optional[int] = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: Optional[int] = None
    skip_special_tokens: bool = True
    n: int = 1
    no_stop_trim: bool = False
    # vLLM's option: the text keeps the stop string that ended it and stops right after it (where
    # no_stop_trim, SGLang's, also keeps the rest of the token that completed the stop string).
    include_stop_str_in_output: bool = False
    # Logit adjustments (sampling/logit_adjustments.py), applied before temperature and the filters,
    # to greedy requests too. The additive penalties count the request's generated tokens (OpenAI's
    # definition); the repetition penalty (HF's) also counts the prompt's.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # EOS and stop_token_ids cannot be sampled, and stop strings do not match, before this many tokens.
    min_new_tokens: int = 0
    # Token id -> bias added to its logit (OpenAI's logit_bias; -100 in effect bans the token).
    logit_bias: Optional[dict[int, float]] = None
    # Constrained decoding (at most one): the output must match this regex, JSON schema (JSON text),
    # EBNF grammar or structural tag (xgrammar's, JSON text) (sglang/srt/constrained/); a request
    # whose grammar is complete stops.
    regex: Optional[str] = None
    json_schema: Optional[str] = None
    ebnf: Optional[str] = None
    structural_tag: Optional[str] = None

    @classmethod
    def from_dict(cls, data: Optional[dict[str, Any]]) -> "SamplingParams":
        """Build from a request's `sampling_params` object, with clear errors for bad input."""
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ValueError(f"sampling_params must be an object, got {type(data).__name__}")
        unknown = set(data) - _FIELDS
        if unknown:
            raise ValueError(f"sampling_params: unknown field(s) {sorted(unknown)}")
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key == "max_new_tokens" and value is None:
                kwargs[key] = None  # fill the context (see the field)
                continue
            if value is None or key == "spaces_between_special_tokens":
                continue  # accepted for compatibility: detokenisation joins tokens as the tokenizer does
            kwargs[key] = value
        params = cls(**kwargs)
        params.verify()
        return params

    def verify(self, vocab_size: Optional[int] = None) -> None:
        if self.max_new_tokens is not None and (not _is_int(self.max_new_tokens) or self.max_new_tokens < 0):
            raise ValueError(f"max_new_tokens must be a non-negative integer, got {self.max_new_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not _is_number(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be a positive integer, got {self.n!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            # The sampler keys its generator by 64 bits: a larger seed would alias a smaller one.
            raise ValueError(f"seed must be a 64-bit signed integer, got {self.seed}")
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError("stop must be a string or a list of strings")
        self.stop = [s for s in self.stop if s]
        if isinstance(self.stop_token_ids, int) and not isinstance(self.stop_token_ids, bool):
            self.stop_token_ids = [self.stop_token_ids]
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of integers")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not (0 <= t < vocab_size)]
            if bad:
                raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")
        self._verify_adjustments(vocab_size)

    def _verify_adjustments(self, vocab_size: Optional[int]) -> None:
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value) or abs(value) > PENALTY_RANGE:
                raise ValueError(f"{name} must be a number in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}], got {value!r}")
        rp = self.repetition_penalty
        if not _is_number(rp) or not 0 < rp <= REPETITION_MAX:
            raise ValueError(f"repetition_penalty must be in (0, {REPETITION_MAX:g}] (1 = none), got {rp!r}")
        if not _is_int(self.min_new_tokens) or self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be a non-negative integer, got {self.min_new_tokens!r}")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            default = ", the default when not set" if self.max_new_tokens == DEFAULT_MAX_NEW_TOKENS else ""
            raise ValueError(f"min_new_tokens ({self.min_new_tokens}) must not exceed "
                             f"max_new_tokens ({self.max_new_tokens}{default})")
        if self.logit_bias is not None:
            self.logit_bias = _parse_logit_bias(self.logit_bias, vocab_size)
        self._verify_constraint()

    def _verify_constraint(self) -> None:
        for kind in GRAMMAR_KINDS:
            setattr(self, kind, normalize_constraint(kind, getattr(self, kind)))
        given = [kind for kind in GRAMMAR_KINDS if getattr(self, kind) is not None]
        if len(given) > 1:
            raise ValueError(f"{given[1]}: only one of regex, json_schema, ebnf and structural_tag may be given "
                             f"(got {' and '.join(given)})")

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 1e-6 or self.top_k == 1

    @property
    def needs_token_counts(self) -> bool:
        """Whether a penalty reads the request's token history (sampling/token_counts.py)."""
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1

    @property
    def grammar(self) -> Optional[GrammarSpec]:
        """The constraint on the output, if any (verify() left at most one)."""
        for kind in GRAMMAR_KINDS:
            value = getattr(self, kind)
            if value is not None:
                return GrammarSpec(kind, value)
        return None

    @property
    def adjusts_logits(self) -> bool:
        return self.needs_token_counts or self.min_new_tokens > 0 or bool(self.logit_bias)

    def to_dict(self) -> dict[str, Union[int, float, bool, list, None]]:
        return dict(self.__dict__)
