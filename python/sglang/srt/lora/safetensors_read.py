"""Read a `.safetensors` file in one read into a host buffer, its tensors as views of that buffer.

The format (safetensors' documentation): an 8-byte little-endian header length N, N bytes of JSON
mapping each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets into the
data after the header; "__metadata__" holds strings), then the data.

For a thread that reads many files (the startup adapters): `safetensors.torch.load_file` hands
out fresh memory for every file, and faulting in fresh pages costs more than the read itself (on
this project's CPU machine, a 127 MB float32 adapter: 84 ms into fresh pages, 20 ms into pages
used before). Here the file goes in one `readinto` (the GIL is released for it) into a
`ReadBuffer` that the thread reuses. The whole file is read, never mapped: a file truncated while
it is read fails with an error, where a mapping would fault the process.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class ReadBuffer:
    """Host bytes reused across reads (one per thread). The tensors of a read are views of it:
    valid until the next read into the same buffer (a read that needs more room allocates a new
    buffer, so the views of earlier reads stay valid then)."""

    def __init__(self) -> None:
        self._data: Optional[torch.Tensor] = None

    def take(self, nbytes: int) -> torch.Tensor:
        if self._data is None or self._data.numel() < nbytes:
            self._data = torch.empty(nbytes, dtype=torch.uint8)
        return self._data[:nbytes]


def read_safetensors(path: str, buffer: Optional[ReadBuffer] = None) -> dict[str, torch.Tensor]:
    """Every tensor of the file at `path`, as views of one host buffer (`buffer`'s, else a new one).
    ValueError for a file that is not a complete safetensors file, OSError for one not readable."""
    size = os.path.getsize(path)
    data = buffer.take(size) if buffer is not None else torch.empty(size, dtype=torch.uint8)
    view = memoryview(data.numpy())
    with open(path, "rb") as f:
        got = 0
        while got < size:
            n = f.readinto(view[got:])
            if not n:
                raise ValueError(f"the file ended after {got} of {size} bytes")
            got += n
    if size < 8:
        raise ValueError(f"{size} bytes: too short for a header")
    header_len = int.from_bytes(bytes(view[:8]), "little")
    if header_len > size - 8:
        raise ValueError(f"header of {header_len} bytes in a file of {size}")
    try:
        header = json.loads(bytes(view[8:8 + header_len]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    base, room = 8 + header_len, size - 8 - header_len
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        out[name] = _tensor(data, name, info, base, room)
    return out


def _tensor(data: torch.Tensor, name: str, info, base: int, room: int) -> torch.Tensor:
    try:
        dtype, shape, (begin, end) = _DTYPES.get(info["dtype"]), [int(d) for d in info["shape"]], info["data_offsets"]
        begin, end = int(begin), int(end)
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"tensor {name!r}: malformed entry {info!r}") from None
    if dtype is None:
        raise ValueError(f"tensor {name!r}: dtype {info['dtype']!r} is not supported")
    numel = 1
    for d in shape:
        if d < 0:
            raise ValueError(f"tensor {name!r}: negative dimension in shape {shape}")
        numel *= d
    if not 0 <= begin <= end <= room or end - begin != numel * dtype.itemsize:
        raise ValueError(f"tensor {name!r}: data [{begin}, {end}) does not hold shape {shape} of {info['dtype']} "
                         f"within the file's {room} data bytes")
    raw = data[base + begin: base + end]
    if (base + begin) % dtype.itemsize:
        raw = raw.clone()  # a header that leaves the data unaligned for the dtype (old writers)
    return raw.view(dtype).view(shape)
