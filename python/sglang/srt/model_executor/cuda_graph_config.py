"""Which CUDA-graph backend serves each phase, and its capture sizes (DESIGN §6).

For the prefill phase `max_bs` / `bs` are *token counts* (capture buckets); for decode they are
batch sizes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, Optional


class Phase(str, Enum):
    DECODE = "decode"
    PREFILL = "prefill"


class Backend(str, Enum):
    FULL = "full"
    BREAKABLE = "breakable"
    TC_PIECEWISE = "tc_piecewise"
    DISABLED = "disabled"


PREFILL_BACKENDS = (Backend.BREAKABLE, Backend.FULL, Backend.TC_PIECEWISE, Backend.DISABLED)
DECODE_BACKENDS = (Backend.FULL, Backend.BREAKABLE, Backend.DISABLED)


@dataclass
class PhaseConfig:
    backend: Backend = Backend.DISABLED
    max_bs: Optional[int] = None
    bs: Optional[list[int]] = None
    # Full prefill graph only: request slots captured per bucket.
    full_prefill_max_req: Optional[int] = None

    def __post_init__(self) -> None:
        self.backend = Backend(self.backend)


@dataclass
class CudaGraphConfig:
    decode: PhaseConfig = field(default_factory=PhaseConfig)
    prefill: PhaseConfig = field(default_factory=PhaseConfig)

    def phase(self, phase: Phase | str) -> PhaseConfig:
        return getattr(self, Phase(phase).value)

    @staticmethod
    def parse_json(text: str | dict) -> dict[str, dict[str, Any]]:
        """Validate the `--cuda-graph-config` JSON: {"decode": {...}, "prefill": {...}}."""
        try:
            data = json.loads(text) if isinstance(text, str) else dict(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--cuda-graph-config is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError("--cuda-graph-config must be a JSON object with keys 'decode'/'prefill'")
        allowed_keys = {f.name for f in fields(PhaseConfig)}
        for phase_name, phase_cfg in data.items():
            if phase_name not in (Phase.DECODE.value, Phase.PREFILL.value):
                raise ValueError(
                    f"--cuda-graph-config: unknown phase {phase_name!r}; allowed: 'decode', 'prefill'"
                )
            if not isinstance(phase_cfg, dict):
                raise ValueError(f"--cuda-graph-config: phase {phase_name!r} must map to an object")
            unknown = set(phase_cfg) - allowed_keys
            if unknown:
                raise ValueError(
                    f"--cuda-graph-config: unknown key(s) {sorted(unknown)} for phase {phase_name!r}; "
                    f"allowed: {sorted(allowed_keys)}"
                )
        return data

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for phase in (Phase.DECODE, Phase.PREFILL):
            pc = self.phase(phase)
            out[phase.value] = {
                "backend": pc.backend.value,
                "max_bs": pc.max_bs,
                "bs": pc.bs,
                "full_prefill_max_req": pc.full_prefill_max_req,
            }
        return out


def prefill_bucket_ladder(max_tokens: int) -> list[int]:
    """Token-count capture buckets up to `max_tokens`: fine steps for short prompts, coarser above."""
    steps = [(4, 32, 4), (48, 256, 16), (288, 512, 32), (576, 1024, 64), (1280, 4096, 256)]
    # 1 and 2 so that one- and two-token prefills (chunk tails) stay within the padding limit.
    ladder: list[int] = [1, 2]
    for start, stop, step in steps:
        ladder.extend(range(start, stop + 1, step))
    ladder.extend(range(4608, max(max_tokens, 4608) + 1, 512))
    out = [b for b in ladder if b <= max_tokens]
    if max_tokens > 0 and (not out or out[-1] != max_tokens):
        out.append(max_tokens)
    return out


def decode_bucket_ladder(max_bs: int) -> list[int]:
    """Batch-size capture buckets up to `max_bs` (always including `max_bs` itself)."""
    ladder = [1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16))
    ladder += list(range(512, max(max_bs, 512) + 1, 32))
    out = sorted({b for b in ladder if b <= max_bs} | {max_bs})
    return [b for b in out if b > 0]
