"""The checkpoint helper: real transformers files, a working tokenizer, informative weights,
reproducible bytes, config-only real-shape presets, sharding."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import ARCHS, tiny_checkpoint

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.tools.make_checkpoint import PRESETS, make_checkpoint, measure_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _files(path: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = f.read()
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_checkpoint_is_a_real_hf_checkpoint(arch: str) -> None:
    from transformers import AutoConfig, AutoTokenizer

    path = tiny_checkpoint(arch)
    assert os.path.isfile(os.path.join(path, "model.safetensors"))
    config = AutoConfig.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert config.architectures == [ModelConfig.from_pretrained(path).architecture]
    assert config.num_hidden_layers == 2 and config.num_key_value_heads == 2
    # The vocab covers the tokenizer and is at most one 64-row block larger.
    assert len(tok) <= config.vocab_size < len(tok) + 64
    text = "The weather today is sunny."
    assert tok.decode(tok(text).input_ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi there"}], add_generation_prompt=True,
                                   tokenize=False)
    assert chat == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token_id is not None
    eos = ModelConfig.from_pretrained(path).eos_token_ids
    assert eos == [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_weights_give_peaked_next_token_distributions(arch: str) -> None:
    stats = measure_checkpoint(tiny_checkpoint(arch))
    assert stats["mean_top1_prob"] > 0.5, stats
    assert 2.0 < stats["logit_std"] < 20.0, stats


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path) -> None:
    a = make_checkpoint(str(tmp_path / "a"), arch="llama", seed=5, num_hidden_layers=1)
    b = make_checkpoint(str(tmp_path / "b"), arch="llama", seed=5, num_hidden_layers=1)
    c = make_checkpoint(str(tmp_path / "c"), arch="llama", seed=6, num_hidden_layers=1)
    fa, fb, fc = _files(a), _files(b), _files(c)
    assert fa == fb
    assert fa["model.safetensors"] != fc["model.safetensors"]
    assert fa["tokenizer.json"] == fc["tokenizer.json"]


def test_bfloat16_and_sharded_output(tmp_path) -> None:
    from safetensors import safe_open

    path = make_checkpoint(str(tmp_path / "bf16"), arch="qwen3", dtype="bfloat16", shards=2)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    assert len(shards) >= 2
    with safe_open(os.path.join(path, shards[0]), "pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == torch.bfloat16


@pytest.mark.parametrize("preset", [p for p in PRESETS if PRESETS[p]["config_only"]])
def test_real_shape_presets_are_config_only(tmp_path, preset: str) -> None:
    path = make_checkpoint(str(tmp_path / preset), preset=preset)
    assert not [f for f in os.listdir(path) if f.endswith(".safetensors")]
    cfg = ModelConfig.from_pretrained(path)
    shape = PRESETS[preset]["shape"]
    assert cfg.hidden_size == shape["hidden_size"] and cfg.vocab_size == shape["vocab_size"]
    assert cfg.num_key_value_heads == shape["num_key_value_heads"]
    assert cfg.context_len == shape["max_position_embeddings"]
    if preset == "qwen3-4b":
        assert cfg.head_dim == 128 and cfg.tie_word_embeddings
    if preset == "llama-3.1-8b":
        assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_theta == 500000.0
    if preset == "qwen2.5-0.5b":
        assert cfg.architecture == "Qwen2ForCausalLM" and cfg.head_dim == 64


def test_cli_prints_one_json_line(tmp_path) -> None:
    out = tmp_path / "cli"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    proc = subprocess.run(
        [sys.executable, "-m", "sglang.srt.tools.make_checkpoint", "--arch", "mistral", "--preset", "tiny",
         "--out", str(out), "--seed", "1"],
        capture_output=True, text=True, env=env, check=True,
    )
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["arch"] == "mistral" and report["mean_top1_prob"] > 0.5
    assert (out / "model.safetensors").is_file()
    with pytest.raises(ValueError, match="unknown preset"):
        make_checkpoint(str(tmp_path / "x"), preset="gpt-5")
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        make_checkpoint(str(tmp_path / "y"), vocab_size=100)
