"""LoRA backends by name (`--lora-backend`)."""

from __future__ import annotations

import importlib

from sglang.srt.lora.backend.base_backend import BaseLoRABackend

# name -> (module, class). Imported lazily: torch_native must not need Triton at import time.
_BACKENDS: dict[str, tuple[str, str]] = {
    "csgmv": ("sglang.srt.lora.backend.chunked_backend", "ChunkedSgmvLoRABackend"),
    "triton": ("sglang.srt.lora.backend.token_backend", "TokenLoRABackend"),
    "torch_native": ("sglang.srt.lora.backend.torch_backend", "TorchNativeLoRABackend"),
}


def get_backend_from_name(name: str) -> type[BaseLoRABackend]:
    """The backend class registered as `name`; ValueError listing the choices otherwise."""
    try:
        module_name, class_name = _BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"Unknown LoRA backend {name!r}; choose one of: {', '.join(sorted(_BACKENDS))}"
        ) from None
    return getattr(importlib.import_module(module_name), class_name)


__all__ = ["BaseLoRABackend", "get_backend_from_name"]
