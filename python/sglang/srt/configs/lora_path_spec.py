"""LoRAPathSpec: one `--lora-paths` entry, parsed (plain data; no engine imports)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Union


@dataclass
class LoRAPathSpec:
    """One `--lora-paths` entry: `PATH`, `NAME=PATH`, or JSON {lora_name, lora_path, pinned}."""

    lora_name: str
    lora_path: str
    pinned: bool = False

    @classmethod
    def parse(cls, item: Union[str, dict, "LoRAPathSpec"]) -> "LoRAPathSpec":
        if isinstance(item, LoRAPathSpec):
            return item
        if isinstance(item, dict):
            data = item
        else:
            text = str(item).strip()
            if not text:
                raise ValueError("--lora-paths: empty entry")
            if text.startswith("{"):
                try:
                    data = json.loads(text)
                except json.JSONDecodeError as e:
                    raise ValueError(f"--lora-paths: invalid JSON entry {text!r}: {e}") from None
            elif "=" in text and not os.path.isdir(text):  # a folder whose name holds "=" is a bare path
                name, path = text.split("=", 1)
                data = {"lora_name": name.strip(), "lora_path": path.strip()}
            else:
                data = {"lora_name": text, "lora_path": text}
        if not isinstance(data, dict) or "lora_path" not in data:
            raise ValueError(
                f"--lora-paths: entry {item!r} must be PATH, NAME=PATH or JSON with 'lora_path'"
            )
        name = str(data["lora_path"] if data.get("lora_name") is None else data["lora_name"])
        path = str(data["lora_path"])
        if not name or not path:
            raise ValueError(f"--lora-paths: entry {item!r} has an empty name or path")
        if name != name.strip():
            raise ValueError(f"--lora-paths: the adapter name {name!r} starts or ends with white space")
        unknown = set(data) - {"lora_name", "lora_path", "pinned"}
        if unknown:
            raise ValueError(
                f"--lora-paths: unknown key(s) {sorted(unknown)} in {item!r}; "
                "allowed: lora_name, lora_path, pinned"
            )
        pinned = data.get("pinned", False)
        if not isinstance(pinned, bool):
            # bool() would pin on "false" or "no"; /load_lora_adapter refuses a non-boolean too.
            raise ValueError(f"--lora-paths: 'pinned' must be true or false, got {pinned!r} in {item!r}")
        return cls(lora_name=name, lora_path=path, pinned=pinned)
