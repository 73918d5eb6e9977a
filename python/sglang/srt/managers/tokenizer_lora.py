"""The adapter side of the TokenizerManager: names to ids, OpenAI model names, run-time loads.

A mixin of `TokenizerManager` (kept apart only to keep files small). It uses these attributes of
the manager: `config`, `lora_registry` (None when LoRA is off), `client`, `served_model_name`,
`base_model_names`, `_lora_waiters`, `_lora_update_lock`, `_unloading`, `_resolving`,
`_resolved_use`, `_resolve_pending`, `_resolve_lock`, `metrics`, `is_healthy()` and `dead_reason`.
Everything runs on the manager's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Optional

from sglang.srt.managers.generate_request import InvalidRequestError, ModelNotFoundError, RequestFailedError
from sglang.srt.configs.lora_ref import LoRAUpdateOutput
from sglang.srt.lora.lora_registry import make_dynamic_lora_ref
from sglang.srt.managers.io_struct import LoadLoRAAdapterReq, UnloadLoRAAdapterReq

logger = logging.getLogger(__name__)

# Test hook (with --enable-test-hooks only): "name=seconds,..." delays those first-use loads.
RESOLVER_DELAY_TEST_ENV = "SGLANG_TEST_LORA_RESOLVER_DELAY"


def _check_adapter_fields(lora_name: Any, lora_path: Any, pinned: Any) -> Optional[str]:
    """What is wrong with a load request's fields, or None."""
    if lora_name is None or lora_path is None:
        return "Both 'lora_name' and 'lora_path' must be provided."
    if not isinstance(lora_name, str) or not lora_name.strip():
        return "'lora_name' must be a non-empty string"
    if lora_name != lora_name.strip():
        # model="<base>:<adapter>" strips the adapter part: such a name could never be selected.
        return f"'lora_name' must not start or end with white space, got {lora_name!r}"
    if not isinstance(lora_path, str) or not lora_path.strip():
        return "'lora_path' must be a non-empty string"
    if not isinstance(pinned, bool):
        return "'pinned' must be a boolean"
    for field, value in (("lora_name", lora_name), ("lora_path", lora_path)):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (a "\udcff" JSON escape): no name or path has one
            return f"'{field}' is not valid Unicode text: {value!r}"
    return None


class TokenizerLoRAMixin:
    # ------------------------------------------------------------------ adapters
    def adapter_from_model(self, model: Optional[str], lora_path: Any = None) -> Any:
        """The adapter an OpenAI request asks for: `model="<base>:<adapter>"` (split on the first
        colon; it wins over `lora_path`), `model="<adapter>"`, or `lora_path` with the base model."""
        if model is None or model == "":
            return lora_path
        if not isinstance(model, str):
            raise InvalidRequestError("'model' must be a string", param="model")
        if self.lora_registry is not None and (
                self.lora_registry.get(model) is not None
                or (model not in self.base_model_names and self.resolver_path(model) is not None)):
            return model  # an adapter's own name, even one with a colon in it
        if ":" in model:
            base, adapter = (part.strip() for part in model.split(":", 1))
            if base not in self.base_model_names:
                raise ModelNotFoundError(base, f"This server serves `{self.served_model_name}`.")
            return self._check_openai_adapters(model, adapter or lora_path)
        if model in self.base_model_names:
            return self._check_openai_adapters(model, lora_path)
        hint = f"This server serves `{self.served_model_name}`"
        if self.lora_registry is None:
            hint += " (LoRA is not enabled, so no adapters are served)."
        else:
            hint += f" and the adapters {sorted(self.lora_registry.get_all())}."
        raise ModelNotFoundError(model, hint)

    def _check_openai_adapters(self, model: str, adapter: Any) -> Any:
        """On the OpenAI endpoints an unknown adapter is an unknown model: 404, listing the loaded
        adapters. (Without LoRA the request goes on and `acquire_adapters` says LoRA is off.)"""
        if self.lora_registry is None or adapter is None:
            return adapter
        names = adapter if isinstance(adapter, list) else [adapter]
        if "" in names:
            # A malformed value, not an unknown model: refused as /generate refuses it (a 404 here
            # named a model "<base>:" the client never asked for).
            raise InvalidRequestError("'lora_path' has an invalid value ''", param="lora_path")
        unknown = sorted({n for n in names if isinstance(n, str) and self.lora_registry.get(n) is None
                          and self.resolver_path(n) is None})
        if unknown:
            hint = (f"The following requested LoRA adapters are not loaded: {', '.join(unknown)}. "
                    f"{self._loaded_adapters_hint()}")
            if ":" in model:  # named in `model` ("base:adapter"): an unknown model, as vLLM has it
                raise ModelNotFoundError(model, hint)
            # Named in `lora_path` beside the base model: the model exists; the field is what is wrong.
            raise InvalidRequestError(hint, param="lora_path", status_code=404)
        return adapter

    def _loaded_adapters_hint(self) -> str:
        names = sorted(self.lora_registry.get_all()) if self.lora_registry is not None else []
        return f"Loaded adapters: {names}." if names else "No LoRA adapters are loaded."

    async def acquire_adapters(self, names: list[Optional[str]]) -> list[Optional[str]]:
        """The one place where adapter names become adapter ids.

        Takes an in-flight reference per adapter request (released by `release_adapters_now` when
        the request ends there, not when its client has read the reply), so an unload waits for
        requests already using the adapter.
        """
        requested = sorted({n for n in names if n is not None})
        if not requested:
            return [None] * len(names)
        if self.lora_registry is None:
            raise InvalidRequestError(
                f"LoRA adapter '{requested[0]}' was requested, but LoRA is not enabled on this server. "
                "Start it with --lora-paths (or --enable-lora) to serve adapters.",
                param="lora_path",
            )
        for name in requested:
            self._resolve_pending[name] = self._resolve_pending.get(name, 0) + 1
        try:
            await self.resolve_adapters(requested)
            ids = list(await self.lora_registry.acquire(list(names)))
        except ValueError as e:
            raise InvalidRequestError(str(e), param="lora_path") from None
        finally:
            for name in requested:
                left = self._resolve_pending[name] - 1
                if left:
                    self._resolve_pending[name] = left
                else:
                    del self._resolve_pending[name]
        now = time.monotonic()
        for name in requested:
            if name in self._resolved_use:
                self._resolved_use[name] = now
        return ids

    # ------------------------------------------------------------------ adapters loaded on first use
    def resolver_path(self, name: Any) -> Optional[str]:
        """--lora-resolver-dir/<name> when it holds an adapter (adapter_config.json); None otherwise,
        also for names that could leave the folder ("..", absolute, empty components)."""
        root = self.config.lora_resolver_dir
        if (root is None or self.lora_registry is None or not isinstance(name, str) or not name
                or name in self.base_model_names):  # the base model's name always means the base model
            return None
        parts = name.split("/")
        if any(p in ("", ".", "..") for p in parts) or "\\" in name or "\x00" in name:
            return None
        path = os.path.join(root, *parts)
        try:
            return path if os.path.isfile(os.path.join(path, "adapter_config.json")) else None
        except (UnicodeEncodeError, ValueError, OSError):  # a name no file system could hold
            return None

    async def resolve_adapters(self, names: list[str]) -> None:
        """Load each requested adapter that is not loaded but is in --lora-resolver-dir (one load
        per name however many requests ask for it at once). A refused load is the request's 400."""
        for name in names:
            if self.lora_registry.get(name) is not None:
                continue
            path = self.resolver_path(name)
            if path is None:
                continue  # acquire() refuses it as unknown
            load = self._resolving.get(name)
            if load is None:
                load = asyncio.ensure_future(self._load_on_first_use(name, path))
                self._resolving[name] = load
                load.add_done_callback(lambda _, n=name: self._resolving.pop(n, None))
            await asyncio.shield(load)

    async def _load_on_first_use(self, name: str, path: str) -> None:
        if self.config.enable_test_hooks:  # a slow load, for tests of what happens meanwhile
            delay = dict(item.split("=", 1) for item in os.environ.get(RESOLVER_DELAY_TEST_ENV, "").split(",")
                         if "=" in item)
            if name in delay:
                await asyncio.sleep(float(delay[name]))
        while name in self._unloading:  # its unload waits for requests: not while holding the lock
            await asyncio.shield(self._unloading[name])
        if self._resolve_lock is None:
            self._resolve_lock = asyncio.Lock()
        async with self._resolve_lock:  # one at a time: each makes room before it loads
            if self.lora_registry.get(name) is not None:
                return  # loaded meanwhile (/load_lora_adapter)
            await self._make_room_for(name)
            out, _ = await self.load_lora_adapter(name, path)
            if not out.success:
                if self.lora_registry.get(name) is not None:
                    return
                raise InvalidRequestError(
                    f"LoRA adapter {name!r} (from --lora-resolver-dir) could not be loaded: {out.error_message}",
                    param="lora_path")
            self._resolved_use[name] = time.monotonic()
            logger.info("Loaded LoRA adapter %r on first use from %s", name, path)

    async def _make_room_for(self, name: str) -> None:
        """At --max-loaded-loras, unload the least recently used idle adapter loaded on first use."""
        limit = self.config.max_loaded_loras
        # An adapter being unloaded holds its place in the scheduler until its requests end.
        while limit is not None and len(self.lora_registry.get_all()) + len(self._unloading) >= limit:
            idle = []
            for other, used in self._resolved_use.items():
                ref = self.lora_registry.get(other)
                if (ref is not None and not ref.pinned and self.lora_registry.num_in_flight(ref.lora_id) == 0
                        and other not in self._resolve_pending):
                    idle.append((used, other))
            if not idle:
                raise RequestFailedError(
                    f"cannot load LoRA adapter {name!r}: all {limit} loaded adapters (--max-loaded-loras) are "
                    "in use (by running requests or by this request's other adapters), being unloaded, or were "
                    "not loaded on first use; retry later", status_code=503)
            _, victim = min(idle)
            del self._resolved_use[victim]
            out, status = await self.unload_lora_adapter(victim)
            if out.success:
                logger.info("Unloaded LoRA adapter %r (least recently used) to load %r", victim, name)

    def release_adapters_now(self, ids: list[Optional[str]]) -> None:
        if self.lora_registry is not None and any(i is not None for i in ids):
            self.lora_registry.release_now(ids)

    # ------------------------------------------------------------------ loading and unloading adapters
    async def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False
                                ) -> tuple[LoRAUpdateOutput, int]:
        """Load an adapter at run time; returns the scheduler's answer and an HTTP status.

        The name becomes visible (in the registry, so requests can use it) only after the
        scheduler has loaded it: a refused load leaves no trace in either process.
        """
        if self.lora_registry is None:
            return self.lora_refusal(
                "LoRA is not enabled on this server: start it with --enable-lora --max-lora-rank R "
                "--lora-target-modules ... (or --lora-paths) to load adapters at run time", 400)
        problem = _check_adapter_fields(lora_name, lora_path, pinned)
        if problem is None and lora_name in self.base_model_names:
            problem = (f"Failed to load LoRA adapter {lora_name!r}: the name is the base model's, so "
                       "model=\"<name>\" could not select the adapter; choose another name")
        if problem is not None:
            return self.lora_refusal(problem, 400)
        # Loaded explicitly, it is never unloaded to make room (a first-use load records it after this).
        self._resolved_use.pop(lora_name, None)

        async def run() -> tuple[LoRAUpdateOutput, int]:
            while lora_name in self._unloading:  # that unload reaches the scheduler first
                await asyncio.shield(self._unloading[lora_name])
            async with self._update_lock():
                if self.lora_registry.get(lora_name) is not None:
                    return self.lora_refusal(
                        f"Failed to load LoRA adapter {lora_name!r} because it is already loaded; "
                        "unload it first to load it again", 400)
                # A fresh id per load: a name reloaded later never matches stale pool contents.
                ref = make_dynamic_lora_ref(lora_name, lora_path, pinned)
                out = await self._send_lora_update(LoadLoRAAdapterReq(lora_ref=ref))
                if not out.success:
                    logger.warning("%s", out.error_message)
                    return out, 400
                await self.lora_registry.register(ref)  # the scheduler logged the load
                return out, 200

        # Shielded: a caller that goes away mid-load must not leave the scheduler and the registry
        # disagreeing about whether the adapter is loaded.
        return await asyncio.shield(asyncio.ensure_future(run()))

    async def unload_lora_adapter(self, lora_name: str) -> tuple[LoRAUpdateOutput, int]:
        """Unload an adapter: new requests for it are refused at once, then the scheduler frees its
        slot once the requests already using it have finished."""
        if self.lora_registry is None:
            return self.lora_refusal("LoRA is not enabled on this server", 400)
        if not isinstance(lora_name, str) or not lora_name:
            return self.lora_refusal("'lora_name' (a non-empty string) must be provided", 400)

        async def run() -> tuple[LoRAUpdateOutput, int]:
            async with self._update_lock():
                if self.lora_registry.get(lora_name) is None:
                    return self.lora_refusal(
                        f"The LoRA adapter {lora_name!r} cannot be found: it is not loaded. "
                        f"{self._loaded_adapters_hint()}", 404)
                ref = await self.lora_registry.detach(lora_name)  # new requests for it fail from now
                self._resolved_use.pop(lora_name, None)
                done = asyncio.get_running_loop().create_future()
                self._unloading[lora_name] = done
            try:
                # The wait for the requests using it holds no lock: other adapters' loads and
                # unloads go on meanwhile (a load of this very name waits for `done`).
                await self.lora_registry.drain(ref)
                async with self._update_lock():
                    out = await self._send_lora_update(UnloadLoRAAdapterReq(lora_ref=ref))
            finally:
                del self._unloading[lora_name]
                done.set_result(None)
            if not out.success:  # the two processes disagreed: say so loudly
                logger.error("Unloading LoRA adapter %r: %s", lora_name, out.error_message)
                return out, 500
            if self.metrics is not None:
                self.metrics.forget_adapter(lora_name)
            return out, 200

        return await asyncio.shield(asyncio.ensure_future(run()))

    def response_model_name(self, model: Optional[str]) -> str:
        """The `model` an OpenAI reply names: the served name where the request named the base
        model by an alias (or not at all), else what the request asked for."""
        return self.served_model_name if not model or model in self.base_model_names else model

    def _update_lock(self) -> asyncio.Lock:
        if self._lora_update_lock is None:  # created lazily so it belongs to the serving loop
            self._lora_update_lock = asyncio.Lock()
        return self._lora_update_lock

    def lora_refusal(self, message: str, status: int) -> tuple[LoRAUpdateOutput, int]:
        loaded = {}
        if self.lora_registry is not None:
            loaded = {name: ref.lora_path for name, ref in self.lora_registry.get_all().items()}
        return LoRAUpdateOutput(success=False, error_message=message, loaded_adapters=loaded), status

    async def _send_lora_update(self, msg: Any) -> LoRAUpdateOutput:
        if not self.is_healthy():
            raise RuntimeError(self.dead_reason or "the scheduler is not running")
        fut = asyncio.get_running_loop().create_future()
        # The scheduler answers adapter updates in the order it receives them.
        self._lora_waiters.append(fut)
        self.client.send(msg)
        return await fut
