"""Finding and streaming checkpoint tensors, and dummy initialisation."""

from __future__ import annotations

import glob
import json
import os
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

SAFETENSORS_INDEX = "model.safetensors.index.json"


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id=None) -> None:
    """Loader of parameters that are neither sharded nor fused (norms, unsplit biases)."""
    assert shard_id is None
    if tuple(param.shape) != tuple(loaded_weight.shape):
        raise ValueError(
            f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, expected {tuple(param.shape)}"
        )
    param.data.copy_(loaded_weight)


def find_safetensors_files(model_path: str) -> list[str]:
    """The checkpoint's safetensors files: those named by the index when there is one (sharded),
    else every `*.safetensors` in the folder."""
    index_path = os.path.join(model_path, SAFETENSORS_INDEX)
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"{index_path} is not a valid safetensors index: {e}") from None
        files = [os.path.join(model_path, name) for name in sorted(set(weight_map.values()))]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"{index_path} names shard(s) that do not exist: {missing}")
        return files
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if files:
        return files
    if glob.glob(os.path.join(model_path, "*.bin")) or glob.glob(os.path.join(model_path, "*.pt")):
        raise ValueError(
            f"{model_path!r} holds only PyTorch .bin/.pt weights; convert them to safetensors "
            "(only safetensors checkpoints are supported)"
        )
    raise ValueError(
        f"no safetensors weights in {model_path!r}; pass --load-format dummy to run with random weights"
    )


def safetensors_weights_iterator(files: list[str], progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, host tensor) one at a time, so host memory holds about one tensor."""
    total = 0
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            total += len(list(f.keys()))
    with tqdm(total=total, desc="Loading safetensors", unit="tensor", disable=not progress, mininterval=1.0) as bar:
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
                    bar.update(1)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights in place: N(0, std) matrices, zero biases, unit norm weights. A small std keeps
    activations finite at any depth, which is all a benchmark needs."""
    from sglang.srt.layers.layernorm import RMSNorm  # local: keeps this module free of layer imports

    norm_params = {id(p) for m in model.modules() if isinstance(m, RMSNorm) for p in m.parameters()}
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if id(param) in norm_params:
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            gen = generators.get(param.device)
            if gen is None:
                gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            param.normal_(0.0, std, generator=gen)
