"""ServerArgs: what the user asked for (its CLI flags are in server_args_cli.py), and its validation.

It stays in the entrypoints: server_configs.build_run_configs derives the frozen configs every
component runs on from it, once. Construction never touches the model files
(`ServerArgs(model_path="dummy")` works anywhere). CUDA-graph settings are resolved into
`cuda_graph_config` by `_handle_cuda_graph_config()` (DESIGN §6).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from sglang.srt import utils
from sglang.srt.configs.chat_templates import resolve_chat_template
from sglang.srt.configs.lora_path_spec import LoRAPathSpec  # also importable from here, its old home
from sglang.srt.constrained.backends import default_grammar_backend
from sglang.srt.constrained.base import GRAMMAR_BACKENDS, XGRAMMAR_REQUIREMENT, xgrammar_available
from sglang.srt.configs.cuda_graph_config import (
    DECODE_BACKENDS,
    PREFILL_BACKENDS,
    Backend,
    CudaGraphConfig,
    Phase,
    resolve_cuda_graph_flags,
)
from sglang.srt.entrypoints.openai.reasoning_parser import REASONING_PARSERS
from sglang.srt.entrypoints.openai.tool_parsers import TOOL_CALL_PARSERS
from sglang.srt.server_args_cli import (  # the flags' choices: validated here, offered there
    ATTENTION_BACKENDS,
    DefaultsHelpFormatter,
    DEVICES,
    DTYPES,
    LOAD_FORMATS,
    LOG_LEVELS,
    LOG_REQUESTS_LEVELS,
    LORA_BACKENDS,
    LORA_CHUNK_SIZES,
    LORA_EVICTION_POLICIES,
    LORA_FOLD_MODES,
    LORA_FUSE_NORM_MODES,
    LORA_TARGET_MODULES,
    SCHEDULE_POLICIES,
    ServerArgumentParser,
    add_cli_args,
)
from sglang.srt.utils import is_cpu, is_hip, is_mps, is_npu, is_xpu

logger = logging.getLogger(__name__)



@dataclass
class ServerArgs:
    # Model and tokenizer
    model_path: str = "demo"
    tokenizer_path: Optional[str] = None
    load_format: str = "auto"
    dtype: str = "auto"
    context_length: Optional[int] = None
    # A JSON object whose keys replace config.json's (SGLang's flag; vLLM's --hf-overrides), e.g.
    # '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}'.
    json_model_override_args: str = "{}"
    device: str = "auto"
    random_seed: int = 42
    served_model_name: Optional[str] = None
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False
    # A Jinja chat template (a file, or a built-in name: configs/chat_templates.py) that replaces
    # the tokenizer's own for /v1/chat/completions.
    chat_template: Optional[str] = None
    # How /v1/chat/completions reads tool calls and reasoning out of replies (entrypoints/openai/
    # tool_parsers, reasoning_parser.py); None: it does not (a request with tools is refused).
    tool_call_parser: Optional[str] = None
    reasoning_parser: Optional[str] = None

    # Memory and scheduling
    mem_fraction_static: float = 0.85
    max_total_tokens: Optional[int] = None
    max_running_requests: Optional[int] = None
    # Most requests waiting to run; a request past it gets a 503 at once (None: no limit).
    max_queued_requests: Optional[int] = None
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int = 8192
    disable_radix_cache: bool = False
    schedule_policy: str = "fcfs"  # or "lpm": the longest cached prefix first (needs the prefix cache)
    page_size: int = 1  # KV cache tokens per page; this pool allocates one token at a time
    decode_log_interval: int = 40
    # Launch each decode step before the previous one's results reach the host (managers/
    # scheduler_overlap.py): a Qwen3-4B decode turn of 64 requests 4.95 -> 3.95 ms on the H200, and
    # under load (bench_serving, 256 x 512 -> 128, concurrency 64) +14% requests/s on a base server,
    # +6% with 8 LoRA adapters, ITL no worse. None (the default): on for a single-GPU CUDA server
    # (`resolved_overlap_schedule`), off on the CPU (nothing to overlap: its forward is synchronous)
    # and under tensor parallelism.
    enable_overlap_schedule: Optional[bool] = None
    disable_overlap_schedule: bool = False  # upstream's spelling; wins over the enable flag
    enable_deterministic_inference: bool = False
    # Constrained decoding (regex / json_schema / ebnf, OpenAI's response_format, vLLM's guided_*):
    # "xgrammar" or "none"; None (the default) resolves to xgrammar where it is installed, else none.
    grammar_backend: Optional[str] = None

    # Kernels
    attention_backend: Optional[str] = None

    # Tensor parallelism (DESIGN §11): one scheduler process per rank (NCCL on CUDA, gloo on CPU)
    tp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: Optional[str] = None  # HOST:PORT where the ranks meet; needed with nnodes > 1
    dist_timeout: Optional[int] = None  # seconds a collective may wait; None = torch's default
    watchdog_timeout: float = 300.0  # seconds a scheduler turn may take before its rank counts as hung; 0: never

    # LoRA
    enable_lora: Optional[bool] = None
    lora_paths: Optional[list[Any]] = None
    max_loras_per_batch: Optional[int] = None  # None: sized at start (lora/pool_sizing.py)
    max_lora_rank: Optional[int] = None
    lora_target_modules: Optional[list[str]] = None
    max_loaded_loras: Optional[int] = None
    # A folder of adapters loaded on first use: a request for an adapter that is not loaded, named
    # N, loads DIR/N (vLLM's filesystem resolver); at --max-loaded-loras the least recently used
    # idle adapter it loaded is unloaded first.
    lora_resolver_dir: Optional[str] = None
    lora_eviction_policy: str = "lru"
    lora_backend: str = "csgmv"
    max_lora_chunk_size: int = 16
    lora_fold: str = "auto"
    lora_fuse_norm: str = "auto"  # LORA_FUSE_NORM_MODES; True / False mean "on" / "off"
    # Bound, in scheduler turns, on how long a request whose adapter does not fit may wait before
    # requests for other adapters are held back until it fits (anti-starvation). Adapters rotate
    # through the slots before that (GroupedLoRAAdmission); a larger bound lets rotation, rather
    # than a drain of the whole batch, do more of the swapping, but a turn is slow on a CPU.
    lora_max_wait_turns: int = 64

    # CUDA graphs (resolved into `cuda_graph_config` by _handle_cuda_graph_config)
    cuda_graph_config: Optional[Any] = None
    cuda_graph_backend_prefill: Optional[str] = None
    cuda_graph_backend_decode: Optional[str] = None
    cuda_graph_max_bs_prefill: Optional[int] = None
    cuda_graph_max_bs_decode: Optional[int] = None
    cuda_graph_bs_prefill: Optional[list[int]] = None
    cuda_graph_bs_decode: Optional[list[int]] = None
    disable_prefill_cuda_graph: bool = False
    disable_decode_cuda_graph: bool = False
    disable_cuda_graph: bool = False

    # HTTP server
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: Optional[str] = None
    # On SIGINT/SIGTERM, seconds the requests in flight get to finish before they end with a 503
    # (vLLM's flag; a rolling restart that must not cut long replies gives it minutes).
    shutdown_timeout: float = 2.0
    log_level: str = "info"
    # One log line per finished request (its adapter and token counts; level 1 adds the sampling
    # parameters, 2 the first and last characters of the prompt and output).
    log_requests: bool = False
    log_requests_level: int = 0
    # Report prompt_tokens_details.cached_tokens in the OpenAI usage (as SGLang does with this flag).
    enable_cache_report: bool = False
    # Prometheus metrics at /metrics (managers/metrics.py).
    enable_metrics: bool = False
    # Largest top_logprobs / logprobs a request may ask for.
    max_top_logprobs: int = 20
    # Test-only: enables the fault-injection hook (never set in production).
    enable_test_hooks: bool = False

    # Derived (not CLI flags)
    _cuda_graph_config_input: Any = field(default=None, repr=False)
    _cuda_graph_config_locked: set = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        self._normalize_lora_args()
        self._validate()
        # Keep the raw JSON so the resolution can be re-run (e.g. after patching is_cuda in tests).
        if not isinstance(self.cuda_graph_config, CudaGraphConfig):
            self._cuda_graph_config_input = self.cuda_graph_config
        self._handle_cuda_graph_config()
        self._warn_flags_without_effect()

    @property
    def demo_serves_its_adapters(self) -> bool:
        """Whether the demo model (`--model-path demo`) comes with its two adapters: unless the user
        chose the adapters (--lora-paths) or an empty pool of their own shape (--enable-lora with
        --max-lora-rank and --lora-target-modules). A bare --enable-lora changes nothing."""
        own_pool = bool(self.enable_lora and self.max_lora_rank is not None and self.lora_target_modules)
        return self.model_path == "demo" and not self.lora_paths and not own_pool

    # ------------------------------------------------------------------ validation
    def _normalize_lora_args(self) -> None:
        if self.lora_paths:
            # A dict is one adapter's spec when it has "lora_path", else the Python API's
            # {name: path} mapping (as in SGLang). The mapping is checked before a lone str/dict is
            # wrapped in a list: wrapped first, it reached the parser as one malformed spec.
            if isinstance(self.lora_paths, dict) and "lora_path" not in self.lora_paths:
                self.lora_paths = [{"lora_name": k, "lora_path": v} for k, v in self.lora_paths.items()]
            if isinstance(self.lora_paths, (str, dict)):
                self.lora_paths = [self.lora_paths]
            self.lora_paths = [LoRAPathSpec.parse(p) for p in self.lora_paths]
            names = [p.lora_name for p in self.lora_paths]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"--lora-paths: duplicate adapter name(s) {dup}")
            if self.enable_lora is None:
                logger.info("--lora-paths given: enabling LoRA (--enable-lora).")
                self.enable_lora = True
            elif self.enable_lora is False:
                logger.warning("--enable-lora is false; ignoring --lora-paths.")
                self.lora_paths = None
        if self.lora_resolver_dir is not None:
            if not os.path.isdir(self.lora_resolver_dir):
                raise ValueError(f"--lora-resolver-dir {self.lora_resolver_dir!r} is not a directory")
            # Absolute: what the logs and /get_server_info show, whatever the working directory.
            self.lora_resolver_dir = os.path.abspath(self.lora_resolver_dir)
            if self.enable_lora is None:
                self.enable_lora = True
            elif self.enable_lora is False:
                raise ValueError("--lora-resolver-dir needs LoRA; drop --enable-lora false")
        self.enable_lora = bool(self.enable_lora)
        if isinstance(self.lora_target_modules, str):
            self.lora_target_modules = [self.lora_target_modules]

    def _validate(self) -> None:
        def choice(flag: str, value: Any, allowed: tuple) -> None:
            if value not in allowed:
                raise ValueError(f"{flag} must be one of {list(allowed)}, got {value!r}")

        def positive(flag: str, value: Optional[int], allow_none: bool = True) -> None:
            if value is None and allow_none:
                return
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{flag} must be a positive integer, got {value!r}")

        if not self.model_path:
            raise ValueError("--model-path must not be empty")
        choice("--load-format", self.load_format, LOAD_FORMATS)
        choice("--dtype", self.dtype, DTYPES)
        choice("--device", self.device, DEVICES)
        choice("--log-level", self.log_level, LOG_LEVELS)
        if self.attention_backend is not None:
            choice("--attention-backend", self.attention_backend, ATTENTION_BACKENDS)
        choice("--lora-backend", self.lora_backend, LORA_BACKENDS)
        choice("--lora-eviction-policy", self.lora_eviction_policy, LORA_EVICTION_POLICIES)
        choice("--max-lora-chunk-size", self.max_lora_chunk_size, LORA_CHUNK_SIZES)
        choice("--lora-fold", self.lora_fold, LORA_FOLD_MODES)
        if isinstance(self.lora_fuse_norm, bool):  # the Python API's flag form
            self.lora_fuse_norm = "on" if self.lora_fuse_norm else "off"
        choice("--lora-fuse-norm", self.lora_fuse_norm, LORA_FUSE_NORM_MODES)
        resolve_chat_template(self.chat_template)  # a missing file or unknown name fails at start
        if self.tool_call_parser is not None:
            choice("--tool-call-parser", self.tool_call_parser, tuple(TOOL_CALL_PARSERS))
        if self.reasoning_parser is not None:
            choice("--reasoning-parser", self.reasoning_parser, tuple(REASONING_PARSERS))
        choice("--schedule-policy", self.schedule_policy, SCHEDULE_POLICIES)
        if self.page_size != 1:
            raise ValueError(
                f"--page-size {self.page_size} is not supported: this server's KV cache pool allocates one "
                "token per page; use --page-size 1 (the default)"
            )
        choice("--log-requests-level", self.log_requests_level, LOG_REQUESTS_LEVELS)
        self._resolve_grammar_backend()
        # 1 is allowed (vLLM's gpu_memory_utilization takes it too): the activation reserve is
        # kept out of the KV cache apart from this fraction.
        if isinstance(self.mem_fraction_static, bool) or not (0.0 < self.mem_fraction_static <= 1.0):
            raise ValueError(
                f"--mem-fraction-static must be in (0, 1], got {self.mem_fraction_static!r}"
            )
        positive("--context-length", self.context_length)
        self.model_override_args()  # a typo is refused here, before anything loads
        positive("--max-total-tokens", self.max_total_tokens)
        positive("--max-running-requests", self.max_running_requests)
        positive("--max-queued-requests", self.max_queued_requests)
        positive("--max-prefill-tokens", self.max_prefill_tokens, allow_none=False)
        positive("--decode-log-interval", self.decode_log_interval, allow_none=False)
        positive("--max-top-logprobs", self.max_top_logprobs, allow_none=False)
        if self.chunked_prefill_size != -1:
            positive("--chunked-prefill-size (or -1 to turn chunking off)", self.chunked_prefill_size, False)
        if not (0 < self.port < 65536):
            raise ValueError(f"--port must be in 1..65535, got {self.port!r}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("--served-model-name must not be empty")
        if self.served_model_name is not None and ":" in self.served_model_name:
            raise ValueError(
                "--served-model-name must not contain ':' (requests use 'model=<base>:<adapter>'), "
                f"got {self.served_model_name!r}"
            )

        self._validate_parallelism(positive)

        # LoRA
        positive("--max-loras-per-batch", self.max_loras_per_batch)
        positive("--max-lora-rank", self.max_lora_rank)
        positive("--max-loaded-loras", self.max_loaded_loras)
        positive("--lora-max-wait-turns", self.lora_max_wait_turns, allow_none=False)
        if self.lora_target_modules is not None:
            for m in self.lora_target_modules:
                choice("--lora-target-modules", m, LORA_TARGET_MODULES)
            if "all" in self.lora_target_modules and len(self.lora_target_modules) > 1:
                raise ValueError("--lora-target-modules: 'all' must be given alone")
        if self.enable_lora and not self.demo_serves_its_adapters:
            if not self.lora_paths and (self.max_lora_rank is None or not self.lora_target_modules):
                raise ValueError(
                    "--enable-lora (or --lora-resolver-dir) without --lora-paths requires both --max-lora-rank "
                    "and --lora-target-modules (the pool is sized from them)"
                )
            if self.max_loaded_loras is not None:
                if self.max_loras_per_batch is not None and self.max_loaded_loras < self.max_loras_per_batch:
                    raise ValueError(
                        f"--max-loaded-loras ({self.max_loaded_loras}) must be >= "
                        f"--max-loras-per-batch ({self.max_loras_per_batch})"
                    )
                if self.lora_paths and len(self.lora_paths) > self.max_loaded_loras:
                    raise ValueError(
                        f"--lora-paths has {len(self.lora_paths)} adapters, more than "
                        f"--max-loaded-loras ({self.max_loaded_loras})"
                    )
            pinned = sum(1 for p in (self.lora_paths or []) if p.pinned)
            if self.max_loras_per_batch is not None and pinned > max(self.max_loras_per_batch - 1, 0):
                raise ValueError(
                    f"--lora-paths pins {pinned} adapters; at most --max-loras-per-batch - 1 "
                    f"({self.max_loras_per_batch - 1}) may be pinned, so one slot stays free for the others"
                )

        # CUDA graphs
        for flag, value, allowed in (
            ("--cuda-graph-backend-prefill", self.cuda_graph_backend_prefill, PREFILL_BACKENDS),
            ("--cuda-graph-backend-decode", self.cuda_graph_backend_decode, DECODE_BACKENDS),
        ):
            if value is not None:
                choice(flag, value, tuple(b.value for b in allowed))
        positive("--cuda-graph-max-bs-prefill", self.cuda_graph_max_bs_prefill)
        positive("--cuda-graph-max-bs-decode", self.cuda_graph_max_bs_decode)
        for flag, values in (
            ("--cuda-graph-bs-prefill", self.cuda_graph_bs_prefill),
            ("--cuda-graph-bs-decode", self.cuda_graph_bs_decode),
        ):
            for v in values or []:
                positive(flag, v, allow_none=False)

    def _resolve_grammar_backend(self) -> None:
        """None becomes the default backend; an explicit xgrammar must be installed."""
        if self.grammar_backend is None:
            self.grammar_backend = default_grammar_backend()
            return
        if self.grammar_backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"--grammar-backend must be one of {list(GRAMMAR_BACKENDS)}, got {self.grammar_backend!r}")
        if self.grammar_backend == "xgrammar" and not xgrammar_available():
            raise ValueError(f"--grammar-backend xgrammar: the xgrammar package is not installed "
                             f"(pip install {XGRAMMAR_REQUIREMENT}); or use --grammar-backend none")

    def _validate_parallelism(self, positive: Any) -> None:
        positive("--tp-size", self.tp_size, allow_none=False)
        positive("--nnodes", self.nnodes, allow_none=False)
        positive("--dist-timeout", self.dist_timeout)
        if (isinstance(self.watchdog_timeout, bool) or not isinstance(self.watchdog_timeout, (int, float))
                or not 0 <= self.watchdog_timeout < float("inf")):
            raise ValueError(f"--watchdog-timeout must be a number of seconds >= 0 (0: off), got {self.watchdog_timeout!r}")
        if (isinstance(self.shutdown_timeout, bool) or not isinstance(self.shutdown_timeout, (int, float))
                or not 0 <= self.shutdown_timeout < float("inf")):
            raise ValueError(f"--shutdown-timeout must be a number of seconds >= 0, got {self.shutdown_timeout!r}")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in 0..{self.nnodes - 1} (--nnodes {self.nnodes}), "
                             f"got {self.node_rank!r}")
        if self.tp_size % self.nnodes:
            raise ValueError(f"--tp-size ({self.tp_size}) must be a multiple of --nnodes ({self.nnodes}): "
                             "every node runs the same number of ranks")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, where "
                             "the ranks meet)")
        if self.dist_init_addr is not None:
            utils.parse_dist_init_addr(self.dist_init_addr)

    # ------------------------------------------------------------------ derived settings
    def model_override_args(self) -> dict:
        """--json-model-override-args, parsed: the keys that replace config.json's."""
        if not isinstance(self.json_model_override_args, str):
            raise ValueError("--json-model-override-args must be a JSON string, got "
                             f"{type(self.json_model_override_args).__name__}")
        try:
            value = json.loads(self.json_model_override_args or "{}")
        except json.JSONDecodeError as e:
            raise ValueError(f"--json-model-override-args is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"--json-model-override-args must be a JSON object, got {self.json_model_override_args!r}")
        return value

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        return "cuda" if utils.is_cuda() else "cpu"

    def resolved_overlap_schedule(self) -> bool:
        """Whether the scheduler overlaps decode steps: the flags when given (--disable wins), else on
        for a single-GPU CUDA server."""
        if self.disable_overlap_schedule:
            return False
        if self.enable_overlap_schedule is not None:
            return bool(self.enable_overlap_schedule)
        return self.resolved_device() == "cuda" and self.tp_size == 1  # several nodes need tp_size > 1

    def resolved_attention_backend(self) -> str:
        if self.attention_backend is not None:
            if (self.attention_backend == "triton" and self.resolved_device() == "cpu"
                    and os.environ.get("TRITON_INTERPRET") != "1"):
                # It would start, then fail every request (Triton has no CPU driver).
                raise ValueError("--attention-backend triton needs a CUDA device, or TRITON_INTERPRET=1 on a CPU; "
                                 "use --attention-backend torch_native")
            return self.attention_backend
        return "triton" if self.resolved_device() == "cuda" else "torch_native"

    def resolved_lora_backend(self) -> str:
        """The LoRA backend that can run here. The Triton backends (csgmv, triton) need a GPU, or
        the Triton interpreter (TRITON_INTERPRET=1) on a CPU; without either, torch_native."""
        if (
            self.lora_backend != "torch_native"
            and self.resolved_device() == "cpu"
            and os.environ.get("TRITON_INTERPRET") != "1"
        ):
            return "torch_native"
        return self.lora_backend

    def _warn_flags_without_effect(self) -> None:
        """Flags that size or shape GPU work are accepted on a CPU (a command line moves between
        machines), but say so instead of doing nothing silently."""
        if self.resolved_device() != "cpu":
            return
        if self.mem_fraction_static != field_defaults()["mem_fraction_static"]:
            logger.warning("--mem-fraction-static has no effect on a CPU: the KV cache there holds "
                           "--max-total-tokens tokens (a fixed default when unset).")
        graph_flags = {
            "--cuda-graph-config": self._cuda_graph_config_input,
            "--cuda-graph-backend-prefill": self.cuda_graph_backend_prefill,
            "--cuda-graph-backend-decode": self.cuda_graph_backend_decode,
            "--cuda-graph-max-bs-prefill": self.cuda_graph_max_bs_prefill,
            "--cuda-graph-max-bs-decode": self.cuda_graph_max_bs_decode,
            "--cuda-graph-bs-prefill": self.cuda_graph_bs_prefill,
            "--cuda-graph-bs-decode": self.cuda_graph_bs_decode,
        }
        given = [flag for flag, value in graph_flags.items() if value is not None]
        if given:
            logger.warning("CUDA graphs need a CUDA device; on this CPU every forward runs eagerly and %s %s "
                           "no effect.", ", ".join(given), "has" if len(given) == 1 else "have")

    # ------------------------------------------------------------------ CUDA graph resolution
    def _handle_cuda_graph_config(self) -> None:
        """Resolve every CUDA-graph flag into `self.cuda_graph_config` (the precedence:
        configs/cuda_graph_config.resolve_cuda_graph_flags), then apply the compatibility rules
        to a prefill backend nobody chose explicitly."""
        cfg, locked = resolve_cuda_graph_flags(
            on_cuda=utils.is_cuda() and self.device in ("auto", "cuda"),
            disable_all=self.disable_cuda_graph,
            disable={Phase.DECODE: self.disable_decode_cuda_graph, Phase.PREFILL: self.disable_prefill_cuda_graph},
            backend={Phase.DECODE: self.cuda_graph_backend_decode, Phase.PREFILL: self.cuda_graph_backend_prefill},
            max_bs={Phase.DECODE: self.cuda_graph_max_bs_decode, Phase.PREFILL: self.cuda_graph_max_bs_prefill},
            bs={Phase.DECODE: self.cuda_graph_bs_decode, Phase.PREFILL: self.cuda_graph_bs_prefill},
            json_input=self._cuda_graph_config_input,
        )
        self.cuda_graph_config = cfg
        self._cuda_graph_config_locked = locked
        if (Phase.PREFILL.value, "backend") not in locked:
            # Breakable and full have no auto-disable rule here: both support LoRA (DESIGN §6);
            # what the runtime cannot serve (e.g. the torch_native LoRA backend) it runs eagerly.
            self._disable_tc_piecewise_cudagraph_if_incompatible()
        if cfg.prefill.backend == Backend.FULL:
            logger.warning(
                "cuda_graph_config[prefill].backend='full' captures attention with a fixed number of "
                "request slots; batches with more requests run eagerly."
            )

    def _disable_tc_piecewise_cudagraph_if_incompatible(self) -> None:
        """tc_piecewise (torch.compile) cannot follow per-batch LoRA metadata, among other things."""
        cfg = self.cuda_graph_config
        if cfg.prefill.backend != Backend.TC_PIECEWISE:
            return
        rules = (
            ("non-CUDA hardware", lambda: is_hip() or is_npu() or is_cpu() or is_mps() or is_xpu()),
            # Dynamo guards on the LoRA batch info break on every batch; breakable/full support LoRA.
            ("LoRA", lambda: bool(self.lora_paths) or bool(self.enable_lora)),
            ("deterministic inference", lambda: self.enable_deterministic_inference),
        )
        for reason, matches in rules:
            if matches():
                logger.warning(
                    "tc_piecewise CUDA graph is incompatible with %s; disabling prefill CUDA graph.",
                    reason,
                )
                cfg.prefill.backend = Backend.DISABLED
                return

    # ------------------------------------------------------------------ CLI
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """The launch_server flags (their table is server_args_cli.py), defaulting to these fields."""
        add_cli_args(parser, field_defaults())

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        names = {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def to_public_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            if f.name.startswith("_") or f.name == "api_key":
                continue
            value = getattr(self, f.name)
            if isinstance(value, CudaGraphConfig):
                value = value.to_dict()
            elif isinstance(value, list):
                value = [dataclasses.asdict(v) if isinstance(v, LoRAPathSpec) else v for v in value]
            out[f.name] = value
        # The backend that runs, not the one asked for (a CPU without the Triton interpreter falls
        # back to torch_native): a reader of /get_server_info should not have to know that rule.
        out["lora_backend"] = self.resolved_lora_backend()
        return out


def field_defaults() -> dict[str, Any]:
    """Every public ServerArgs field's default (what a flag not given leaves)."""
    out = {}
    for f in dataclasses.fields(ServerArgs):
        if f.name.startswith("_"):
            continue
        out[f.name] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return out


def prepare_server_args(argv: list[str]) -> ServerArgs:
    """ServerArgs from launch_server's command line."""
    parser = ServerArgumentParser(
        prog="python -m sglang.launch_server",
        description="Serve a Hugging Face checkpoint with many LoRA adapters under CUDA graphs.",
        formatter_class=DefaultsHelpFormatter,
    )
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(argv))
