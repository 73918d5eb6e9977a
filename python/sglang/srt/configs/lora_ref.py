"""An adapter as both processes know it, and the outcome of loading or unloading one (plain data,
shared by the registry, the LoRA manager and the messages between the processes)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoRARef:
    """An adapter: its id (unique for the server's lifetime), the name requests use, its folder."""

    lora_id: str
    lora_name: str
    lora_path: str
    pinned: bool = False


@dataclass
class LoRAUpdateOutput:
    """The result of a load or an unload: what /load_lora_adapter and /unload_lora_adapter reply."""

    success: bool
    error_message: str = ""
    loaded_adapters: dict[str, str] = field(default_factory=dict)  # name -> path
