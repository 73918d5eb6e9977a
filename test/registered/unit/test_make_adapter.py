"""make_adapter: random PEFT adapters at a checkpoint's real shapes, that PEFT and the engine both
load, with non-zero B, reproducible bytes, and `NAME=PATH` lines ready for --lora-paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from helpers import hf_model, tiny_checkpoint

from sglang.srt.lora.lora import LoRAAdapter, LoRAModelShapes
from sglang.srt.lora.lora_config import LoRAConfig
from sglang.srt.tools.make_adapter import make_adapters
from sglang.srt.tools.make_checkpoint import make_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_cli_writes_adapters_peft_and_the_engine_load(tmp_path) -> None:
    ckpt = tiny_checkpoint("llama")
    out = subprocess.run(
        [sys.executable, "-m", "sglang.srt.tools.make_adapter", "--model-path", ckpt, "--out", str(tmp_path),
         "--num", "2", "--rank", "4", "--alpha", "8", "--target-modules", "q_proj", "v_proj", "down_proj"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "python")},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [f"lora{i}={tmp_path / f'lora{i}'}" for i in range(2)]
    with open(tmp_path / "lora0" / "adapter_config.json") as f:  # names its base, as PEFT does
        assert json.load(f)["base_model_name_or_path"] == os.path.abspath(ckpt)
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(hf_model(ckpt), str(tmp_path / "lora0"))
    lora_b = [p for n, p in peft_model.named_parameters() if "lora_B" in n]
    assert lora_b and all(float(p.abs().max()) > 0 for p in lora_b)
    cfg = LoRAConfig.from_path(str(tmp_path / "lora1"))
    assert cfg.r == 4 and cfg.scaling == 2.0
    adapter = LoRAAdapter.load("x", cfg, LoRAModelShapes.from_hf_config(hf_model(ckpt).config))
    assert adapter.modules == {"qkv_proj", "down_proj"}


def test_real_shape_from_a_config_only_checkpoint_is_reproducible(tmp_path) -> None:
    ckpt = make_checkpoint(str(tmp_path / "ckpt"), arch="qwen2", preset="qwen2.5-0.5b", with_weights=False)
    a = make_adapters(ckpt, str(tmp_path / "a"), num=1, rank=2, target_modules=["o_proj"], seed=5)
    b = make_adapters(ckpt, str(tmp_path / "b"), num=1, rank=2, target_modules=["o_proj"], seed=5)
    from safetensors.torch import load_file

    ta = load_file(os.path.join(a["lora0"], "adapter_model.safetensors"))
    tb = load_file(os.path.join(b["lora0"], "adapter_model.safetensors"))
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert len(ta) == 2 * 24  # A and B of o_proj in each of the 24 layers
    a_name = "base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight"
    assert tuple(ta[a_name].shape) == (2, 896)
