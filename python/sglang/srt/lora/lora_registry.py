"""`LoRARegistry`: the main process's view of the loaded adapters (names, ids, in-flight counts).

The tokenizer manager resolves a request's adapter name to an id here and holds an in-flight
reference until the request finishes, so that unloading an adapter waits for the requests already
using it while new requests for it are refused at once. Everything runs on the event loop: the
state changes between awaits are atomic, and the only waits (unload) use asyncio primitives.

Adapter ids: startup adapters get ids derived from (name, path) so the main process and the
scheduler process, which both build them from `--lora-paths`, agree without talking; adapters
loaded at run time get a fresh id per load, so a name reloaded with new weights never matches
stale pool contents.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from typing import Iterable, Optional, Union

from sglang.srt.configs.lora_ref import LoRARef
from sglang.srt.configs.lora_path_spec import LoRAPathSpec


def make_lora_ref(spec: Union[LoRAPathSpec, str, dict]) -> LoRARef:
    """A startup adapter's ref; its id is a deterministic function of (name, path)."""
    spec = LoRAPathSpec.parse(spec)
    digest = hashlib.sha256(f"{spec.lora_name}\0{spec.lora_path}".encode()).hexdigest()[:16]
    return LoRARef(
        lora_id=f"lora-{digest}", lora_name=spec.lora_name, lora_path=spec.lora_path, pinned=spec.pinned
    )


def make_dynamic_lora_ref(lora_name: str, lora_path: str, pinned: bool = False) -> LoRARef:
    """A run-time load's ref; its id is unique to this load."""
    return LoRARef(
        lora_id=f"lora-{uuid.uuid4().hex[:16]}", lora_name=lora_name, lora_path=lora_path, pinned=pinned
    )


class LoRARegistry:
    def __init__(self, adapters: Iterable[Union[LoRARef, LoRAPathSpec, str, dict]] = ()) -> None:
        """`adapters`: the startup adapters, as refs (the run config's, whose ids the scheduler
        uses too) or as --lora-paths entries (their refs are made here, with the same ids)."""
        self._by_name: dict[str, LoRARef] = {}
        self._counts: dict[str, int] = {}  # lora_id -> in-flight requests
        # lora_id -> events of the waiters to wake when its count drops to 0.
        self._idle: dict[str, list[asyncio.Event]] = {}
        self._lock = asyncio.Lock()
        for spec in adapters or ():
            ref = spec if isinstance(spec, LoRARef) else make_lora_ref(spec)
            if ref.lora_name in self._by_name:
                raise ValueError(f"LoRA adapter name {ref.lora_name!r} is given twice")
            self._by_name[ref.lora_name] = ref
            self._counts[ref.lora_id] = 0

    # ------------------------------------------------------------------ adapters
    async def register(self, ref: LoRARef) -> None:
        async with self._lock:
            if ref.lora_name in self._by_name:
                raise ValueError(f"LoRA adapter {ref.lora_name!r} is already loaded")
            if ref.lora_id in self._counts:
                raise ValueError(f"LoRA adapter id {ref.lora_id!r} is already in use")
            self._by_name[ref.lora_name] = ref
            self._counts[ref.lora_id] = 0

    async def unregister(self, lora_name: str) -> LoRARef:
        """Remove `lora_name` at once (new requests for it fail), then wait for its in-flight ones."""
        ref = await self.detach(lora_name)
        await self.drain(ref)
        return ref

    async def detach(self, lora_name: str) -> LoRARef:
        """The first half of `unregister`: the name goes at once; its in-flight requests go on."""
        async with self._lock:
            ref = self._by_name.pop(lora_name, None)
            if ref is None:
                raise ValueError(f"LoRA adapter {lora_name!r} is not loaded. {self._loaded_list()}")
        return ref

    async def drain(self, ref: LoRARef) -> None:
        """The second half: wait until no request holds `ref`, then forget its id."""
        await self.wait_for_idle(ref.lora_id)
        self._counts.pop(ref.lora_id, None)

    async def wait_for_idle(self, lora_id: str) -> None:
        """Return once no request holds a reference on `lora_id`."""
        while self._counts.get(lora_id, 0) > 0:
            event = asyncio.Event()  # created here so it belongs to the running loop
            self._idle.setdefault(lora_id, []).append(event)
            await event.wait()

    def get(self, lora_name: str) -> Optional[LoRARef]:
        return self._by_name.get(lora_name)

    def get_all(self) -> dict[str, LoRARef]:
        return dict(self._by_name)

    def _loaded_list(self) -> str:
        names = sorted(self._by_name)
        return f"Loaded adapters: {names}." if names else "No LoRA adapters are loaded."

    # ------------------------------------------------------------------ in-flight references
    async def acquire(
        self, names: Union[str, None, list[Optional[str]]]
    ) -> Union[Optional[str], list[Optional[str]]]:
        """Resolve adapter name(s) to id(s) and take one in-flight reference per adapter request.

        None (base model) resolves to None and takes nothing. An unknown name raises ValueError
        listing the loaded adapters, before any reference is taken.
        """
        single = not isinstance(names, list)
        items: list[Optional[str]] = [names] if single else list(names)  # type: ignore[list-item]
        async with self._lock:
            unknown = sorted({n for n in items if n is not None and n not in self._by_name})
            if unknown:
                raise ValueError(
                    f"The following requested LoRA adapters are not loaded: {', '.join(unknown)}. "
                    f"{self._loaded_list()}"
                )
            ids = [None if n is None else self._by_name[n].lora_id for n in items]
            for lid in ids:
                if lid is not None:
                    self._counts[lid] += 1
        return ids[0] if single else ids

    async def release(self, ids: Union[str, None, Iterable[Optional[str]]]) -> None:
        """Drop the references `acquire` took (same ids, Nones ignored)."""
        self.release_now(ids)

    def release_now(self, ids: Union[str, None, Iterable[Optional[str]]]) -> None:
        """`release` from synchronous code on the event loop (a request's end, as its news arrives)."""
        if ids is None or isinstance(ids, str):
            ids = [ids]
        for lid in ids:
            if lid is None:
                continue
            n = self._counts.get(lid, 0)
            if n <= 0:
                raise AssertionError(f"LoRA adapter id {lid!r} released more often than acquired")
            self._counts[lid] = n - 1
            if n == 1:
                for event in self._idle.pop(lid, ()):
                    event.set()

    def num_in_flight(self, lora_id: Optional[str] = None) -> int:
        """In-flight references of one adapter id, or of all adapters (integrity checks)."""
        if lora_id is not None:
            return self._counts.get(lora_id, 0)
        return sum(self._counts.values())
