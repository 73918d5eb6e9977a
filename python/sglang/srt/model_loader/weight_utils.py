"""Finding and streaming checkpoint tensors, and the checks every weight loader makes.

Tensors are streamed as `CheckpointTensor`s: lazy views of a safetensors tensor that the layers'
weight loaders narrow to this rank's slice before anything is read, so a tensor-parallel rank reads
only its shard from disk and never holds a whole tensor in host memory.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Iterator, Optional, Union

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

SAFETENSORS_INDEX = "model.safetensors.index.json"

# A torch.Tensor, or a lazy checkpoint slice with `shape`, `narrow(dim, start, length)` and
# `materialize()` (CheckpointTensor below): what every parameter's weight_loader receives.
LoadedWeight = Any
# Which part of a fused parameter a checkpoint tensor fills: "q" / "k" / "v", a gate_up index, or None.
ShardId = Optional[Union[str, int]]


def load_into(dst: torch.Tensor, loaded: LoadedWeight, what: str) -> None:
    """Check the shape, read the (possibly lazy) tensor and copy it into `dst`."""
    if tuple(dst.shape) != tuple(loaded.shape):
        raise ValueError(
            f"checkpoint tensor for {what} has shape {tuple(loaded.shape)}, expected {tuple(dst.shape)}"
        )
    dst.copy_(loaded if isinstance(loaded, torch.Tensor) else loaded.materialize())


def check_rows(loaded: LoadedWeight, rows: int, what: str) -> None:
    """A checkpoint tensor sliced by rows must hold the layer's full (unsharded) row count."""
    if loaded.shape[0] != rows:
        raise ValueError(f"checkpoint tensor for {what} has shape {tuple(loaded.shape)}, expected {rows} rows")


class CheckpointTensor:
    """A lazy slice of one safetensors tensor: `narrow` only narrows the index ranges; the bytes are
    read by `materialize()`, and only those of the slice (safetensors maps the file)."""

    def __init__(self, st_slice: Any, name: str, ranges: Optional[tuple[tuple[int, int], ...]] = None) -> None:
        self._slice = st_slice
        self.name = name
        self._ranges = ranges if ranges is not None else tuple((0, n) for n in st_slice.get_shape())

    @property
    def shape(self) -> torch.Size:
        return torch.Size(stop - start for start, stop in self._ranges)

    def dim(self) -> int:
        return len(self._ranges)

    def narrow(self, dim: int, start: int, length: int) -> "CheckpointTensor":
        dim = dim % self.dim()
        lo, hi = self._ranges[dim]
        if start < 0 or length < 0 or lo + start + length > hi:
            raise ValueError(f"{self.name}: narrow({dim}, {start}, {length}) is outside shape {tuple(self.shape)}")
        ranges = list(self._ranges)
        ranges[dim] = (lo + start, lo + start + length)
        return CheckpointTensor(self._slice, self.name, tuple(ranges))

    def materialize(self) -> torch.Tensor:
        if not self._ranges:  # a scalar
            return self._slice[...]
        return self._slice[tuple(slice(lo, hi) for lo, hi in self._ranges)]

    def __repr__(self) -> str:
        return f"CheckpointTensor({self.name!r}, ranges={list(self._ranges)})"


def default_weight_loader(
    param: torch.Tensor, loaded_weight: Union[torch.Tensor, CheckpointTensor], shard_id: ShardId = None
) -> None:
    """Loader of parameters that are neither sharded nor fused (norms, unsplit biases)."""
    assert shard_id is None
    load_into(param.data, loaded_weight, "an unsharded parameter")


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


def safetensors_weights_iterator(files: list[str], progress: bool = True) -> Iterator[tuple[str, CheckpointTensor]]:
    """Yield (name, CheckpointTensor) one at a time, each valid until the next item: host memory
    holds at most the slice a weight loader reads."""
    total = 0
    for path in files:
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                total += len(list(f.keys()))
        except Exception as e:  # safetensors' own error type: a truncated or corrupt file
            raise ValueError(f"cannot read the checkpoint file {path!r}: {e} (truncated or corrupt?)") from None
    with tqdm(total=total, desc="Loading safetensors", unit="tensor", disable=not progress, mininterval=1.0) as bar:
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, CheckpointTensor(f.get_slice(name), name)
                    bar.update(1)
