"""The built-in demo: a tiny random-weight model with a real tokenizer and chat template, plus two
PEFT LoRA adapters, materialised into `$SGLANG_CACHE_DIR/demo/<version>` (default
`~/.cache/sglang`). `python -m sglang.launch_server` with no `--model-path` serves it.

Deterministic: the same files every time (fixed seeds; make_checkpoint writes byte-identical
files). Each folder is built in a temporary sibling and renamed into place, with a completion
marker written last, so an interrupted or concurrent first run never leaves a half-written folder
that a later run would trust.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Optional, TextIO

from sglang.srt.lora.lora_config import PEFT_PROJECTIONS
from sglang.srt.utils import get_cache_dir

DEMO_VERSION = "v1"  # bump when the demo files change, so stale caches are not reused
DEMO_ARCH = "qwen3"
DEMO_SEED = 20240607
COMPLETE_MARKER = ".sglang-complete"


@dataclass(frozen=True)
class DemoAdapterSpec:
    name: str
    rank: int
    alpha: int
    target_modules: tuple[str, ...]
    seed: int


# One adapter on attention q/v at rank 8, one on every linear module at rank 16.
DEMO_ADAPTERS = (
    DemoAdapterSpec("demo-qv-r8", 8, 16, ("q_proj", "v_proj"), DEMO_SEED + 1),
    DemoAdapterSpec("demo-all-r16", 16, 32, PEFT_PROJECTIONS, DEMO_SEED + 2),
)


@dataclass
class DemoModel:
    root: str
    model_path: str
    adapters: dict[str, str] = field(default_factory=dict)  # name -> folder


def demo_root(cache_dir: Optional[str] = None) -> str:
    return os.path.join(cache_dir or get_cache_dir(), "demo", DEMO_VERSION)


def _is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, COMPLETE_MARKER))


def materialize_once(path: str, build: Callable[[str], None]) -> None:
    """Build `path` once: in a temporary sibling, marked complete, then renamed into place."""
    if _is_complete(path):
        return
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        build(tmp)
        with open(os.path.join(tmp, COMPLETE_MARKER), "w") as f:
            f.write("complete\n")
        if os.path.exists(path) and not _is_complete(path):
            shutil.rmtree(path, ignore_errors=True)  # a leftover of an older, interrupted layout
        try:
            os.rename(tmp, path)
        except OSError:
            if not _is_complete(path):  # lost a race to a writer that did not finish: give up loudly
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------- adapters
def _module_shapes(config: dict) -> dict[str, tuple[str, int, int]]:
    """PEFT projection -> (parent module, in_features, out_features) for a Llama-family config."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    return {
        "q_proj": ("self_attn", hidden, heads * head_dim),
        "k_proj": ("self_attn", hidden, kv_heads * head_dim),
        "v_proj": ("self_attn", hidden, kv_heads * head_dim),
        "o_proj": ("self_attn", heads * head_dim, hidden),
        "gate_proj": ("mlp", hidden, inter),
        "up_proj": ("mlp", hidden, inter),
        "down_proj": ("mlp", inter, hidden),
    }


def write_peft_adapter(out_dir: str, base_config: dict, spec: DemoAdapterSpec,
                       base_model: str = "sglang-demo") -> None:
    """Write `adapter_config.json` + `adapter_model.safetensors` in PEFT's layout.

    A is N(0, 1/in) like a trained down-projection; B is non-zero (PEFT initialises it to zero,
    which would make the adapter a no-op and every LoRA test vacuous), sized so the adapter moves
    the next-token distribution clearly without drowning the base model.
    """
    import torch
    from safetensors.torch import save_file

    shapes = _module_shapes(base_config)
    gen = torch.Generator().manual_seed(spec.seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(base_config["num_hidden_layers"]):
        for proj in spec.target_modules:
            parent, fan_in, fan_out = shapes[proj]
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{proj}"
            a = torch.randn(spec.rank, fan_in, generator=gen) / math.sqrt(fan_in)
            b = torch.randn(fan_out, spec.rank, generator=gen) * (0.3 / math.sqrt(spec.rank))
            tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(spec.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "init_lora_weights": True,
        "inference_mode": True,
    }
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


# ---------------------------------------------------------------------------- entry points
def ensure_demo_model(cache_dir: Optional[str] = None) -> DemoModel:
    """Materialise (or reuse) the demo checkpoint and its adapters; returns their paths."""
    from sglang.srt.tools.make_checkpoint import make_checkpoint

    root = demo_root(cache_dir)
    model_path = os.path.join(root, "model")
    materialize_once(model_path, lambda tmp: make_checkpoint(
        tmp, arch=DEMO_ARCH, preset="tiny", seed=DEMO_SEED, with_weights=True
    ))
    with open(os.path.join(model_path, "config.json")) as f:
        base_config = json.load(f)
    demo = DemoModel(root=root, model_path=model_path)
    for spec in DEMO_ADAPTERS:
        path = os.path.join(root, "adapters", spec.name)
        materialize_once(path, lambda tmp, spec=spec: write_peft_adapter(tmp, base_config, spec))
        demo.adapters[spec.name] = path
    return demo


def print_demo_banner(cache_dir: Optional[str] = None, file: TextIO = sys.stderr, with_adapters: bool = True) -> None:
    line = "=" * 78
    names = ", ".join(spec.name for spec in DEMO_ADAPTERS)
    adapters = (
        f" LoRA adapters served: {names}; pick one with \"lora_path\" on /generate or\n"
        f" model=\"demo:{DEMO_ADAPTERS[0].name}\" on the OpenAI API.\n"
    ) if with_adapters else ""
    print(
        f"{line}\n"
        " sglang DEMO MODE: serving a tiny built-in model with RANDOM weights.\n"
        " Its answers are gibberish; it is here so you can try the API without any download.\n"
        f" Files (model + {len(DEMO_ADAPTERS)} demo LoRA adapters): {demo_root(cache_dir)}\n"
        f"{adapters}"
        " To serve a real model:\n"
        "     python -m sglang.launch_server --model-path /path/to/hf-checkpoint\n"
        f"{line}",
        file=file,
        flush=True,
    )


if __name__ == "__main__":
    d = ensure_demo_model()
    print(json.dumps({"model_path": d.model_path, "adapters": d.adapters}, indent=2))
