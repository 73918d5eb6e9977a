"""Write random PEFT LoRA adapters at a checkpoint's real shapes, without any download or training.

    python -m sglang.srt.tools.make_adapter --model-path /tmp/qwen3-4b --out /tmp/adapters \\
        --num 8 --rank 16 --alpha 32 --target-modules all

writes `/tmp/adapters/lora0` ... `lora7` (`adapter_config.json` + `adapter_model.safetensors`, in
PEFT's layout) and prints one `NAME=PATH` per line, ready for `--lora-paths`. Only the
checkpoint's `config.json` is read, so a config-only checkpoint for `--load-format dummy` serves
(`python -m sglang.srt.tools.make_checkpoint --preset qwen3-4b --out /tmp/qwen3-4b`). B is non-zero (PEFT
initialises it to zero, which would make every adapter a no-op): benchmarks pay for real work.
Adapter i uses seed `--seed + i`; the same arguments give byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Optional, Sequence

from sglang.srt.lora.lora_config import PEFT_PROJECTIONS
from sglang.srt.tools.demo import DemoAdapterSpec, write_peft_adapter


def make_adapters(
    model_path: str,
    out_dir: str,
    num: int = 1,
    rank: int = 16,
    alpha: Optional[int] = None,
    target_modules: Sequence[str] = ("all",),
    seed: int = 0,
    prefix: str = "lora",
) -> dict[str, str]:
    """Write `num` adapters for the checkpoint at `model_path`; returns name -> folder."""
    if num < 1 or rank < 1:
        raise ValueError("--num and --rank must be positive")
    modules = tuple(PEFT_PROJECTIONS) if "all" in target_modules else tuple(target_modules)
    unknown = sorted(set(modules) - set(PEFT_PROJECTIONS))
    if unknown:
        raise ValueError(f"unknown target module(s) {unknown}; choose from {list(PEFT_PROJECTIONS)} or 'all'")
    with open(os.path.join(model_path, "config.json")) as f:
        base_config = json.load(f)
    paths = {}
    for i in range(num):
        name = f"{prefix}{i}"
        path = os.path.join(out_dir, name)
        os.makedirs(path, exist_ok=True)
        spec = DemoAdapterSpec(name, rank, alpha if alpha is not None else 2 * rank, modules, seed + i)
        write_peft_adapter(path, base_config, spec, base_model=os.path.abspath(model_path))
        paths[name] = path
    return paths


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m sglang.srt.tools.make_adapter", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True, help="checkpoint folder (its config.json is enough)")
    p.add_argument("--out", required=True, help="folder that receives one sub-folder per adapter")
    p.add_argument("--num", type=int, default=1, help="how many adapters (default 1)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank r (default 16)")
    p.add_argument("--alpha", type=int, default=None, help="lora_alpha (default 2 x rank)")
    p.add_argument("--target-modules", nargs="+", default=["all"],
                   help=f"PEFT projections ({' '.join(PEFT_PROJECTIONS)}) or 'all' (default all)")
    p.add_argument("--seed", type=int, default=0, help="adapter i uses seed + i (default 0)")
    p.add_argument("--prefix", default="lora", help="adapter i is named <prefix><i> (default lora)")
    args = p.parse_args(argv)
    paths = make_adapters(args.model_path, args.out, args.num, args.rank, args.alpha, args.target_modules,
                          args.seed, args.prefix)
    for name, path in paths.items():
        print(f"{name}={path}")


if __name__ == "__main__":
    main()
