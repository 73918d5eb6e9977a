"""The scheduler's side of LoRA: adapter commands, which adapters stay resident with a batch,
prefetching, and what /get_server_info shows (`SchedulerLoRAMixin`, and the functions it calls).

Under tensor parallelism every rank runs these on the same messages at the same loop turn, so the
adapters loaded, the slots they occupy and the evictions are the same on every rank (DESIGN §11).
The one outcome that can differ is an adapter load (a file unreadable on one node, memory short on
one device): the ranks exchange their outcomes, and a load that failed anywhere is undone
everywhere, so an adapter is loaded on every rank or on none.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterable, Optional

from sglang.srt.distributed import TensorParallelGroup
from sglang.srt.configs.lora_ref import LoRARef, LoRAUpdateOutput
from sglang.srt.lora.mem_pool import EMPTY
from sglang.srt.managers.io_struct import LoadLoRAAdapterReq, UnloadLoRAAdapterReq
from sglang.srt.managers.req import Req

if TYPE_CHECKING:
    from sglang.srt.lora.lora_manager import LoRAManager

# The scheduler's own logger: these mixins are parts of the Scheduler, and operators filter its
# log lines ("Prefill batch, ...") by that name.
logger = logging.getLogger("sglang.srt.managers.scheduler")

NOT_ENABLED = "LoRA is not enabled on this server"


def update_adapters(
    lora: Optional["LoRAManager"], msg: LoadLoRAAdapterReq | UnloadLoRAAdapterReq, tp_group: TensorParallelGroup
) -> LoRAUpdateOutput:
    """Load or unload an adapter on this rank, in agreement with the other ranks."""
    if lora is None:
        return LoRAUpdateOutput(success=False, error_message=NOT_ENABLED)
    if isinstance(msg, LoadLoRAAdapterReq):
        return agree_on_load(lora, msg.lora_ref, lora.load_lora_adapter(msg.lora_ref), tp_group)
    # Unloading depends only on which adapters are loaded, which is the same on every rank.
    return lora.unload_lora_adapter(msg.lora_ref)


def agree_on_load(
    lora: "LoRAManager", ref: LoRARef, out: LoRAUpdateOutput, tp_group: TensorParallelGroup
) -> LoRAUpdateOutput:
    """Every rank's outcome of the same load; if any rank failed, the ranks that succeeded unload
    the adapter again and every rank reports the first failure."""
    if tp_group.size == 1:
        return out
    outcomes: list[tuple[bool, Optional[str]]] = tp_group.all_gather_object((out.success, out.error_message))
    failed = [(rank, message) for rank, (ok, message) in enumerate(outcomes) if not ok]
    if not failed:
        return out
    if out.success:
        lora.unload_lora_adapter(ref)
    rank, message = failed[0]
    if len(failed) < tp_group.size:  # a failure of some ranks only: say where
        message = f"{message} (on TP rank {rank}; the adapter is loaded on no rank)"
        logger.error("LoRA adapter %r: %s", ref.lora_name, message)
    return LoRAUpdateOutput(success=False, error_message=message, loaded_adapters=lora.loaded_adapters())


def prefetch_adapters(lora: Optional["LoRAManager"], admission: Any, waiting: list[Req],
                      protected: set[Optional[str]]) -> None:
    """Start copying the adapters waiting requests want into slots the `protected` adapters (the
    running requests') do not need; on a GPU the copies run on a side stream while the forward
    runs."""
    if lora is None or not waiting:
        return
    wanted = admission.wanted_adapters(waiting, protected)
    if wanted:
        lora.prefetch(wanted, protected)


def lora_server_info(lora: Optional["LoRAManager"], running: Iterable[Optional[str]] = (),
                     waiting: Iterable[Optional[str]] = ()) -> dict[str, Any]:
    """The adapters as the scheduler sees them: loaded, pinned, and resident in the pool's adapter
    slots (a slot shows its adapter's name, or None when empty; the base model has a slot of its
    own and is not listed), and the adapters of the running and the waiting requests (`running`,
    `waiting`: their lora ids)."""
    if lora is None:
        return {}
    names = {lora_id: ref.lora_name for lora_id, ref in lora.refs.items()}
    pool = lora.pool
    slots = [None if lora_id is EMPTY else names.get(lora_id, lora_id) for lora_id in pool.slot_to_lora_id[: pool.num_adapter_slots]]
    return {
        "lora": {
            "loaded_adapters": lora.loaded_adapters(),
            "pinned_adapters": sorted(names[i] for i in lora.pinned_ids),
            "resident_adapters": sorted(s for s in slots if s is not None),
            "pool_slots": slots,
            "max_lora_rank": lora.pool.max_lora_rank,
            "target_modules": list(lora.pool.target_modules),
            "backend": lora.lora_backend.name,
            "num_adapter_loads": lora.pool.num_adapter_loads,
            "num_evictions": lora.pool.num_evictions,
            "num_prefetches": lora.pool.num_prefetches,
            "max_loras_per_batch": lora.pool.num_adapter_slots,
            "running_adapters": sorted({names.get(i, i) for i in running if i is not None}),
            "waiting_adapters": sorted({names.get(i, i) for i in waiting if i is not None}),
            "slot_load_seconds": lora.pool.load_seconds.to_dict(),
        }
    }


class SchedulerLoRAMixin:
    """Reads the Scheduler's model runner (its `lora_manager`), queues, prefix cache and TP group."""

    def update_lora(self, msg: LoadLoRAAdapterReq | UnloadLoRAAdapterReq) -> LoRAUpdateOutput:
        lora = self.model_runner.lora_manager
        out = update_adapters(lora, msg, self.tp_group)
        if isinstance(msg, UnloadLoRAAdapterReq) and out.success and self.prefix_cache is not None:
            # Adapter ids are unique per load: nothing can match the unloaded one's entries again.
            if self.prefix_cache.drop_namespaces(lambda ns: ns.lora_id is not None and ns.lora_id not in lora.refs):
                self._recheck_if_idle()
        return out

    def keep_resident_for(self, reqs: list[Req]) -> frozenset:
        """The adapters that stay resident while a prefill of `reqs` runs: the decoding requests'
        (admission made sure they fit together with the batch's). The runner makes them resident
        with the batch's own, in the one fetch of its forward."""
        if self.model_runner.lora_manager is None:
            return frozenset()
        return frozenset(r.lora_id for r in self._holders() if r.lora_id is not None)

    def _prefetch_adapters(self, reqs: list[Req]) -> None:
        if self.model_runner.lora_manager is None or not self.waiting:
            return
        protected = {r.lora_id for r in self._holders()} | {r.lora_id for r in reqs}
        prefetch_adapters(self.model_runner.lora_manager, self.lora_admission, self.waiting, protected)

    def lora_info(self) -> dict[str, Any]:
        return lora_server_info(self.model_runner.lora_manager, (r.lora_id for r in self._holders()),
                                (r.lora_id for r in self.waiting))
