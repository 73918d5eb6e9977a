"""`LoRAAdapter`: one PEFT adapter's weights on the host, normalised to the engine's fused modules.

PEFT stores per projection `...layers.{i}.self_attn.q_proj.lora_A.weight` ([r, in]) and
`...lora_B.weight` ([out, r]). The engine's layers are fused, so per layer we build:
  qkv_proj      A [3r, in] = [A_q; A_k; A_v]     B [q + 2kv, r] = [B_q; B_k; B_v]
  gate_up_proj  A [2r, in] = [A_gate; A_up]      B [2I, r]      = [B_gate; B_up]
  o_proj, down_proj as they are.
A projection the adapter lacks inside a fused module is zero (its slice then adds nothing), which
is exactly PEFT's behaviour for an untargeted projection. Every tensor is checked against the base
model's shapes here, on the host, so a bad adapter fails at load with a message and never reaches
the GPU pool.

Tensor parallelism (DESIGN §11): the adapter is checked against the full, unsharded module shapes,
then each rank keeps its part: column-parallel modules (qkv_proj, gate_up_proj) keep A whole and
the rows of B that match the base layer's output rows (its `output_partition()`, blocks of the
stacked [q; k; v] / [gate; up] layout); row-parallel modules (o_proj, down_proj) keep the columns
of A that match the base layer's input slice (`input_partition()`) and B whole, and their wrapper
adds the partial delta before the all-reduce.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from sglang.srt.lora.lora_config import FUSED_MODULES, PROJ_TO_FUSED, LoRAConfig

# `...layers.<i>.<...>.<proj>.lora_<A|B>[.<adapter>].weight`
_TENSOR_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:.*\.)?([^.]+)\.lora_([AB])(?:\.[^.]+)?\.weight$")


@dataclass(frozen=True)
class LoRAModuleShape:
    """A fused linear module as LoRA sees it on this rank: input width and the output width of each
    slice (what the pool holds), plus, under tensor parallelism, the full module's sizes (what an
    adapter file holds) and where this rank's part lies in them."""

    in_dim: int
    out_sizes: tuple[int, ...]  # in output order, e.g. (q, kv, kv) for qkv_proj
    full_in_dim: Optional[int] = None  # None: as in_dim
    full_out_sizes: Optional[tuple[int, ...]] = None  # None: as out_sizes
    # Column-parallel: (start, length) row blocks of the full fused output this rank holds.
    out_partition: Optional[tuple[tuple[int, int], ...]] = None
    # Row-parallel: (start, length) of this rank's input columns.
    in_partition: Optional[tuple[int, int]] = None

    @property
    def out_dim(self) -> int:
        return sum(self.out_sizes)

    @property
    def num_slices(self) -> int:
        return len(self.out_sizes)

    @property
    def checkpoint_in_dim(self) -> int:
        return self.full_in_dim or self.in_dim

    @property
    def checkpoint_out_sizes(self) -> tuple[int, ...]:
        return self.full_out_sizes or self.out_sizes

    def shard(self, a: "Rows", b: "Rows") -> tuple["Rows", "Rows"]:
        """This rank's part of a full fused (A [c*r, in], B [out, r]), each given as its row blocks
        (views, no copy; the blocks themselves at tp 1)."""
        if self.in_partition is not None:
            a = [p.narrow(1, *self.in_partition) for p in a]
        if self.out_partition is not None:
            b = [q for start, n in self.out_partition for q in row_range(b, start, n)]
        return a, b


# One matrix as the row-wise concatenation of these blocks (same trailing shape): what an adapter's
# fused A and B are until pack_tensors writes them into the host buffer. They stay apart until then:
# a torch.cat per module and layer was a third of a start-up read's time.
Rows = list[torch.Tensor]


def row_range(blocks: Rows, start: int, length: int) -> Rows:
    """Rows [start, start + length) of the concatenation of `blocks`, as views of them."""
    out, offset = [], 0
    for blk in blocks:
        lo, hi = max(start, offset), min(start + length, offset + blk.shape[0])
        if lo < hi:
            out.append(blk.narrow(0, lo - offset, hi - lo))
        offset += blk.shape[0]
    assert sum(q.shape[0] for q in out) == length, (start, length, offset)
    return out


@dataclass
class LoRAModelShapes:
    """The base model's shapes for every module LoRA may target (this rank's, under TP)."""

    num_layers: int
    modules: dict[str, LoRAModuleShape]

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "LoRAModelShapes":
        hidden = int(cfg.hidden_size)
        heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
        inter = int(cfg.intermediate_size)
        q, kv = heads * head_dim, kv_heads * head_dim
        return cls(
            num_layers=int(cfg.num_hidden_layers),
            modules={
                "qkv_proj": LoRAModuleShape(hidden, (q, kv, kv)),
                "o_proj": LoRAModuleShape(q, (hidden,)),
                "gate_up_proj": LoRAModuleShape(hidden, (inter, inter)),
                "down_proj": LoRAModuleShape(inter, (hidden,)),
            },
        )


def module_shape(layer: torch.nn.Module) -> LoRAModuleShape:
    """A built linear layer's LoRA shape on this rank: local sizes for the pool, full sizes and
    this rank's partition for slicing adapters (DESIGN §11)."""
    if isinstance(layer, QKVParallelLinear):
        q, kv = layer.q_proj_shard_size, layer.kv_proj_shard_size
        full_q, full_kv = layer.total_num_heads * layer.head_size, layer.total_num_kv_heads * layer.head_size
        local, full = (q, kv, kv), (full_q, full_kv, full_kv)
    elif isinstance(layer, MergedColumnParallelLinear):
        local, full = tuple(layer.output_sizes), tuple(layer.full_output_sizes)
    else:
        local, full = (layer.output_size,), (layer.full_output_size,)
    if getattr(layer, "tp_size", 1) == 1:
        return LoRAModuleShape(layer.input_size, local)
    if isinstance(layer, RowParallelLinear):
        return LoRAModuleShape(layer.input_size, local, layer.full_input_size, full,
                               in_partition=layer.input_partition())
    return LoRAModuleShape(layer.input_size, local, layer.full_input_size, full,
                           out_partition=tuple(layer.output_partition()))


def read_adapter_tensors(path: str) -> dict[str, torch.Tensor]:
    """All tensors of `<path>/adapter_model.safetensors` (else `.bin`), on the CPU."""
    st_file = os.path.join(path, "adapter_model.safetensors")
    bin_file = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(st_file):
        from safetensors.torch import load

        # From the file's bytes, not `load_file`: its memory-mapped reader (safetensors 0.8) keeps
        # two small objects per tensor read for good, ~1.6 KB per load of a tiny adapter and ~28 KB
        # of a 36-layer one, which a server loading and unloading adapters all day accumulates.
        # An adapter is small, and its tensors are copied into host buffers next anyway.
        try:
            with open(st_file, "rb") as f:
                return load(f.read())
        except Exception as e:  # safetensors raises its own error type for truncated headers/data
            raise ValueError(
                f"Cannot read LoRA weights {st_file!r} (truncated or corrupt file?): {e}"
            ) from None
    if os.path.isfile(bin_file):
        try:
            data = torch.load(bin_file, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ValueError(
                f"Cannot read LoRA weights {bin_file!r} (truncated or corrupt file?): {e}"
            ) from None
        if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
            raise ValueError(f"LoRA weights {bin_file!r} are not a dict of tensors")
        return data
    raise ValueError(f"LoRA adapter at {path!r} has no adapter_model.safetensors or adapter_model.bin")


def pack_tensors(tensors: list[Union[torch.Tensor, Rows]], pin: bool, dtype: Optional[torch.dtype] = None,
                 buffer_bytes: Optional[int] = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the tensors as views of their own shapes, in order; the buffers behind them): copied into
    contiguous host buffers per dtype (pinned if `pin`), converted to `dtype` when given. An entry
    may be a list of row blocks (`Rows`): its view is their concatenation, written block by block.

    buffer_bytes: start a new buffer before one would pass this size (a tensor larger than it
    gets its own). PyTorch's pinned allocator rounds every block up to a power of two, so one
    66 MB buffer would pin 128 MB; blocks of a power-of-two size pin what they hold."""
    blocks = [t if isinstance(t, list) else [t] for t in tensors]
    shapes = [torch.Size((sum(b.shape[0] for b in bl),) + tuple(bl[0].shape[1:])) for bl in blocks]
    out: list[Optional[torch.Tensor]] = [None] * len(tensors)
    groups: list[tuple[torch.dtype, list[int]]] = []  # (dtype, tensor indices) per buffer
    group_bytes: list[int] = []
    open_group: dict[torch.dtype, int] = {}  # dtype -> its buffer being filled (index into groups)
    for i, bl in enumerate(blocks):
        buf_dtype = dtype or bl[0].dtype
        size = shapes[i].numel() * buf_dtype.itemsize
        g = open_group.get(buf_dtype)
        if g is None or (buffer_bytes is not None and group_bytes[g] + size > buffer_bytes):
            g = open_group[buf_dtype] = len(groups)
            groups.append((buf_dtype, []))
            group_bytes.append(0)
        groups[g][1].append(i)
        group_bytes[g] += size
    buffers = []
    for buf_dtype, idx in groups:
        buf = torch.empty(sum(shapes[i].numel() for i in idx), dtype=buf_dtype, pin_memory=pin)
        offset = 0
        for i in idx:
            view = buf[offset: offset + shapes[i].numel()].view(shapes[i])
            row = 0
            for blk in blocks[i]:
                # Converts (round to nearest even), as a copy into the pool would.
                view[row: row + blk.shape[0]].copy_(blk)
                row += blk.shape[0]
            out[i] = view
            offset += shapes[i].numel()
        buffers.append(buf)
    return out, buffers  # type: ignore[return-value]


# Host buffer size of an adapter's copy: a power of two (see pack_tensors); a rank-16 Qwen3-4B
# adapter in bf16 (66 MB) takes five.
HOST_BUFFER_BYTES = 16 << 20


def all_finite(t: torch.Tensor) -> bool:
    """No inf or NaN in t: the smallest and largest values are finite exactly when all are (both
    propagate NaN). One pass and no temporary: on a CPU 6x faster than abs().amax(), and more than
    an order of magnitude faster than isfinite().all(), at adapter sizes."""
    return t.numel() == 0 or all(math.isfinite(float(v)) for v in torch.aminmax(t))


class LoRAAdapter:
    """Host copy of one adapter. `layers[i][module] = (A, B)` for the fused modules it has."""

    def __init__(self, lora_id: str, config: LoRAConfig, shapes: LoRAModelShapes) -> None:
        self.lora_id = lora_id
        self.config = config
        self.shapes = shapes
        self.layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [
            {} for _ in range(shapes.num_layers)
        ]
        self.pinned = False

    @property
    def rank(self) -> int:
        return self.config.r

    @property
    def scaling(self) -> float:
        return self.config.scaling

    @property
    def modules(self) -> set[str]:
        """Fused modules for which at least one layer has weights."""
        return {m for layer in self.layers for m in layer}

    @classmethod
    def load(cls, lora_id: str, config: LoRAConfig, shapes: LoRAModelShapes,
             dtype: Optional[torch.dtype] = None, pin: Optional[bool] = None) -> "LoRAAdapter":
        """Read and check the adapter's files; the host copy is kept in `dtype` (the pool's) when
        given, pinned if `pin` (default: when CUDA is available; see pin_host_copy)."""
        adapter = cls(lora_id, config, shapes)
        adapter.initialize_weights(dtype, torch.cuda.is_available() if pin is None else pin)
        return adapter

    def pin_host_copy(self) -> None:
        """Move the host copy into pinned buffers (a no-op without CUDA or when pinned already).
        Start-up reads adapters unpinned in threads while the main thread captures CUDA graphs,
        where another thread's cudaHostAlloc is not allowed, and pins them after."""
        if not torch.cuda.is_available() or self.pinned:
            return
        entries = [(layer, module) for layer, mods in enumerate(self.layers) for module in mods]
        tensors = [t for layer, module in entries for t in self.layers[layer][module]]
        packed, _ = pack_tensors(tensors, pin=True, buffer_bytes=HOST_BUFFER_BYTES)
        for i, (layer, module) in enumerate(entries):
            self.layers[layer][module] = (packed[2 * i], packed[2 * i + 1])
        self.pinned = True

    # ------------------------------------------------------------------ loading
    def initialize_weights(self, dtype: Optional[torch.dtype] = None, pin: bool = False) -> None:
        path = self.config.path
        tensors = read_adapter_tensors(path)
        if not tensors:
            raise ValueError(f"LoRA weights of adapter at {path!r} are empty")
        targets = self.config.target_projections()
        layers = self.config.layers_to_transform
        # (layer, projection) -> {"A": (name, tensor), "B": (name, tensor)}
        parts: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
        for name, tensor in tensors.items():
            m = _TENSOR_NAME.search(name)
            if m is None:
                raise ValueError(
                    f"LoRA adapter at {path!r} holds tensor {name!r}, which is not a per-layer "
                    "lora_A/lora_B weight of a supported module; this engine cannot serve it"
                )
            layer, proj, ab = int(m.group(1)), m.group(2), m.group(3)
            if layers is not None and layer not in layers:
                continue  # outside layers_to_transform: PEFT builds no module there, nor do we
            fused = PROJ_TO_FUSED.get(proj)
            if fused is None:
                raise ValueError(
                    f"LoRA adapter at {path!r}: tensor {name!r} adapts unsupported module {proj!r}"
                )
            if proj not in targets:
                raise ValueError(
                    f"LoRA adapter at {path!r}: tensor {name!r} adapts {proj!r}, which adapter_config.json "
                    "does not list in target_modules"
                )
            if layer >= self.shapes.num_layers:
                raise ValueError(
                    f"LoRA adapter at {path!r}: tensor {name!r} is for layer {layer}, but the base model "
                    f"has {self.shapes.num_layers} layers"
                )
            if tensor.dim() != 2:
                raise ValueError(
                    f"LoRA adapter at {path!r}: tensor {name!r} has shape {tuple(tensor.shape)}, expected a matrix"
                )
            slot = parts.setdefault((layer, proj), {})
            if ab in slot:
                raise ValueError(f"LoRA adapter at {path!r}: tensors {slot[ab][0]!r} and {name!r} collide")
            slot[ab] = (name, tensor)

        if not parts:
            raise ValueError(f"LoRA adapter at {path!r} holds no weights for its layers_to_transform "
                             f"{self.config.layers_to_transform}")
        for (layer, proj), ab in parts.items():
            missing = {"A", "B"} - set(ab)
            if missing:
                present = next(iter(ab.values()))[0]
                raise ValueError(
                    f"LoRA adapter at {path!r}: {present!r} has no matching lora_{missing.pop()} tensor"
                )

        built: list[tuple[int, str, Rows, Rows]] = []
        for layer in range(self.shapes.num_layers):
            for fused, projs in FUSED_MODULES.items():
                ab = self._build_fused(layer, fused, projs, parts)
                if ab is not None:
                    built.append((layer, fused, *ab))
        # Pinned host memory makes the copies into the pool asynchronous DMA. A few pinned buffers
        # of HOST_BUFFER_BYTES for the whole adapter: pinning is a driver call per allocation
        # (~1 ms), and an adapter has two tensors per module and layer (~300 for a 36-layer
        # model); blocks of a power-of-two size waste nothing to the allocator's rounding. In the pool's dtype
        # (PEFT often saves float32): a swap then copies half the bytes, with no conversion on the
        # way, and rounds exactly as a conversion at copy time would.
        packed, buffers = pack_tensors([t for _, _, a, b in built for t in (a, b)], pin=pin,
                                       dtype=dtype, buffer_bytes=HOST_BUFFER_BYTES)
        self.pinned = pin
        # After the conversion, which may overflow (float32 -> float16). A folded GEMM multiplies
        # every slot's B by the zeros of the other rows: one inf or NaN would reach every request
        # of the batch, not only this adapter's.
        if not all(all_finite(buf) for buf in buffers):
            bad = next((name for part in parts.values() for name, t in part.values()
                        if not all_finite(t if dtype is None else t.to(dtype))), "?")
            held = "holds inf or NaN values" + (f" (in {str(dtype).replace('torch.', '')})" if dtype else "")
            raise ValueError(f"LoRA adapter at {path!r}: tensor {bad!r} {held}")
        for i, (layer, fused, _, _) in enumerate(built):
            self.layers[layer][fused] = (packed[2 * i], packed[2 * i + 1])

    def _check(self, name: str, t: torch.Tensor, expected: tuple[int, int], what: str) -> torch.Tensor:
        if tuple(t.shape) != expected:
            raise ValueError(
                f"LoRA adapter at {self.config.path!r}: tensor {name!r} has shape {tuple(t.shape)}, "
                f"but the base model needs {expected} ({what}, rank r={self.config.r}); "
                "was the adapter trained for a different base model?"
            )
        return t

    def _build_fused(
        self,
        layer: int,
        fused: str,
        projs: tuple[str, ...],
        parts: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]],
    ) -> Optional[tuple[Rows, Rows]]:
        """This layer's fused A and B (as row blocks, this rank's part), or None if the adapter
        leaves the module alone."""
        r = self.config.r
        shape = self.shapes.modules.get(fused)
        has_split = any((layer, p) in parts for p in projs)
        has_stacked = len(projs) > 1 and (layer, fused) in parts
        if not (has_split or has_stacked):
            return None
        if shape is None:
            raise ValueError(
                f"LoRA adapter at {self.config.path!r} adapts {fused} in layer {layer}, "
                "which the base model does not have"
            )
        if has_split and has_stacked:
            raise ValueError(
                f"LoRA adapter at {self.config.path!r} has both {fused} and its parts {projs} in layer {layer}"
            )
        if has_stacked:
            # One A shared by all slices (trained on a fused checkpoint): written once per slice so
            # the kernels see the same [slice0; slice1; ...] layout as a split adapter.
            (a_name, a), (b_name, b) = parts[(layer, fused)]["A"], parts[(layer, fused)]["B"]
            self._check(a_name, a, (r, shape.checkpoint_in_dim), f"lora_A of {fused}: [r, in]")
            self._check(b_name, b, (sum(shape.checkpoint_out_sizes), r), f"lora_B of {fused}: [out, r]")
            return shape.shard([a] * len(projs), [b])

        a_parts, b_parts = [], []
        dtype = next(t for p in projs if (layer, p) in parts for _, t in parts[(layer, p)].values()).dtype
        in_dim = shape.checkpoint_in_dim
        for proj, out_k in zip(projs, shape.checkpoint_out_sizes):
            got = parts.get((layer, proj))
            if got is None:
                a_parts.append(torch.zeros(r, in_dim, dtype=dtype))
                b_parts.append(torch.zeros(out_k, r, dtype=dtype))
                continue
            (a_name, a), (b_name, b) = got["A"], got["B"]
            a_parts.append(self._check(a_name, a, (r, in_dim), f"lora_A of {proj}: [r, in]"))
            b_parts.append(self._check(b_name, b, (out_k, r), f"lora_B of {proj}: [out, r]"))
        return shape.shard(a_parts, b_parts)
