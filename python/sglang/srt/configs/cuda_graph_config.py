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
# compile_mode (tc_piecewise) -> torch.compile mode. Never inductor's own CUDA graphs: the runner
# captures the compiled body itself, broken at attention (model_executor/runner/piecewise_compile.py).
TORCH_COMPILE_MODES = {None: None, "default": None, "max-autotune": "max-autotune-no-cudagraphs"}
COMPILE_MODES = tuple(TORCH_COMPILE_MODES)
DECODE_BACKENDS = (Backend.FULL, Backend.BREAKABLE, Backend.DISABLED)


@dataclass
class PhaseConfig:
    backend: Backend = Backend.DISABLED
    max_bs: Optional[int] = None
    bs: Optional[list[int]] = None
    # Full prefill graph only: request slots captured per bucket.
    full_prefill_max_req: Optional[int] = None
    # tc_piecewise only: torch.compile's mode for the body, "default" or "max-autotune" (inductor
    # autotunes its GEMM templates against cuBLAS; never its own CUDA graphs: we capture).
    compile_mode: Optional[str] = None

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
                "compile_mode": pc.compile_mode,
            }
        return out


# Top prefill bucket when the config names none. Without LoRA kernels a prefill of more than
# ~2k tokens is compute-bound and a graph no longer pays (benchmark/RESULTS.md); eager LoRA also
# pays host time for every kernel launch, so graphs that carry LoRA kernels go up to serving-size
# batches (the chunked-prefill size), capped to keep capture quick.
def resolve_cuda_graph_flags(
    on_cuda: bool,
    disable_all: bool,
    disable: dict[Phase, bool],
    backend: dict[Phase, Optional[str]],
    max_bs: dict[Phase, Optional[int]],
    bs: dict[Phase, Optional[list[int]]],
    json_input: Any = None,
) -> tuple[CudaGraphConfig, set[tuple[str, str]]]:
    """Every CUDA-graph flag as one config, and the keys the user set (*locked*: the compatibility
    rules never override a locked prefill backend).

    Precedence, highest first: --cuda-graph-config JSON, per-phase flags (--cuda-graph-backend-*,
    --cuda-graph-max-bs-*, --cuda-graph-bs-*), per-phase disable switches, legacy
    --disable-cuda-graph, defaults (full decode and breakable prefill graphs on CUDA, none elsewhere).
    """
    cfg = CudaGraphConfig(
        decode=PhaseConfig(backend=Backend.FULL if on_cuda else Backend.DISABLED),
        prefill=PhaseConfig(backend=Backend.BREAKABLE if on_cuda else Backend.DISABLED),
    )
    locked: set[tuple[str, str]] = set()

    def put(phase: Phase, key: str, value: Any) -> None:
        if key == "backend":
            try:
                value = Backend(value)
            except ValueError:
                raise ValueError(f"CUDA graph backend of the {phase.value} phase (--cuda-graph-config / "
                                 f"--cuda-graph-backend-{phase.value}): {value!r} is not one of "
                                 f"{[b.value for b in Backend]}") from None
        setattr(cfg.phase(phase), key, value)
        locked.add((phase.value, key))

    for phase in (Phase.DECODE, Phase.PREFILL):
        if disable_all or disable[phase]:
            put(phase, "backend", Backend.DISABLED)
    for phase in (Phase.DECODE, Phase.PREFILL):
        if backend[phase] is not None:
            put(phase, "backend", backend[phase])
        if max_bs[phase] is not None:
            put(phase, "max_bs", max_bs[phase])
        if bs[phase]:
            put(phase, "bs", sorted(set(bs[phase])))
    if json_input is not None:
        for phase_name, phase_cfg in CudaGraphConfig.parse_json(json_input).items():
            for key, value in phase_cfg.items():
                put(Phase(phase_name), key, value)

    allowed = {Phase.PREFILL: PREFILL_BACKENDS, Phase.DECODE: DECODE_BACKENDS}
    for phase, backends in allowed.items():
        if cfg.phase(phase).backend not in backends:
            raise ValueError(
                f"cuda graph backend {cfg.phase(phase).backend.value!r} is not allowed for the "
                f"{phase.value} phase; allowed: {[b.value for b in backends]}"
            )
        if cfg.phase(phase).compile_mode not in COMPILE_MODES:
            raise ValueError(
                f"--cuda-graph-config: compile_mode must be one of {[m for m in COMPILE_MODES if m]}, "
                f"got {cfg.phase(phase).compile_mode!r}"
            )
    return cfg, locked


DEFAULT_MAX_PREFILL_GRAPH_TOKENS = 2048
DEFAULT_MAX_LORA_PREFILL_GRAPH_TOKENS = 8192
# Below this many tokens a prefill costs about the same whatever its size (weight reads and
# launches dominate), so the ladder may pad up to 2x; above it every bucket is at most 25% larger
# than the one before, so padding wastes at most a fifth of a replay.
_FLAT_PREFILL_TOKENS = 256


def prefill_bucket_ladder(max_tokens: int) -> list[int]:
    """Token-count capture buckets up to `max_tokens` (always included).

    1, 2, 4, ..., 64, 96, 128, 192, 256, then four steps per doubling: 320, 384, 448, 512, 640,
    ..., 2048, 2560, ..., 4096, 5120, ..., 8192. 23 buckets up to 2048, 31 up to 8192.
    """
    ladder = [1, 2, 4, 8, 16, 32, 64, 96, 128, 192, _FLAT_PREFILL_TOKENS]
    size = _FLAT_PREFILL_TOKENS
    while size < max_tokens:
        step = size // 4
        ladder.extend(range(size + step, 2 * size + 1, step))
        size *= 2
    out = [b for b in ladder if b <= max_tokens]
    if max_tokens > 0 and (not out or out[-1] != max_tokens):
        out.append(max_tokens)
    return out


def default_prefill_graph_cap(chunked_prefill_size: int, max_prefill_tokens: int, with_lora: bool) -> int:
    """The top prefill bucket when neither `max_bs` nor `bs` is configured: no larger than any
    prefill batch can be (the chunk, or the prefill token budget when chunking is off)."""
    limit = max_prefill_tokens if chunked_prefill_size == -1 else min(chunked_prefill_size, max_prefill_tokens)
    top = DEFAULT_MAX_LORA_PREFILL_GRAPH_TOKENS if with_lora else DEFAULT_MAX_PREFILL_GRAPH_TOKENS
    return max(1, min(limit, top))


def fillable_buckets(buckets: list[int], max_reqs: Optional[int], max_req_tokens: int) -> list[int]:
    """The buckets some batch can fill: at most `max_reqs` requests (None: no limit) of at most
    `max_req_tokens` tokens (the context length). A larger bucket could never be replayed, and
    could not even be captured with valid positions."""
    if max_reqs is None:
        return list(buckets)
    return [b for b in buckets if b <= max_reqs * max_req_tokens]


def decode_bucket_ladder(max_bs: int) -> list[int]:
    """Batch-size capture buckets up to `max_bs` (always including `max_bs` itself)."""
    ladder = [1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16))
    ladder += list(range(512, max(max_bs, 512) + 1, 32))
    out = sorted({b for b in ladder if b <= max_bs} | {max_bs})
    return [b for b in out if b > 0]
