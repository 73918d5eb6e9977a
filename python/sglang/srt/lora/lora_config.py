"""`LoRAConfig`: what a PEFT adapter's `adapter_config.json` says, and whether we can serve it.

PEFT names the modules it adapts per projection (q_proj, k_proj, ...); the engine's models fuse
them (qkv_proj, gate_up_proj). This file maps between the two and refuses, with a message the user
can act on, every adapter feature the engine cannot reproduce exactly. Silently ignoring a feature
(DoRA's magnitude vector, a per-module rank, an extra embedding row) would serve wrong outputs.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Union

FLOAT32_MAX = 3.4028234663852886e38  # the kernels' scaling dtype
# Fused module of the engine -> the PEFT projections it is made of, in output order.
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
# PEFT's names for the seven linear projections of a decoder layer, in the fused modules' order.
PEFT_PROJECTIONS: tuple[str, ...] = tuple(p for parts in FUSED_MODULES.values() for p in parts)
# Every fused module the engine can carry LoRA on ("all" / "all-linear" mean these).
SUPPORTED_LORA_MODULES: tuple[str, ...] = tuple(FUSED_MODULES)
# PEFT projection name -> fused module that holds it.
PROJ_TO_FUSED: dict[str, str] = {p: fused for fused, parts in FUSED_MODULES.items() for p in parts}
# Already-fused names may appear in adapters trained on fused checkpoints (e.g. Phi-3 style).
PROJ_TO_FUSED.update({fused: fused for fused in FUSED_MODULES})


# How many stacked slices a fused module's A has (3 for q/k/v, 2 for gate/up, 1 otherwise).
def get_stacked_multiply(module_name: str) -> int:
    return len(FUSED_MODULES[module_name])


# Representative full module names, used to resolve a regex `target_modules` string the way PEFT
# does (re.fullmatch on the module's full name) without building the model.
_REPRESENTATIVE_PATHS: dict[str, str] = {
    "q_proj": "model.layers.0.self_attn.q_proj",
    "k_proj": "model.layers.0.self_attn.k_proj",
    "v_proj": "model.layers.0.self_attn.v_proj",
    "o_proj": "model.layers.0.self_attn.o_proj",
    "qkv_proj": "model.layers.0.self_attn.qkv_proj",
    "gate_proj": "model.layers.0.mlp.gate_proj",
    "up_proj": "model.layers.0.mlp.up_proj",
    "down_proj": "model.layers.0.mlp.down_proj",
    "gate_up_proj": "model.layers.0.mlp.gate_up_proj",
    "embed_tokens": "model.embed_tokens",
    "lm_head": "lm_head",
}


# Layer indices a regex `target_modules` is tried at (no supported model is deeper).
_MAX_LAYERS = 512


def _in_every_layer(path: str) -> Iterable[str]:
    """`path` ("model.layers.0.<module>") at every layer index; a path outside the layers as is."""
    if ".layers.0." not in path:
        return (path,)
    head, tail = path.split(".layers.0.", 1)
    return (f"{head}.layers.{i}.{tail}" for i in range(_MAX_LAYERS))


# PEFT options that change what the adapter computes beyond `scaling * B @ A @ x`; any adapter
# that sets one is refused rather than served wrongly.
_UNSUPPORTED_OPTIONS: dict[str, str] = {
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "use_qalora": "QALoRA",
    "layer_replication": "layer replication",
    "kasa_config": "KaSA",
    "monteclora_config": "MonteCLoRA",
    "arrow_config": "Arrow routing",
    "use_bdlora": "block-diagonal LoRA (BD-LoRA)",
    "trainable_token_indices": "trainable token embeddings",
    "target_parameters": "LoRA on raw parameters (target_parameters)",
}


def normalize_target_modules(names: Iterable[str]) -> set[str]:
    """Map projection names (or dotted paths ending in them) to the engine's fused modules.

    "all" / "all-linear" expand to every supported fused module. Unknown names raise ValueError.
    """
    out: set[str] = set()
    unknown: list[str] = []
    for name in names:
        if name in ("all", "all-linear"):
            out.update(SUPPORTED_LORA_MODULES)
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf in PROJ_TO_FUSED:
            out.add(PROJ_TO_FUSED[leaf])
        else:
            unknown.append(name)
    if unknown:
        raise ValueError(
            f"LoRA target module(s) {sorted(set(unknown))} cannot be served by this engine; "
            f"supported: {sorted(PROJ_TO_FUSED)} (or 'all-linear')"
        )
    return out


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


@dataclass
class LoRAConfig:
    path: str
    r: int
    lora_alpha: float
    # As written by PEFT: projection names, dotted paths, or the single string "all-linear" / a regex.
    target_modules: Union[list[str], str]
    use_rslora: bool = False
    use_dora: bool = False
    modules_to_save: list[str] = field(default_factory=list)
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    peft_type: str = "LORA"
    bias: str = "none"
    lora_bias: bool = False
    # PEFT's layer selection: the adapter adapts these layers only (None: every layer). Tensors of
    # other layers in its file are ignored, as PEFT ignores them.
    layers_to_transform: Optional[list[int]] = None
    # Options from _UNSUPPORTED_OPTIONS the adapter sets: option -> feature name.
    unsupported_options: dict[str, str] = field(default_factory=dict)
    # From an optional added_tokens.json next to the config: token -> id.
    added_tokens: dict[str, int] = field(default_factory=dict)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_path(cls, path: str, base_vocab_size: Optional[int] = None) -> "LoRAConfig":
        """Read `<path>/adapter_config.json` and refuse what the engine cannot serve.

        `base_vocab_size` enables the added-tokens check (ids below it are copies of base tokens).
        Every problem is a ValueError that names the path.
        """
        if not os.path.isdir(path):
            raise ValueError(f"LoRA adapter path {path!r} does not exist or is not a directory")
        cfg_file = os.path.join(path, "adapter_config.json")
        if not os.path.isfile(cfg_file):
            raise ValueError(f"LoRA adapter at {path!r} has no adapter_config.json")
        try:
            with open(cfg_file, encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"Cannot read {cfg_file!r}: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{cfg_file!r} must hold a JSON object")
        try:
            r = int(raw["r"])
            alpha = float(raw.get("lora_alpha", 8))  # PEFT's default
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{cfg_file!r} must give an integer 'r' (and a numeric 'lora_alpha')") from None
        if r <= 0:
            raise ValueError(f"{cfg_file!r}: rank r must be positive, got {r}")
        target = raw.get("target_modules")
        if target is None or (not isinstance(target, str) and not target):
            raise ValueError(f"{cfg_file!r} lists no target_modules")
        cfg = cls(
            path=path,
            r=r,
            lora_alpha=alpha,
            target_modules=target if isinstance(target, str) else [str(t) for t in target],
            use_rslora=bool(raw.get("use_rslora", False)),
            use_dora=bool(raw.get("use_dora", False)),
            modules_to_save=_as_list(raw.get("modules_to_save")),
            rank_pattern=dict(raw.get("rank_pattern") or {}),
            alpha_pattern=dict(raw.get("alpha_pattern") or {}),
            peft_type=str(raw.get("peft_type") or "LORA"),
            bias=str(raw.get("bias") or "none"),
            lora_bias=bool(raw.get("lora_bias", False)),
            layers_to_transform=cls._read_layers(raw.get("layers_to_transform"), cfg_file),
            unsupported_options={k: v for k, v in _UNSUPPORTED_OPTIONS.items() if raw.get(k)},
            added_tokens=cls._read_added_tokens(path),
        )
        cfg.validate(base_vocab_size)
        return cfg

    @staticmethod
    def _read_layers(value: Any, cfg_file: str) -> Optional[list[int]]:
        """PEFT's `layers_to_transform`: null, one layer index or a list of them (an empty list, as
        null, restricts nothing: PEFT reads it so)."""
        if value is None or value == []:
            return None
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
            raise ValueError(f"{cfg_file!r}: layers_to_transform must be a layer index or a list of them, "
                             f"got {value!r}")
        return sorted(set(items))

    @staticmethod
    def _read_added_tokens(path: str) -> dict[str, int]:
        file = os.path.join(path, "added_tokens.json")
        if not os.path.isfile(file):
            return {}
        try:
            with open(file, encoding="utf-8") as f:
                data = json.load(f)
            return {str(k): int(v) for k, v in data.items()}
        except (OSError, json.JSONDecodeError, AttributeError, TypeError, ValueError) as e:
            raise ValueError(f"Cannot read {file!r}: {e}") from None

    # ------------------------------------------------------------------ derived values
    @property
    def scaling(self) -> float:
        # rsLoRA keeps the update's magnitude rank-independent; getting this wrong silently
        # changes every output of the adapter.
        if self.use_rslora:
            return self.lora_alpha / math.sqrt(self.r)
        return self.lora_alpha / self.r

    def num_added_tokens(self, base_vocab_size: Optional[int]) -> int:
        """Tokens the adapter adds beyond the base vocabulary (ids below it are base copies)."""
        if base_vocab_size is None:
            return 0
        return sum(1 for tid in self.added_tokens.values() if tid >= base_vocab_size)

    def target_module_names(self) -> list[str]:
        """Projection names the adapter targets (a regex string is resolved as PEFT would)."""
        tm = self.target_modules
        if isinstance(tm, str):
            if tm in ("all-linear", "all"):
                return [tm]
            try:
                pattern = re.compile(tm)
            except re.error as e:
                raise ValueError(
                    f"LoRA adapter at {self.path!r}: bad target_modules regex {tm!r}: {e}"
                ) from None
            # A pattern may name some layers only (r".*layers\.1\.self_attn\.q_proj"): a module
            # is targeted if the pattern matches it in any layer (the weights say which).
            return [name for name, full in _REPRESENTATIVE_PATHS.items()
                    if any(pattern.fullmatch(path) for path in _in_every_layer(full))]
        return list(tm)

    def target_projections(self) -> set[str]:
        """Leaf names of the modules the adapter targets ("all-linear" means every known one)."""
        names = self.target_module_names()
        if any(n in ("all", "all-linear") for n in names):
            return set(PROJ_TO_FUSED)
        return {n.rsplit(".", 1)[-1] for n in names}

    @property
    def normalized_target_modules(self) -> set[str]:
        """The engine's fused modules this adapter touches (qkv_proj, o_proj, gate_up_proj, down_proj)."""
        try:
            return normalize_target_modules(self.target_module_names())
        except ValueError as e:
            raise ValueError(f"LoRA adapter at {self.path!r}: {e}") from None

    # ------------------------------------------------------------------ refusals
    def validate(self, base_vocab_size: Optional[int] = None) -> None:
        where = f"LoRA adapter at {self.path!r}"
        if self.peft_type.upper() != "LORA":
            raise ValueError(f"{where} is a {self.peft_type} adapter; only LoRA adapters are supported")
        if self.use_dora:
            raise ValueError(
                f"{where} is a DoRA adapter (use_dora=true), which this engine does not serve; "
                "merge it into the base model or use a plain LoRA adapter"
            )
        if self.modules_to_save:
            raise ValueError(
                f"{where} sets modules_to_save={self.modules_to_save}: it ships full copies of those "
                "modules, which this engine does not serve; merge the adapter into the base model"
            )
        if self.unsupported_options:
            opts = ", ".join(f"{v} ({k})" for k, v in self.unsupported_options.items())
            raise ValueError(f"{where} uses {opts}, which this engine does not serve")
        if self.bias != "none" or self.lora_bias:
            raise ValueError(
                f"{where} trains biases (bias={self.bias!r}, lora_bias={self.lora_bias}), which is not supported"
            )
        # The kernels scale in float32: a scaling past its range is inf there (NaN outputs), and
        # a NaN alpha (JSON's NaN) is NaN everywhere.
        if not (math.isfinite(self.lora_alpha) and abs(self.scaling) <= FLOAT32_MAX):
            raise ValueError(f"{where}: lora_alpha must be a finite number whose scaling (alpha / r) fits "
                             f"float32, got lora_alpha={self.lora_alpha!r}")
        odd_ranks = {k: v for k, v in self.rank_pattern.items() if int(v) != self.r}
        odd_alphas = {k: v for k, v in self.alpha_pattern.items() if float(v) != self.lora_alpha}
        if odd_ranks or odd_alphas:
            raise ValueError(
                f"{where} uses per-module ranks/alphas (rank_pattern={odd_ranks}, "
                f"alpha_pattern={odd_alphas}); only one rank and alpha per adapter are supported"
            )
        n_added = self.num_added_tokens(base_vocab_size)
        if n_added:
            raise ValueError(
                f"{where} adds {n_added} token(s) to the vocabulary (added_tokens.json), which this "
                "engine does not support; rebuild the base model with the extended vocabulary"
            )
        targets = self.normalized_target_modules  # raises for embed_tokens, lm_head, unknown names
        if not targets:
            raise ValueError(f"{where}: target_modules {self.target_modules!r} match no supported module")
