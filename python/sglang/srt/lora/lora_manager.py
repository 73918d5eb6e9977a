"""`LoRAManager`: adapters of the scheduler process, from files to the metadata a forward reads.

It owns the backend (kernels + batch metadata), the GPU slot pool, the host copies of every loaded
adapter, and the wrappers it puts around the model's fused linears (lora/model_wrapping.py). The
model runner creates it after the model is loaded (before memory sizing: the pool takes device
memory) and is the only caller in a forward: `prepare_forward` gets the runner's `ForwardPlan`,
makes the batch's adapters resident once, and hands the plan's path to the backend; the manager
never re-derives that choice (DESIGN §6).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

import torch
from torch import nn
from tqdm import tqdm

from sglang.srt.configs.forward_path import ForwardPlan
from sglang.srt.configs.lora_ref import LoRARef, LoRAUpdateOutput
from sglang.srt.configs.run_configs import LoRARunConfig
from sglang.srt.distributed import SINGLE_RANK, TensorParallelGroup
from sglang.srt.lora.backend import get_backend_from_name
from sglang.srt.lora.layers import BaseLayerWithLoRA
from sglang.srt.lora.lora import LoRAAdapter
from sglang.srt.lora.lora_config import LoRAConfig, normalize_target_modules
from sglang.srt.lora.mem_pool import EMPTY, LoRAMemoryPool
from sglang.srt.lora.model_wrapping import (
    find_lora_target_layers,
    fold_base_weights,
    fold_candidates,
    model_shapes,
    wrap_lora_modules,
)
from sglang.srt.lora.norm_fusion import attach_norm_fusion
from sglang.srt.lora.pool_sizing import auto_slot_count

if TYPE_CHECKING:
    from sglang.srt.configs.forward_batch_info import ForwardBatch

logger = logging.getLogger(__name__)

# Threads reading startup adapters at once (file reads, tensor checks, conversion and pinning
# overlap): half the cores, 2 to 8, each running its tensor ops on one core (below).
STARTUP_LOAD_THREADS = max(2, min(8, (os.cpu_count() or 4) // 2))
STARTUP_THREADS_ENV = "SGLANG_LORA_STARTUP_THREADS"  # overrides it (a benchmark knob; >= 1)
# "1": read the startup adapters beside the KV cache sizing and the graph capture (unpinned, pinned
# after), in place of before them. Off by default: on an H200 host 64 adapters read beside the
# capture slowed it 18.7 -> 36.7 s, more than the reads take before it (15.1 s, the same call).
STARTUP_OVERLAP_ENV = "SGLANG_LORA_STARTUP_OVERLAP"


def startup_overlap() -> bool:
    """Whether the startup reads overlap the KV cache and graph set-up ($SGLANG_LORA_STARTUP_OVERLAP)."""
    raw = os.environ.get(STARTUP_OVERLAP_ENV, "0").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{STARTUP_OVERLAP_ENV} must be 0 or 1, got {raw!r}")
    return raw == "1"


def startup_load_threads() -> int:
    """Reader threads for the startup adapters: $SGLANG_LORA_STARTUP_THREADS, else STARTUP_LOAD_THREADS."""
    raw = os.environ.get(STARTUP_THREADS_ENV, "").strip()
    if not raw:
        return STARTUP_LOAD_THREADS
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{STARTUP_THREADS_ENV} must be a positive integer, got {raw!r}")
    return int(raw)


@dataclass
class LoRAIntegrityReport:
    ok: bool
    problems: list[str] = field(default_factory=list)
    resident: dict[int, Optional[str]] = field(default_factory=dict)  # slot -> lora_id (EMPTY slots left out)

    def __bool__(self) -> bool:
        return self.ok


@dataclass
class _StartupReads:
    """The startup adapters' reads in flight (LoRAManager._start_startup_reads)."""
    refs: list[LoRARef]
    configs: dict[str, LoRAConfig]
    futures: list[Future]
    threads: ThreadPoolExecutor
    started: float  # time.perf_counter() when the reads began


class LoRAManager:
    def __init__(
        self,
        base_model: nn.Module,
        model_config: Any,
        config: LoRARunConfig,
        device: torch.device | str,
        dtype: torch.dtype,
        tp_group: TensorParallelGroup = SINGLE_RANK,
    ) -> None:
        self.base_model = base_model
        self.model_config = model_config
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_loaded_loras = config.max_loaded_loras
        self.base_vocab_size: Optional[int] = getattr(model_config, "vocab_size", None)

        # Host state of the loaded adapters, keyed by lora_id.
        self.adapters: dict[str, LoRAAdapter] = {}
        self.refs: dict[str, LoRARef] = {}
        self.pinned_ids: set[str] = set()

        num_layers = getattr(model_config, "num_hidden_layers", None)
        self.shapes = model_shapes(base_model, num_layers)
        startup_configs = {ref.lora_id: self._read_startup_config(ref) for ref in config.refs}
        target_modules = self._resolve_target_modules(startup_configs.values())
        max_rank = config.max_lora_rank or max((c.r for c in startup_configs.values()), default=0)
        if max_rank <= 0:
            raise ValueError(
                "LoRA is enabled but the pool rank is unknown: give --max-lora-rank or --lora-paths"
            )
        self.max_loras_per_batch = config.max_loras_per_batch or auto_slot_count(
            self.shapes, target_modules, max_rank, dtype, self.device, len(config.refs), config.max_loaded_loras,
            tp_group.min_over_ranks, num_startup_pinned=sum(1 for ref in config.refs if ref.pinned),
        )

        if config.backend != config.requested_backend:
            logger.warning(
                "LoRA backend %r needs a GPU (or TRITON_INTERPRET=1 on a CPU); using %r on the CPU.",
                config.requested_backend, config.backend,
            )
        self.lora_backend = get_backend_from_name(config.backend)(
            # The kernels index every slot of the pool: the adapters' and the base model's.
            max_loras_per_batch=self.max_loras_per_batch + 1,
            device=self.device,
            max_lora_chunk_size=config.chunk_size,
        )

        if config.fold == "on" and not self.lora_backend.supports_fold:
            logger.warning("--lora-fold on: the %s LoRA backend does not fold; every module runs its base GEMM "
                           "and the LoRA kernels apart", self.lora_backend.name)
        foldable = (fold_candidates(base_model, target_modules, dtype)
                    if self.lora_backend.supports_fold and config.fold != "off" else [])
        self.pool = LoRAMemoryPool(
            self.shapes,
            target_modules,
            self.max_loras_per_batch,
            max_rank,
            dtype,
            self.device,
            config.eviction_policy,
            fold_candidates=foldable,
            fold_mode=config.fold,
            # The A-fold's delta goes to a fused norm, on one rank (a row-parallel GEMM's shrink
            # columns would need the all-reduce before the norm adds them).
            a_fold=(self.lora_backend.a_fold and self.lora_backend.supports_norm_fusion and config.fuse_norm != "off"
                    and tp_group.size == 1),
            # qkv_proj's prefills: no norm takes part, one rank as above (the layout is one rank's).
            a_fold_prefill=self.lora_backend.a_fold_prefill and tp_group.size == 1,
        )
        fold_base_weights(base_model, self.pool, self.shapes, dtype)
        self.lora_modules: dict[int, dict[str, BaseLayerWithLoRA]] = wrap_lora_modules(
            base_model, self.pool, self.shapes, self.lora_backend, dtype
        )
        if config.fuse_norm != "off":
            self._attach_norm_fusion(base_model, quiet=config.fuse_norm == "auto")

        # The startup adapters are read in threads from here on; finish_startup() waits for them and
        # commits them. ModelRunner calls it next, or (startup_overlap) once the KV cache is sized
        # and the graphs captured (null adapter ids: nothing there needs them).
        self.startup_overlap = startup_overlap()
        self._startup = self._start_startup_reads(list(config.refs), startup_configs)

    # ------------------------------------------------------------------ set-up
    def _attach_norm_fusion(self, model: torch.nn.Module, quiet: bool) -> None:
        """`--lora-fuse-norm auto` (quiet) is the default and says nothing when nothing fuses; an
        explicit `on` that fuses nothing warns."""
        if not self.lora_backend.supports_norm_fusion:
            if not quiet:
                logger.warning("--lora-fuse-norm: the %s LoRA backend has no fused norm kernels; the norms run "
                               "apart", self.lora_backend.name)
            return
        count = attach_norm_fusion(model, self.lora_modules, find_lora_target_layers(model), self.lora_backend)
        if count == 0:
            if not quiet:
                logger.warning("--lora-fuse-norm: no norm feeds a LoRA qkv_proj / gate_up_proj (targets: %s); "
                               "nothing to fuse", self.pool.target_modules)
            return
        # Decode batches carry each row's slot from now on (before the graphs' static infos exist).
        self.lora_backend.enable_norm_fusion()
        logger.info("LoRA: %d norms (and activations) compute their module's LoRA shrink at decode", count)

    def _start_startup_reads(self, refs: list[LoRARef], configs: dict[str, LoRAConfig]) -> Optional[_StartupReads]:
        """Read the startup adapters' tensors in parallel threads (the files, the checks, the
        conversion; torch releases the GIL). Beside the graph capture (startup_overlap()) they are
        read unpinned, since another thread's cudaHostAlloc is refused while the main thread
        captures a CUDA graph, and finish_startup pins them; else straight into pinned buffers
        (one copy of the file's tensors, not two)."""
        if not refs:
            return None
        pin = torch.cuda.is_available() and not self.startup_overlap

        def read(ref: LoRARef) -> LoRAAdapter:
            # This thread's own intra-op thread count (OpenMP's is per thread): the main thread's stays.
            torch.set_num_threads(1)
            reason = self.pool.incompatibility(configs[ref.lora_id])
            if reason is not None:
                raise ValueError(reason)
            return LoRAAdapter.load(ref.lora_id, configs[ref.lora_id], self.shapes, self.dtype, pin=pin)

        threads = ThreadPoolExecutor(min(startup_load_threads(), len(refs)), thread_name_prefix="sglang-lora-read")
        started = time.perf_counter()
        return _StartupReads(refs, configs, [threads.submit(read, ref) for ref in refs], threads, started)

    def finish_startup(self) -> None:
        """Wait for the startup reads, pin the host copies and commit the adapters in their order
        (a bad adapter: ValueError naming it, as at any other start-up failure). Called before the
        KV cache and graphs are set up, or after them when the reads overlap them (startup_overlap)."""
        startup, self._startup = self._startup, None
        if startup is not None:
            try:
                self._commit_startup_adapters(startup)
            finally:
                startup.threads.shutdown(wait=True, cancel_futures=True)
        logger.info(
            "LoRA: backend %s, %d slots, max rank %d, modules %s, adapters %s",
            self.lora_backend.name,
            self.max_loras_per_batch,
            self.pool.max_lora_rank,
            self.pool.target_modules,
            sorted(self.loaded_adapters()),
        )

    def _commit_startup_adapters(self, startup: _StartupReads) -> None:
        refs, configs, futures = startup.refs, startup.configs, startup.futures
        waited = time.perf_counter()
        for _ in tqdm(as_completed(futures), total=len(futures), desc="Loading LoRA adapters", unit="adapter",
                      disable=len(refs) < 2):
            pass
        adapters: list[LoRAAdapter] = []
        for ref, future in zip(refs, futures):  # the first failure in the given order, by its name
            try:
                adapters.append(future.result())
            except ValueError as e:
                raise ValueError(f"Failed to load LoRA adapter {ref.lora_name!r} at startup: {e}") from None
        if self.startup_overlap:
            # Read unpinned beside the capture: pinned now, in the same threads (the copies run in
            # parallel). Read before it, they went straight into pinned buffers.
            list(startup.threads.map(LoRAAdapter.pin_host_copy, adapters))
            logger.info("LoRA: %d startup adapter(s) read while the KV cache and graphs were set up, %.1f s "
                        "waited for after them", len(refs), time.perf_counter() - waited)
        else:
            logger.info("LoRA: %d startup adapter(s) read before the KV cache and graphs in %.1f s "
                        "(SGLANG_LORA_STARTUP_OVERLAP=1 reads them beside)", len(refs),
                        time.perf_counter() - startup.started)
        first_by_path: dict[str, str] = {}
        shared: list[tuple[str, str]] = []  # (adapter, the earlier one with its files)
        for ref, adapter in zip(refs, adapters):
            try:
                self._load_adapter(ref, configs[ref.lora_id], adapter)
            except ValueError as e:
                raise ValueError(f"Failed to load LoRA adapter {ref.lora_name!r} at startup: {e}") from None
            first = first_by_path.setdefault(ref.lora_path, ref.lora_name)
            if first != ref.lora_name:
                shared.append((ref.lora_name, first))
        if shared:  # one line, not one per adapter (a benchmark may serve 256 names from 32 folders)
            logger.warning("LoRA: %d adapter(s) load the same files as an earlier one (e.g. %r as %r)",
                           len(shared), *shared[0])

    def _read_startup_config(self, ref: LoRARef) -> LoRAConfig:
        try:
            return LoRAConfig.from_path(ref.lora_path, self.base_vocab_size)
        except ValueError as e:
            raise ValueError(f"Failed to load LoRA adapter {ref.lora_name!r} at startup: {e}") from None

    def _resolve_target_modules(self, configs: Iterable[LoRAConfig]) -> set[str]:
        available = set(self.shapes.modules)
        cli = self.config.target_modules
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

    # ------------------------------------------------------------------ adapters
    def loaded_adapters(self) -> dict[str, str]:
        return {ref.lora_name: ref.lora_path for ref in self.refs.values()}

    def _load_adapter(self, ref: LoRARef, config: Optional[LoRAConfig] = None,
                      adapter: Optional[LoRAAdapter] = None) -> None:
        """Validate and load (`adapter`: its tensors, read already); raises ValueError and changes
        nothing on failure."""
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
        if config is None:
            config = LoRAConfig.from_path(ref.lora_path, self.base_vocab_size)
        reason = self.pool.incompatibility(config)
        if reason is not None:
            raise ValueError(reason)
        if adapter is None:
            adapter = LoRAAdapter.load(ref.lora_id, config, self.shapes, self.dtype)
        # Commit only now: every check passed.
        self.adapters[ref.lora_id] = adapter
        self.refs[ref.lora_id] = ref
        if ref.pinned:
            self.pinned_ids.add(ref.lora_id)

    def load_lora_adapter(self, lora_ref: LoRARef) -> LoRAUpdateOutput:
        shared_with = next((r.lora_name for r in self.refs.values() if r.lora_path == lora_ref.lora_path), None)
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
        if shared_with is not None:
            logger.warning("LoRA adapter %r loads the same files as %r", lora_ref.lora_name, shared_with)
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

    def needs_slot(self, lora_id: Optional[str]) -> bool:
        """Whether admitting `lora_id` can take a slot another adapter waits for: not the base
        model's (it has its own) nor a pinned adapter's (validate_lora_batch counts it always)."""
        return lora_id is not None and lora_id not in self.pinned_ids

    def make_resident(self, lora_ids: set[Optional[str]]) -> None:
        """Give every adapter of `lora_ids` a slot (evicting adapters outside them); the current
        stream waits for their slots' copies."""
        self.pool.make_resident(set(lora_ids), self.adapters, self.pinned_ids)

    def prefetch(self, wanted: list[str], protected: set[Optional[str]]) -> list[str]:
        """Start loading adapters that waiting requests want (most wanted first) into slots the
        `protected` adapters (the running ones) do not need; the copies overlap the next forward."""
        return self.pool.prefetch(wanted, self.adapters, protected, self.pinned_ids)

    def prepare_forward(self, forward_batch: "ForwardBatch", plan: ForwardPlan) -> None:
        """Make the batch's adapters resident (never evicting `keep_lora_ids`) and write its metadata where
        `plan.path` reads it.

        `plan.lora` False (an all-base batch, or a capture of the graphs without LoRA) clears the
        backend's `batch_info`: every wrapper then runs its base layer alone, and no static
        metadata is touched.
        """
        if not plan.lora:
            self.lora_backend.batch_info = None
            return
        bs = forward_batch.batch_size
        lora_ids = forward_batch.lora_ids if forward_batch.lora_ids is not None else [None] * bs
        if len(lora_ids) != bs:
            raise ValueError(f"forward batch has {bs} requests but {len(lora_ids)} lora_ids")
        # The running requests' adapters (keep_lora_ids) only must not be evicted: they are not
        # this batch's, so they are neither loaded, marked used nor counted against the slots here.
        # Pinned and kept ids chained, not joined: read only when a slot must be freed.
        kept = itertools.chain(self.pinned_ids, forward_batch.keep_lora_ids)
        self.pool.make_resident(set(lora_ids), self.adapters, kept)
        slot_of = self.pool.lora_id_to_slot  # what get_slot reads, without a call per request
        weight_indices = [slot_of[lora_id] for lora_id in lora_ids]
        self.lora_backend.fill_batch_info(
            forward_batch,
            weight_indices,
            list(self.pool.slot_ranks),
            list(self.pool.slot_scalings),
            plan.path,
        )

    # ------------------------------------------------------------------ CUDA graphs
    def init_cuda_graph_batch_info(self, max_bs_in_cuda_graph: int, num_tokens_per_bs: int = 1,
                                   buckets: Optional[Sequence[int]] = None) -> None:
        backend = self.lora_backend
        if backend.cuda_graph_batch_info is not None:
            # Graphs already captured hold the addresses of the existing buffers: never move them.
            if backend.max_bs_in_cuda_graph < max_bs_in_cuda_graph:
                raise ValueError(
                    f"decode LoRA graph metadata exists for {backend.max_bs_in_cuda_graph} requests; "
                    f"cannot grow it to {max_bs_in_cuda_graph}"
                )
            return
        backend.init_cuda_graph_batch_info(max_bs_in_cuda_graph, num_tokens_per_bs, buckets)

    def init_prefill_cuda_graph_batch_info(self, max_num_tokens: int, buckets: Optional[Sequence[int]] = None) -> None:
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
        backend.init_prefill_cuda_graph_batch_info(max_num_tokens, buckets)

    @property
    def supports_prefill_cuda_graph(self) -> bool:
        """Whether batches with adapters can replay graphs (decode and prefill) at all."""
        return bool(self.lora_backend.supports_prefill_cuda_graph)

    @property
    def prefill_cuda_graph_max_bs(self) -> Optional[int]:
        return self.lora_backend.prefill_cuda_graph_max_bs

    def can_use_prefill_cuda_graph(self, forward_batch: "ForwardBatch") -> bool:
        """The one predicate for "this extend batch can replay the prefill graph with LoRA"."""
        max_bs = self.lora_backend.prefill_cuda_graph_max_bs
        max_tokens = self.lora_backend.prefill_cuda_graph_max_tokens
        if max_bs is None or max_tokens is None:
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
        for slot, lora_id in enumerate(pool.slot_to_lora_id):
            if lora_id is EMPTY or lora_id is None:
                continue
            adapter = self.adapters.get(lora_id)
            if adapter is None:
                problems.append(f"slot {slot} holds {lora_id!r}, which is not loaded")
            elif pool.slot_ranks[slot] != adapter.rank:
                problems.append(
                    f"slot {slot} has rank {pool.slot_ranks[slot]}, adapter {lora_id!r} has {adapter.rank}"
                )
        if not self.pinned_ids <= set(self.adapters):
            problems.append(f"pinned ids {sorted(self.pinned_ids - set(self.adapters))} are not loaded")
        if len(self.pinned_ids) > max(self.max_loras_per_batch - 1, 0):
            problems.append(f"{len(self.pinned_ids)} pinned adapters leave no free slot")
        if set(self.adapters) != set(self.refs):
            problems.append("adapter and ref tables disagree")
        if self.max_loaded_loras is not None and len(self.adapters) > self.max_loaded_loras:
            problems.append(f"{len(self.adapters)} adapters loaded, above --max-loaded-loras")
        resident = {s: u for s, u in enumerate(pool.slot_to_lora_id) if u is not EMPTY}
        return LoRAIntegrityReport(ok=not problems, problems=problems, resident=resident)
