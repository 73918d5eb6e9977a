"""Building the model: the checkpoint's model class on the target device, its weights streamed from
safetensors (model_loader/weight_utils.py) or drawn at random (`--load-format dummy`)."""

from __future__ import annotations

import contextlib
import logging
import time
import zlib
from typing import Iterator, Optional

import torch
from torch import nn

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed import SINGLE_RANK, TensorParallelGroup
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.model_loader.weight_utils import find_safetensors_files, safetensors_weights_iterator
from sglang.srt.models.registry import get_model_class

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "dummy")


def count_with_unit(n: int) -> str:
    """1234 -> '1.23 K', 494032768 -> '494.03 M', 8030261248 -> '8.03 B' (a tiny model is not '0.00 B')."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)


@contextlib.contextmanager
def _default_dtype_and_device(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    """Parameters are created directly in their final dtype on the target device (no float32 copy
    on the host first, which would double peak memory for large models)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


def get_model(
    model_config: ModelConfig,
    load_format: str = "auto",
    device: torch.device | str = "cpu",
    dtype: Optional[torch.dtype] = None,
    seed: int = 0,
    progress: bool = True,
    tp_group: TensorParallelGroup = SINGLE_RANK,
) -> nn.Module:
    """Build `model_config`'s architecture and load its weights (`auto`/`safetensors`: stream the
    checkpoint's safetensors files; `dummy`: random weights from the config alone).

    Under tensor parallelism (`tp_group.size > 1`) the layers are built as this rank's shards and
    each reads only its slice of every checkpoint tensor. Whether the model splits that way was
    checked once at start (server_configs.check_tensor_parallel)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format must be one of {list(LOAD_FORMATS)}, got {load_format!r}")
    model_cls = get_model_class(model_config.architectures)
    dtype = dtype or model_config.dtype
    device = torch.device(device)
    # Resolve the files before allocating anything: a wrong path fails fast.
    files = None if load_format == "dummy" else find_safetensors_files(model_config.model_path)

    start = time.perf_counter()
    with _default_dtype_and_device(dtype, device):
        model = model_cls(model_config, tp_group=tp_group)
    with torch.no_grad():
        if files is None:
            init_dummy_weights(model, seed=seed)
        else:
            loaded = model.load_weights(safetensors_weights_iterator(files, progress=progress))
            missing = sorted(set(dict(model.named_parameters())) - loaded)
            if missing:
                raise ValueError(
                    f"checkpoint {model_config.model_path!r} lacks {len(missing)} weight(s) of "
                    f"{model_config.architecture}: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
                )
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "Loaded %s (%s weights, %s params%s, %s) on %s in %.1f s",
        model_config.architecture,
        "dummy" if files is None else f"{len(files)} safetensors file(s)",
        count_with_unit(n_params),
        f" in this rank's shard, tp {tp_group.rank}/{tp_group.size}" if tp_group.size > 1 else "",
        str(dtype).replace("torch.", ""),
        device,
        time.perf_counter() - start,
    )
    return model


def _param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 62)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights in place: N(0, std) matrices, zero biases, unit norm weights. A small std keeps
    activations finite at any depth, which is all a benchmark needs.

    Each matrix comes from its own generator, seeded by (seed, parameter name), and is drawn at its
    unsharded shape (`param.full_shape`) and handed to the parameter's weight_loader like a
    checkpoint tensor: a tensor-parallel rank holds exactly its slice of the tp_size-1 model, so
    tp N and tp 1 can be compared on dummy weights too (on one device type: CPU and CUDA draw
    different numbers from the same seed).
    """
    norm_params = {id(p) for m in model.modules() if isinstance(m, RMSNorm) for p in m.parameters()}
    for name, param in model.named_parameters():
        if id(param) in norm_params:
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            gen = torch.Generator(device=param.device).manual_seed(_param_seed(seed, name))
            full_shape = tuple(getattr(param, "full_shape", param.shape))
            if full_shape == tuple(param.shape):
                param.normal_(0.0, std, generator=gen)
                continue
            full = torch.empty(full_shape, dtype=param.dtype, device=param.device).normal_(0.0, std, generator=gen)
            param.weight_loader(param, full)
            del full
