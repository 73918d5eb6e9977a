"""From `ServerArgs` (what the user asked for) to the frozen `RunConfigs` the engine runs on
(configs/run_configs.py), once, at start. Everything derived from the flags is derived here: the
demo model when no model is given, the device and backends that can run, the model's config
(read once) and its tensor-parallel split (computed once), the startup adapters' ids.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Optional, Sequence

from sglang.srt.configs.lora_path_spec import LoRAPathSpec
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.configs.run_configs import (
    LoRARunConfig,
    RunConfigs,
    RunnerConfig,
    SchedulerConfig,
    TokenizerManagerConfig,
    TPLayout,
)
from sglang.srt.configs.tokenizer import TokenizerSpec
from sglang.srt.configs.tp_split import TPSplit, tp_split
from sglang.srt.lora.lora_config import LoRAConfig, normalize_target_modules
from sglang.srt.lora.lora_registry import make_lora_ref
from sglang.srt.models.registry import get_model_class
from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


def resolve_model(server_args: ServerArgs) -> ServerArgs:
    """The arguments to run: as given, or, for `--model-path demo`, the built-in demo model (and
    its two adapters) materialised into the cache folder. A new ServerArgs, validated again."""
    if server_args.model_path != "demo":
        if not os.path.isdir(server_args.model_path):
            path = server_args.model_path
            # "org/name" that is no folder here is most likely a Hub id: say that nothing downloads.
            hub = (" It looks like a Hugging Face Hub id: this server downloads nothing; download the "
                   "checkpoint first (e.g. `huggingface-cli download`) and pass its folder.")
            raise ValueError(
                f"--model-path {path!r} is not a directory. Pass a Hugging Face "
                "checkpoint folder, or leave --model-path out to serve the built-in demo model."
                + (hub if path.count("/") == 1 and not path.startswith((".", "/", "~")) else "")
            )
        return server_args
    from sglang.srt.tools.demo import ensure_demo_model  # writes files: only for the demo

    demo = ensure_demo_model()
    changes: dict = {"model_path": demo.model_path, "served_model_name": server_args.served_model_name or "demo"}
    if server_args.demo_serves_its_adapters:
        # The zero-setup run shows multi-LoRA serving too. (With --lora-paths the user chose the
        # adapters, with --enable-lora and a pool shape an empty pool: their choice stands.)
        names = _demo_adapters_that_fit(server_args)
        if names:
            changes.update(lora_paths=[LoRAPathSpec(name, demo.adapters[name]) for name in names], enable_lora=True)
    return dataclasses.replace(server_args, **changes)


def _flag_modules(target_modules: Optional[Sequence[str]]) -> Optional[set[str]]:
    """The fused modules --lora-target-modules covers ("all": every one); None when not given."""
    return normalize_target_modules(target_modules) if target_modules else None


def _demo_adapters_that_fit(args: ServerArgs) -> list[str]:
    """The demo adapters whose rank and modules fit a pool the user sized in part
    (--max-lora-rank, or --lora-target-modules, alone): an adapter they never asked for must not
    stop the server at start."""
    from sglang.srt.tools.demo import DEMO_ADAPTERS

    pool = _flag_modules(args.lora_target_modules)
    names = [spec.name for spec in DEMO_ADAPTERS
             if (args.max_lora_rank is None or spec.rank <= args.max_lora_rank)
             and (pool is None or normalize_target_modules(spec.target_modules) <= pool)]
    if len(names) < len(DEMO_ADAPTERS):
        logger.info("demo: serving %s; the other demo adapters do not fit --max-lora-rank / --lora-target-modules",
                    ", ".join(names) or "no adapter")
    return names


def check_tensor_parallel(model: ModelConfig, tp_size: int) -> TPSplit:
    """The model's split over `tp_size` ranks; ValueError, before any process starts, if it cannot
    be split so or its model class does not shard its layers."""
    split = tp_split(model, tp_size)
    model_cls = get_model_class(model.architectures)
    if tp_size > 1 and not getattr(model_cls, "supports_tensor_parallel", False):
        raise ValueError(
            f"{model_cls.__name__} does not support --tp-size > 1 yet (its layers are not wired for "
            "tensor parallelism); run it with --tp-size 1"
        )
    return split


def _lora_config(args: ServerArgs) -> Optional[LoRARunConfig]:
    if not args.enable_lora:
        return None
    return LoRARunConfig(
        refs=tuple(make_lora_ref(spec) for spec in args.lora_paths or ()),
        max_loras_per_batch=args.max_loras_per_batch,
        backend=args.resolved_lora_backend(),
        requested_backend=args.lora_backend,
        eviction_policy=args.lora_eviction_policy,
        chunk_size=args.max_lora_chunk_size,
        fold=args.lora_fold,
        fuse_norm=args.lora_fuse_norm,
        max_lora_rank=args.max_lora_rank,
        target_modules=tuple(args.lora_target_modules) if args.lora_target_modules else None,
        max_loaded_loras=args.max_loaded_loras,
    )


def _check_startup_adapter_names(lora: Optional[LoRARunConfig], tm: TokenizerManagerConfig) -> None:
    """Refuse `--lora-paths` names of the base model (its served name, path or "default"), as
    /load_lora_adapter does: `model="<name>"` would select the adapter, leaving the base model with
    no name to be chosen by, and /v1/models would list the name twice."""
    if lora is None:
        return
    clash = sorted(ref.lora_name for ref in lora.refs if ref.lora_name in tm.base_model_names)
    if clash:
        raise ValueError(
            f"--lora-paths: adapter name(s) {', '.join(map(repr, clash))} are names of the base model "
            f"(served as {tm.served_model_name!r}; 'default' and the model path also mean it), so "
            "model=\"<name>\" could not tell the two apart; give the adapter(s) another name (NAME=PATH)"
        )


def _check_startup_adapter_configs(lora: Optional[LoRARunConfig]) -> None:
    """Read every `--lora-paths` adapter's adapter_config.json before any process starts: a typo in
    a path, or an adapter the flags cannot hold, is told in a second, not after the weights load
    (minutes for a real model). The checks that need the model's shapes run at load."""
    if lora is None:
        return
    covered = _flag_modules(lora.target_modules)
    for ref in lora.refs:
        try:
            config = LoRAConfig.from_path(ref.lora_path)
            if lora.max_lora_rank is not None and config.r > lora.max_lora_rank:
                raise ValueError(f"its rank {config.r} is above --max-lora-rank {lora.max_lora_rank}; give "
                                 f"--max-lora-rank {config.r} (or higher) to serve it")
            outside = [] if covered is None else sorted(
                p for p in config.target_projections() if not normalize_target_modules([p]) <= covered)
            if outside:
                raise ValueError(f"it targets module(s) {outside} outside --lora-target-modules "
                                 f"{' '.join(lora.target_modules)}; add them (or give 'all') to serve it")
        except ValueError as e:
            raise ValueError(f"Failed to load LoRA adapter {ref.lora_name!r} at startup (--lora-paths): {e}") from None


def build_run_configs(server_args: ServerArgs, model: Optional[ModelConfig] = None) -> RunConfigs:
    """Everything the engine runs on. `model`: the model's config when the caller read it already
    (tests); else it is read here, once."""
    args = resolve_model(server_args)
    device = args.resolved_device()
    if model is None:
        model = ModelConfig.from_pretrained(args.model_path, context_length=args.context_length, dtype=args.dtype,
                                            device=device, overrides=args.model_override_args())
    split = check_tensor_parallel(model, args.tp_size)
    lora = _lora_config(args)
    tokenizer = None if args.skip_tokenizer_init else TokenizerSpec(
        args.tokenizer_path or args.model_path, args.trust_remote_code, args.chat_template)
    runner = RunnerConfig(
        model=model, split=split, device=device, attention_backend=args.resolved_attention_backend(),
        cuda_graph=args.cuda_graph_config, load_format=args.load_format, random_seed=args.random_seed,
        deterministic=args.enable_deterministic_inference, mem_fraction_static=args.mem_fraction_static,
        max_total_tokens=args.max_total_tokens, max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size, max_prefill_tokens=args.max_prefill_tokens, lora=lora,
    )
    scheduler = SchedulerConfig(
        runner=runner, tokenizer=tokenizer, schedule_policy=args.schedule_policy,
        disable_radix_cache=args.disable_radix_cache, decode_log_interval=args.decode_log_interval,
        lora_max_wait_turns=args.lora_max_wait_turns, log_level=args.log_level,
        max_queued_requests=args.max_queued_requests,
        enable_test_hooks=args.enable_test_hooks,
        overlap_schedule=args.resolved_overlap_schedule(), watchdog_timeout=args.watchdog_timeout,
        grammar_backend=args.grammar_backend,
    )
    tokenizer_manager = TokenizerManagerConfig(
        model_path=args.model_path, served_model_name=args.served_model_name or args.model_path,
        tokenizer=tokenizer, lora_refs=lora.refs if lora is not None else None,
        lora_resolver_dir=args.lora_resolver_dir if lora is not None else None,
        max_loaded_loras=args.max_loaded_loras,
        max_top_logprobs=args.max_top_logprobs, log_requests=args.log_requests,
        log_requests_level=args.log_requests_level, enable_metrics=args.enable_metrics,
        enable_cache_report=args.enable_cache_report, enable_test_hooks=args.enable_test_hooks,
        grammar_backend=args.grammar_backend, public_args=args.to_public_dict(),
    )
    _check_startup_adapter_names(lora, tokenizer_manager)
    _check_startup_adapter_configs(lora)
    tp = TPLayout(size=args.tp_size, nnodes=args.nnodes, node_rank=args.node_rank, device=device, split=split,
                  dist_init_addr=args.dist_init_addr, dist_timeout=args.dist_timeout)
    return RunConfigs(tp=tp, scheduler=scheduler, tokenizer_manager=tokenizer_manager)
