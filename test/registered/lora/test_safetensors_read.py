"""read_safetensors (lora/safetensors_read.py) against the safetensors library on real files: the
same tensors for every dtype and shape, a reused buffer, and a clear ValueError for every broken
file. And an adapter read through a buffer equals one read by the library."""

import json
import os
import struct

import pytest
import torch
from lora_testlib import tiny_hf_config, write_peft_adapter
from safetensors.torch import load_file, save_file

from sglang.srt.lora.lora import LoRAAdapter, LoRAModelShapes
from sglang.srt.lora.lora_config import LoRAConfig
from sglang.srt.lora.safetensors_read import ReadBuffer, read_safetensors


def _tensors(seed: int, scale: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "f32": torch.randn(3 * scale, 5, generator=g),
        "f16": torch.randn(4, 2 * scale, generator=g).half(),
        "bf16": torch.randn(7 * scale, generator=g).bfloat16(),
        "f64": torch.randn(2, 2, generator=g).double(),
        "i64": torch.arange(6 * scale).reshape(2, -1),
        "i32": torch.arange(5, dtype=torch.int32),
        "i16": torch.arange(3, dtype=torch.int16),
        "i8": torch.arange(-4, 4, dtype=torch.int8),
        "u8": torch.arange(9, dtype=torch.uint8).reshape(3, 3),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }


def _same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name


def test_reads_what_the_library_writes(tmp_path):
    path = str(tmp_path / "t.safetensors")
    save_file(_tensors(0), path, metadata={"format": "pt"})
    _same(read_safetensors(path), load_file(path))


def test_a_reused_buffer_keeps_earlier_views_when_it_grows(tmp_path):
    small, big = str(tmp_path / "small.safetensors"), str(tmp_path / "big.safetensors")
    save_file(_tensors(1), small)
    save_file(_tensors(2, scale=50), big)
    buf = ReadBuffer()
    first = read_safetensors(small, buf)
    ptr = first["f32"].untyped_storage().data_ptr()
    grown = read_safetensors(big, buf)  # needs more room: a new buffer, the first read's views stay
    _same(first, load_file(small))
    _same(grown, load_file(big))
    again = read_safetensors(small, buf)  # fits: the same (grown) buffer, no new pages
    assert again["f32"].untyped_storage().data_ptr() == grown["f32"].untyped_storage().data_ptr() != ptr
    _same(again, load_file(small))


def _write_raw(path: str, header: dict, data: bytes, pad_to: int = 1) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % pad_to)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


def test_unaligned_data_is_read(tmp_path):
    """A writer that leaves the data unaligned for its dtype (no header padding) still reads."""
    values = torch.arange(6, dtype=torch.float32)
    path = str(tmp_path / "odd.safetensors")
    header = {"x": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}
    for extra in range(4):  # one of these lengths leaves the data start unaligned
        header["__metadata__"] = {"pad": "p" * extra}
        _write_raw(path, header, values.numpy().tobytes())
        got = read_safetensors(path)["x"]
        assert torch.equal(got, values.reshape(2, 3))


@pytest.mark.parametrize("case,message", [
    ("truncated", "ended|does not hold"),
    ("short", "too short"),
    ("huge_header", "header of"),
    ("not_json", "not JSON"),
    ("not_object", "not a JSON object"),
    ("out_of_range", "does not hold"),
    ("wrong_size", "does not hold"),
    ("bad_dtype", "not supported"),
    ("no_offsets", "malformed"),
    ("negative_dim", "negative"),
])
def test_broken_files_are_refused(tmp_path, case, message):
    path = str(tmp_path / f"{case}.safetensors")
    data = torch.arange(4, dtype=torch.float32).numpy().tobytes()
    good = {"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    if case == "truncated":
        save_file({"x": torch.randn(64, 64)}, path)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    elif case == "short":
        with open(path, "wb") as f:
            f.write(b"\x01\x02")
    elif case == "huge_header":
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", 1 << 40) + b"{}")
    elif case == "not_json":
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", 5) + b"{nope")
    elif case == "not_object":
        _write_raw(path, [1, 2], data)  # type: ignore[arg-type]
    else:
        entry = dict(good["x"])
        if case == "out_of_range":
            entry["data_offsets"] = [8, 24]
        elif case == "wrong_size":
            entry["shape"] = [3]
        elif case == "bad_dtype":
            entry["dtype"] = "F8_E4M3"
        elif case == "no_offsets":
            del entry["data_offsets"]
        elif case == "negative_dim":
            entry["shape"] = [-4]
        _write_raw(path, {"x": entry}, data)
    with pytest.raises(ValueError, match=message):
        read_safetensors(path)


def test_an_adapter_read_through_a_buffer_equals_the_library_read(tmp_path):
    shapes = LoRAModelShapes.from_hf_config(tiny_hf_config())
    path = write_peft_adapter(str(tmp_path / "a"), r=8, target_modules="all-linear", seed=3)
    config = LoRAConfig.from_path(path, base_vocab_size=256)
    buf = ReadBuffer()
    for dtype in (None, torch.bfloat16):
        plain = LoRAAdapter.load("p", config, shapes, dtype, pin=False)
        buffered = LoRAAdapter.load("b", config, shapes, dtype, pin=False, buffer=buf)
        assert plain.modules == buffered.modules == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
        for layer, mods in enumerate(plain.layers):
            for module, (a, b) in mods.items():
                a2, b2 = buffered.layers[layer][module]
                assert torch.equal(a, a2) and torch.equal(b, b2), (layer, module)
                # The host copy owns its memory: not a view of the reused file buffer.
                assert a2.untyped_storage().data_ptr() != buf.take(1).untyped_storage().data_ptr()
