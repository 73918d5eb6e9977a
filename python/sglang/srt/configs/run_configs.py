"""The frozen configs the engine runs on, built once at start from `ServerArgs`
(sglang/srt/server_configs.py) and handed down: below the entrypoints no code reads `ServerArgs`.

    RunConfigs
      tp                 TPLayout               the ranks, where they meet, the model's one split
      scheduler          SchedulerConfig        admission, logging, the prefix cache
        runner           RunnerConfig           the model, its memory, the attention backend, graphs
          lora           LoRARunConfig | None   the adapter pool and its kernels
      tokenizer_manager  TokenizerManagerConfig the HTTP process's side

They are plain data, picklable (the scheduler's travel to every rank process), and never mutated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from sglang.srt.configs.cuda_graph_config import CudaGraphConfig
from sglang.srt.configs.lora_ref import LoRARef
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.configs.tokenizer import TokenizerSpec
from sglang.srt.configs.tp_split import TPSplit


@dataclass(frozen=True)
class TPLayout:
    """Tensor parallelism: `size` ranks over `nnodes` nodes (this is node `node_rank`), meeting at
    `dist_init_addr` (None: a free local port), and how the served model splits over them."""

    size: int
    nnodes: int
    node_rank: int
    device: str  # "cuda" or "cpu": NCCL or gloo
    split: TPSplit
    dist_init_addr: Optional[str] = None
    dist_timeout: Optional[int] = None  # seconds a collective may wait; None: torch's default

    @property
    def ranks_per_node(self) -> int:
        return self.size // self.nnodes


@dataclass(frozen=True)
class LoRARunConfig:
    """The adapter pool and its kernels (the `--lora-*` flags), the same on every rank."""

    refs: tuple[LoRARef, ...]  # adapters loaded at start; their ids are the registry's too
    max_loras_per_batch: Optional[int]  # None: sized at start (lora/pool_sizing.py)
    backend: str  # the backend that runs here (triton ones need a GPU or the interpreter)
    requested_backend: str  # what --lora-backend asked for
    eviction_policy: str = "lru"
    chunk_size: int = 16
    fold: str = "auto"
    # decode: the norm before a module computes its shrink (lora/norm_fusion.py). auto: folded
    # modules only; on: unfolded too; off.
    fuse_norm: str = "auto"
    max_lora_rank: Optional[int] = None  # None: the largest rank of `refs`
    target_modules: Optional[tuple[str, ...]] = None  # None: the union of `refs`
    max_loaded_loras: Optional[int] = None


@dataclass(frozen=True)
class RunnerConfig:
    """What the model runner builds and how it runs a forward."""

    model: ModelConfig  # read once from config.json
    split: TPSplit  # this model's share per rank
    device: str  # "cuda" or "cpu"
    attention_backend: str  # resolved: "triton" or "torch_native"
    cuda_graph: CudaGraphConfig
    load_format: str = "auto"
    random_seed: int = 42
    deterministic: bool = False
    mem_fraction_static: float = 0.85
    max_total_tokens: Optional[int] = None
    max_running_requests: Optional[int] = None
    chunked_prefill_size: int = 8192  # -1: no chunking
    max_prefill_tokens: int = 16384
    lora: Optional[LoRARunConfig] = None  # None: LoRA off


@dataclass(frozen=True)
class SchedulerConfig:
    """One rank's scheduler: its runner and the admission and logging rules around it."""

    runner: RunnerConfig
    tokenizer: Optional[TokenizerSpec]  # for stop strings; None: --skip-tokenizer-init
    schedule_policy: str = "fcfs"
    disable_radix_cache: bool = False
    decode_log_interval: int = 40
    lora_max_wait_turns: int = 64
    log_level: str = "info"
    enable_test_hooks: bool = False
    overlap_schedule: bool = False  # --enable-overlap-schedule (managers/scheduler_overlap.py)
    watchdog_timeout: float = 300.0  # --watchdog-timeout (scheduler_process._watch_progress); 0: off
    grammar_backend: str = "none"  # --grammar-backend, resolved: "xgrammar" or "none" (constrained/)
    max_queued_requests: Optional[int] = None  # --max-queued-requests; None: no limit


# Names that always mean the base model in a request's `model` (besides its served name and path).
BASE_MODEL_ALIASES = ("default",)


@dataclass(frozen=True)
class TokenizerManagerConfig:
    """The HTTP process's side: tokenisation, adapter names, what replies and metrics report."""

    model_path: str
    served_model_name: str
    tokenizer: Optional[TokenizerSpec]  # None: --skip-tokenizer-init (token ids only)
    lora_refs: Optional[tuple[LoRARef, ...]] = None  # None: LoRA off
    lora_resolver_dir: Optional[str] = None  # adapters loaded on first use (managers/tokenizer_lora.py)
    max_loaded_loras: Optional[int] = None
    max_top_logprobs: int = 20
    log_requests: bool = False
    log_requests_level: int = 0
    enable_metrics: bool = False
    enable_cache_report: bool = False
    enable_test_hooks: bool = False
    grammar_backend: str = "none"  # --grammar-backend, resolved (managers/tokenizer_grammar.py)
    # The server's settings as /get_server_info shows them (no secrets).
    public_args: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def base_model_names(self) -> frozenset[str]:
        """Every name a request's `model` may give the base model by; no adapter may take one."""
        return frozenset((self.served_model_name, self.model_path, *BASE_MODEL_ALIASES))


@dataclass(frozen=True)
class RunConfigs:
    tp: TPLayout
    scheduler: SchedulerConfig
    tokenizer_manager: TokenizerManagerConfig
