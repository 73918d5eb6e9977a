"""`LoRAManager`: adapters of the scheduler process, from files to the metadata a forward reads.

It owns the backend (kernels + batch metadata), the GPU slot pool, the host copies of every loaded
adapter, and the wrappers it puts around the model's fused linears. The model runner creates it
after the model is loaded (before memory sizing: the pool takes device memory) and, before each
forward, calls `prepare_lora_batch` with the path (decode graph, prefill graph or eager) that the
runner has already chosen; the manager never re-derives that choice (DESIGN §6).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Optional

import torch
from torch import nn

from sglang.srt.lora.backend import get_backend_from_name
from sglang.srt.lora.fold_model import fold_base_layers, foldable_modules
from sglang.srt.lora.layers import BaseLayerWithLoRA, get_lora_layer
from sglang.srt.lora.lora import LoRAAdapter, LoRAModelShapes, LoRAModuleShape, module_shape
from sglang.srt.lora.lora_config import SUPPORTED_LORA_MODULES, LoRAConfig, normalize_target_modules
from sglang.srt.lora.lora_registry import make_lora_ref
from sglang.srt.lora.mem_pool import EMPTY, LoRAMemoryPool
from sglang.srt.lora.utils import LoRAModuleSpec, LoRAModuleWeights
from sglang.srt.configs.lora_ref import LoRARef, LoRAUpdateOutput

if TYPE_CHECKING:
    from sglang.srt.configs.forward_batch_info import ForwardBatch
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

_MODULE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:.*\.)?(" + "|".join(SUPPORTED_LORA_MODULES) + r")$")


def find_lora_target_layers(model: nn.Module) -> dict[str, dict[int, str]]:
    """module kind -> layer id -> full module name, for every fused linear LoRA can wrap."""
    found: dict[str, dict[int, str]] = {}
    for name, _ in model.named_modules():
        m = _MODULE_NAME.search(name)
        if m is not None:
            found.setdefault(m.group(2), {})[int(m.group(1))] = name
    return found


def model_shapes(model: nn.Module, num_layers: Optional[int] = None) -> LoRAModelShapes:
    """The LoRA-relevant shapes, read from the built model's linear layers."""
    found = find_lora_target_layers(model)
    if not found:
        raise ValueError(
            "The model has no layers.{i}.(qkv_proj|o_proj|gate_up_proj|down_proj) modules for LoRA"
        )
    n = num_layers or 1 + max(i for per_layer in found.values() for i in per_layer)
    modules: dict[str, LoRAModuleShape] = {}
    for kind, per_layer in found.items():
        shapes = set()
        for name in per_layer.values():
            layer = model.get_submodule(name)
            if isinstance(layer, BaseLayerWithLoRA):
                layer = layer.base_layer
            shapes.add(module_shape(layer))
        assert len(shapes) == 1, f"{kind} differs across layers: {shapes}"
        modules[kind] = shapes.pop()
    return LoRAModelShapes(num_layers=n, modules=modules)


@dataclass
class LoRAIntegrityReport:
    ok: bool
    problems: list[str] = field(default_factory=list)
    resident: dict[int, Optional[str]] = field(default_factory=dict)  # slot -> uid (EMPTY slots left out)

    def __bool__(self) -> bool:
        return self.ok


class LoRAManager:
    # This engine has no data-parallel attention; kept so the eligibility predicate reads like the contract.
    enable_dp_attention = False

    def __init__(
        self,
        base_model: nn.Module,
        model_config: Any,
        server_args: "ServerArgs",
        device: torch.device | str,
        dtype: torch.dtype,
        lora_refs: Optional[Iterable[LoRARef]] = None,
    ) -> None:
        self.base_model = base_model
        self.model_config = model_config
        self.server_args = server_args
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_loras_per_batch = server_args.max_loras_per_batch
        self.max_loaded_loras = server_args.max_loaded_loras
        self.base_vocab_size: Optional[int] = getattr(model_config, "vocab_size", None)
        if lora_refs is None:
            lora_refs = [make_lora_ref(spec) for spec in (server_args.lora_paths or [])]
        startup_refs = list(lora_refs)

        backend_name = server_args.resolved_lora_backend()
        if backend_name != server_args.lora_backend:
            logger.warning(
                "LoRA backend %r needs a GPU (or TRITON_INTERPRET=1 on a CPU); using %r on the CPU.",
                server_args.lora_backend, backend_name,
            )
        backend_cls = get_backend_from_name(backend_name)
        self.lora_backend = backend_cls(
            # The kernels index every slot of the pool: the adapters' and the base model's.
            max_loras_per_batch=self.max_loras_per_batch + 1,
            device=self.device,
            max_lora_chunk_size=server_args.max_lora_chunk_size,
        )

        # Host state of the loaded adapters, keyed by lora_id.
        self.adapters: dict[str, LoRAAdapter] = {}
        self.refs: dict[str, LoRARef] = {}
        self.pinned_ids: set[str] = set()

        num_layers = getattr(model_config, "num_hidden_layers", None)
        self.shapes = model_shapes(base_model, num_layers)
        startup_configs = {ref.lora_id: self._read_startup_config(ref) for ref in startup_refs}
        target_modules = self._resolve_target_modules(startup_configs.values())
        max_rank = server_args.max_lora_rank or max((c.r for c in startup_configs.values()), default=0)
        if max_rank <= 0:
            raise ValueError(
                "LoRA is enabled but the pool rank is unknown: give --max-lora-rank or --lora-paths"
            )

        self.pool = LoRAMemoryPool(
            self.shapes,
            target_modules,
            self.max_loras_per_batch,
            max_rank,
            dtype,
            self.device,
            server_args.lora_eviction_policy,
            fold_candidates=self._fold_candidates(target_modules),
            fold_mode=server_args.lora_fold,
        )
        self._fold_base_weights()
        self.lora_modules: dict[int, dict[str, BaseLayerWithLoRA]] = {}
        self._wrap_modules()

        for ref in startup_refs:
            try:
                self._load_adapter(ref, startup_configs[ref.lora_id])
            except ValueError as e:
                raise ValueError(f"Failed to load LoRA adapter {ref.lora_name!r} at startup: {e}") from None
        logger.info(
            "LoRA: backend %s, %d slots, max rank %d, modules %s, adapters %s",
            self.lora_backend.name,
            self.max_loras_per_batch,
            max_rank,
            self.pool.target_modules,
            sorted(self.loaded_adapters()),
        )

    @classmethod
    def from_model_runner(
        cls, model_runner: Any, lora_refs: Optional[Iterable[LoRARef]] = None
    ) -> "LoRAManager":
        return cls(
            model_runner.model,
            model_runner.model_config,
            model_runner.server_args,
            model_runner.device,
            model_runner.dtype,
            lora_refs,
        )

    # ------------------------------------------------------------------ set-up
    def _read_startup_config(self, ref: LoRARef) -> LoRAConfig:
        try:
            return LoRAConfig.from_path(ref.lora_path, self.base_vocab_size)
        except ValueError as e:
            raise ValueError(f"Failed to load LoRA adapter {ref.lora_name!r} at startup: {e}") from None

    def _resolve_target_modules(self, configs: Iterable[LoRAConfig]) -> set[str]:
        available = set(self.shapes.modules)
        cli = self.server_args.lora_target_modules
        if cli:
            wanted = normalize_target_modules(cli)
            if "all" in cli:
                return wanted & available
            missing = sorted(wanted - available)
            if missing:
                raise ValueError(f"--lora-target-modules: the model has no module(s) {missing}")
            return wanted
        union: set[str] = set()
        for cfg in configs:
            union |= cfg.normalized_target_modules
        if not union:
            raise ValueError("LoRA is enabled but no target modules are known: give --lora-target-modules")
        return union

    def _wrap_modules(self) -> None:
        found = find_lora_target_layers(self.base_model)
        pool = self.pool
        specs: dict[str, LoRAModuleSpec] = {}
        for module in pool.target_modules:
            shape = self.shapes.modules[module]
            folded = module in pool.fold_modules
            spec = specs[module] = LoRAModuleSpec(
                module, shape.in_dim, tuple(shape.out_sizes), pool.max_lora_rank,
                pool.fold_extra_columns(module) if folded else 0,
            )
            for layer_id, name in sorted(found.get(module, {}).items()):
                parent_name, _, child = name.rpartition(".")
                parent = self.base_model.get_submodule(parent_name) if parent_name else self.base_model
                current = getattr(parent, child)
                if isinstance(current, BaseLayerWithLoRA):  # wrapped already (a second manager)
                    current = current.base_layer
                wrapper = get_lora_layer(current, self.lora_backend)
                wrapper.set_lora_info(
                    LoRAModuleWeights(
                        spec,
                        pool.A_buffer[module][layer_id],
                        pool.B_buffer[module][layer_id],
                        wrapper.backend_bias,
                        pool.folded_weight[module][layer_id] if folded else None,
                    )
                )
                setattr(parent, child, wrapper)
                self.lora_modules.setdefault(layer_id, {})[module] = wrapper
        self.lora_backend.init_modules(specs, pool.slot_ranks_device, pool.slot_scalings_device, self.dtype)

    # ------------------------------------------------------------------ folding (lora/fold.py)
    def _fold_candidates(self, target_modules: Iterable[str]) -> list[str]:
        """Modules whose adapters may be folded into the base GEMM (the pool applies the rule)."""
        if not self.lora_backend.supports_fold or self.server_args.lora_fold == "off":
            return []
        return foldable_modules(self.base_model, find_lora_target_layers(self.base_model), target_modules, self.dtype)

    def _fold_base_weights(self) -> None:
        """Re-lay every folded module's base weight as W_aug (held by the pool; its extra columns
        are the pool's B). Runs once, before any graph capture; W_aug is never reallocated."""
        found = find_lora_target_layers(self.base_model)
        for module in self.pool.target_modules:
            if module not in self.pool.fold_modules:
                logger.info("LoRA %s: separate shrink and expand kernels (not folded)", module)
                continue
            fold_base_layers(self.base_model, found[module], self.pool, module)
            shape = self.shapes.modules[module]
            extra = self.pool.fold_extra_columns(module)
            mib = shape.out_dim * extra * torch.empty((), dtype=self.dtype).element_size() / 2**20
            logger.info(
                "LoRA %s: folded into the base GEMM, W_aug [%d, %d + %d] (+%.1f MiB read per layer and forward)",
                module, shape.out_dim, shape.in_dim, extra, mib,
            )

    # ------------------------------------------------------------------ adapters
    def loaded_adapters(self) -> dict[str, str]:
        return {ref.lora_name: ref.lora_path for ref in self.refs.values()}

    def _load_adapter(self, ref: LoRARef, config: Optional[LoRAConfig] = None) -> None:
        """Validate and load; raises ValueError and changes nothing on failure."""
        if any(r.lora_name == ref.lora_name for r in self.refs.values()):
            raise ValueError("an adapter with this name is already loaded")
        if ref.lora_id in self.refs:
            raise ValueError(f"adapter id {ref.lora_id!r} is already in use")
        if self.max_loaded_loras is not None and len(self.refs) >= self.max_loaded_loras:
            raise ValueError(
                f"{len(self.refs)} adapters are loaded, the limit set by --max-loaded-loras; unload one first"
            )
        if ref.pinned and len(self.pinned_ids) >= self.max_loras_per_batch - 1:
            raise ValueError(
                f"it cannot be pinned: {len(self.pinned_ids)} adapter(s) are pinned already and at most "
                f"--max-loras-per-batch - 1 = {self.max_loras_per_batch - 1} may be, so that one slot stays "
                "free for unpinned adapters"
            )
        if any(r.lora_path == ref.lora_path for r in self.refs.values()):
            logger.warning(
                "LoRA adapter %r loads %s, which another loaded adapter uses too",
                ref.lora_name,
                ref.lora_path,
            )
        if config is None:
            config = LoRAConfig.from_path(ref.lora_path, self.base_vocab_size)
        reason = self.pool.incompatibility(config)
        if reason is not None:
            raise ValueError(reason)
        adapter = LoRAAdapter.load(ref.lora_id, config, self.shapes)
        # Commit only now: every check passed.
        self.adapters[ref.lora_id] = adapter
        self.refs[ref.lora_id] = ref
        if ref.pinned:
            self.pinned_ids.add(ref.lora_id)

    def load_lora_adapter(self, lora_ref: LoRARef) -> LoRAUpdateOutput:
        try:
            self._load_adapter(lora_ref)
        except Exception as e:  # a bad adapter must never take the server down
            if not isinstance(e, ValueError):
                logger.exception("Unexpected error loading LoRA adapter %r", lora_ref.lora_name)
            return LoRAUpdateOutput(
                success=False,
                error_message=f"Failed to load LoRA adapter {lora_ref.lora_name!r}: {e}",
                loaded_adapters=self.loaded_adapters(),
            )
        logger.info("LoRA adapter %r loaded from %s", lora_ref.lora_name, lora_ref.lora_path)
        return LoRAUpdateOutput(success=True, loaded_adapters=self.loaded_adapters())

    def unload_lora_adapter(self, lora_ref: LoRARef) -> LoRAUpdateOutput:
        lora_id = lora_ref.lora_id if lora_ref.lora_id in self.refs else None
        if lora_id is None:
            lora_id = next((i for i, r in self.refs.items() if r.lora_name == lora_ref.lora_name), None)
        if lora_id is None:
            return LoRAUpdateOutput(
                success=False,
                error_message=f"LoRA adapter {lora_ref.lora_name!r} is not loaded",
                loaded_adapters=self.loaded_adapters(),
            )
        self.pool.free(lora_id)
        del self.adapters[lora_id]
        ref = self.refs.pop(lora_id)
        self.pinned_ids.discard(lora_id)
        logger.info("LoRA adapter %r unloaded", ref.lora_name)
        return LoRAUpdateOutput(success=True, loaded_adapters=self.loaded_adapters())

    # ------------------------------------------------------------------ batches
    def validate_lora_batch(self, lora_ids: set[Optional[str]]) -> bool:
        """Whether a batch with these distinct adapters fits in the adapter slots. The base model
        (None) has a slot of its own and never counts.

        Pinned adapters are counted as occupying their slots whether or not the batch uses them,
        so admission never depends on which of them happen to be resident.
        """
        return len((set(lora_ids) - {None}) | self.pinned_ids) <= self.max_loras_per_batch

    def fetch_new_loras(self, lora_ids: set[Optional[str]]) -> None:
        """Make every adapter of the batch resident (evicting adapters outside it); the current
        stream waits for their slots' copies."""
        self.pool.prepare_lora_batch(set(lora_ids), self.adapters, self.pinned_ids)

    def prefetch(self, wanted: list[str], protected: set[Optional[str]]) -> list[str]:
        """Start loading adapters that waiting requests want (most wanted first) into slots the
        `protected` adapters (the running ones) do not need; the copies overlap the next forward."""
        return self.pool.prefetch(wanted, self.adapters, protected, self.pinned_ids)

    def prepare_lora_batch(
        self,
        forward_batch: "ForwardBatch",
        use_cuda_graph: bool = False,
        use_prefill_cuda_graph: bool = False,
        use_lora: bool = True,
    ) -> None:
        """Fetch the batch's adapters and write its metadata where the chosen path reads it.

        The flags are the caller's decision for this forward, passed through unchanged.
        `use_lora=False` (an all-base batch, or a capture of the graphs without LoRA) clears the
        backend's `batch_info`: every wrapper then runs its base layer alone, and no static
        metadata is touched.
        """
        if not use_lora:
            assert not (use_cuda_graph or use_prefill_cuda_graph), "static LoRA metadata without LoRA"
            self.lora_backend.batch_info = None
            return
        bs = forward_batch.batch_size
        lora_ids = forward_batch.lora_ids if forward_batch.lora_ids is not None else [None] * bs
        if len(lora_ids) != bs:
            raise ValueError(f"forward batch has {bs} requests but {len(lora_ids)} lora_ids")
        self.fetch_new_loras(set(lora_ids))
        weight_indices = [self.pool.get_slot(uid) for uid in lora_ids]
        self.lora_backend.prepare_lora_batch(
            forward_batch,
            weight_indices,
            list(self.pool.slot_ranks),
            list(self.pool.slot_scalings),
            use_cuda_graph,
            use_prefill_cuda_graph,
        )

    # ------------------------------------------------------------------ CUDA graphs
    def init_cuda_graph_batch_info(self, max_bs_in_cuda_graph: int, num_tokens_per_bs: int = 1) -> None:
        backend = self.lora_backend
        if backend.cuda_graph_batch_info is not None:
            # Graphs already captured hold the addresses of the existing buffers: never move them.
            if backend.max_bs_in_cuda_graph < max_bs_in_cuda_graph:
                raise ValueError(
                    f"decode LoRA graph metadata exists for {backend.max_bs_in_cuda_graph} requests; "
                    f"cannot grow it to {max_bs_in_cuda_graph}"
                )
            return
        backend.init_cuda_graph_batch_info(max_bs_in_cuda_graph, num_tokens_per_bs)

    def init_prefill_cuda_graph_batch_info(self, max_num_tokens: int) -> None:
        backend = self.lora_backend
        if backend.prefill_cuda_graph_batch_info is not None:
            # Shared by every prefill graph of this process (e.g. breakable and full side by side
            # in a benchmark); reallocating would strand the graphs captured earlier.
            if backend.prefill_cuda_graph_max_tokens < max_num_tokens:
                raise ValueError(
                    f"prefill LoRA graph metadata exists for {backend.prefill_cuda_graph_max_tokens} "
                    f"tokens; cannot grow it to {max_num_tokens}"
                )
            return
        backend.init_prefill_cuda_graph_batch_info(max_num_tokens)

    @property
    def supports_prefill_cuda_graph(self) -> bool:
        backend = self.lora_backend
        return (
            bool(backend.supports_prefill_cuda_graph)
            and not backend.is_moe_lora
            and not self.enable_dp_attention
        )

    @property
    def prefill_cuda_graph_max_bs(self) -> Optional[int]:
        return self.lora_backend.prefill_cuda_graph_max_bs

    def can_use_prefill_cuda_graph(self, forward_batch: "ForwardBatch") -> bool:
        """The one predicate for "this extend batch can replay the prefill graph with LoRA"."""
        max_bs = self.lora_backend.prefill_cuda_graph_max_bs
        max_tokens = self.lora_backend.prefill_cuda_graph_max_tokens
        if max_bs is None or max_tokens is None:
            return False
        if self.enable_dp_attention:
            return False
        mode = forward_batch.forward_mode
        if not mode.is_extend() or mode.is_cuda_graph():
            return False
        if forward_batch.extend_num_tokens is None:
            return False
        return forward_batch.batch_size <= max_bs and forward_batch.extend_num_tokens <= max_tokens

    # ------------------------------------------------------------------ checks
    def integrity_report(self) -> LoRAIntegrityReport:
        """Cheap host-side consistency check for the scheduler's idle time."""
        pool = self.pool
        problems = list(pool.integrity_problems())
        for slot, uid in enumerate(pool.slot_to_uid):
            if uid is EMPTY or uid is None:
                continue
            adapter = self.adapters.get(uid)
            if adapter is None:
                problems.append(f"slot {slot} holds {uid!r}, which is not loaded")
            elif pool.slot_ranks[slot] != adapter.rank:
                problems.append(
                    f"slot {slot} has rank {pool.slot_ranks[slot]}, adapter {uid!r} has {adapter.rank}"
                )
        if not self.pinned_ids <= set(self.adapters):
            problems.append(f"pinned ids {sorted(self.pinned_ids - set(self.adapters))} are not loaded")
        if len(self.pinned_ids) > max(self.max_loras_per_batch - 1, 0):
            problems.append(f"{len(self.pinned_ids)} pinned adapters leave no free slot")
        if set(self.adapters) != set(self.refs):
            problems.append("adapter and ref tables disagree")
        if self.max_loaded_loras is not None and len(self.adapters) > self.max_loaded_loras:
            problems.append(f"{len(self.adapters)} adapters loaded, above --max-loaded-loras")
        resident = {s: u for s, u in enumerate(pool.slot_to_uid) if u is not EMPTY}
        return LoRAIntegrityReport(ok=not problems, problems=problems, resident=resident)
