"""Per-request sampling parameters and their validation (user errors raise ValueError)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

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
    "spaces_between_special_tokens",
}


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
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
            if value is None:
                continue
            if key in ("frequency_penalty", "presence_penalty", "repetition_penalty",
                       "spaces_between_special_tokens"):
                # Accepted for compatibility; penalties other than the neutral value are refused
                # below rather than silently ignored.
                neutral = 1.0 if key == "repetition_penalty" else 0.0
                if key != "spaces_between_special_tokens" and (not _is_number(value) or value != neutral):
                    raise ValueError(f"sampling_params.{key} is not supported (only {neutral})")
                continue
            kwargs[key] = value
        params = cls(**kwargs)
        params.verify()
        return params

    def verify(self, vocab_size: Optional[int] = None) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 0:
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
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
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

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 1e-6 or self.top_k == 1

    def to_dict(self) -> dict[str, Union[int, float, bool, list, None]]:
        return dict(self.__dict__)
