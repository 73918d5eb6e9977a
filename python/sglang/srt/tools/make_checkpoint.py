"""Write Hugging Face checkpoints for tests, the demo and benchmarks, without any download.

    python -m sglang.srt.tools.make_checkpoint --arch qwen3 --preset tiny --out /tmp/tiny-qwen3
    python -m sglang.srt.tools.make_checkpoint --preset llama-3.1-8b --out /tmp/llama8b   # config only

Everything is written by transformers itself: the config class's `save_pretrained`, the model
class's `save_pretrained` (safetensors, optionally sharded), and a `PreTrainedTokenizerFast`
around a byte-level BPE trained here on a small embedded English text, with a ChatML template.

Random weights are drawn so the model is informative: linear layers keep unit gain, and the LM
head is scaled until the mean top-1 next-token probability reaches ~0.7. (With the usual 0.02
init every next-token distribution is nearly uniform, and logprob tolerances prove nothing.)
The same arguments and seed give byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import TYPE_CHECKING, Any, Optional

import torch

from sglang.srt.tools._corpus import CORPUS

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|begin_of_text|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
EOS, BOS, IM_START, IM_END, PAD = SPECIAL_TOKENS
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOKENIZER_VOCAB = 480  # BPE size; the tiny models' vocab is this rounded up to a multiple of 64
TARGET_TOP1_PROB = 0.7

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}

_TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
# Public shapes of released checkpoints (config only, for --load-format dummy).
# What the Llama-3.1 sizes share (KV heads, context, rope scaling, vocabulary).
_LLAMA_31 = dict(
    num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
    tie_word_embeddings=False, vocab_size=128256,
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),
)

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(arch="qwen3", config_only=False, shape=_TINY),
    "qwen2.5-0.5b": dict(
        arch="qwen2",
        config_only=True,
        shape=dict(
            hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
            num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
            rope_theta=1000000.0, tie_word_embeddings=True, vocab_size=151936,
        ),
    ),
    "qwen3-4b": dict(
        arch="qwen3",
        config_only=True,
        shape=dict(
            hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
            num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
            rope_theta=1000000.0, tie_word_embeddings=True, vocab_size=151936,
        ),
    ),
    "llama-3.1-8b": dict(
        arch="llama",
        config_only=True,
        shape=dict(_LLAMA_31, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
    ),
    # 141 GB in bf16: more than one H200 holds (tensor-parallel benchmarks, --tp-size 2).
    "llama-3.1-70b": dict(
        arch="llama",
        config_only=True,
        shape=dict(_LLAMA_31, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64),
    ),
}
# Qwen3's explicit head_dim differs from hidden/heads: keep the tiny model that way too.
_TINY_ARCH_SHAPE = {"qwen3": dict(hidden_size=64, head_dim=32)}


def build_tokenizer() -> "PreTrainedTokenizerFast":
    """A byte-level BPE trained on CORPUS (deterministic), wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _rope_kwargs(shape: dict) -> dict:
    """transformers 5 keeps RoPE settings in `rope_parameters`; 4.x in rope_theta/rope_scaling."""
    import transformers

    theta = shape.pop("rope_theta", 10000.0)
    scaling = shape.pop("rope_scaling", None)
    if int(transformers.__version__.split(".")[0]) >= 5:
        params = {"rope_theta": theta, "rope_type": "default"}
        if scaling:
            params.update(scaling)
        return {"rope_parameters": params}
    return {"rope_theta": theta, "rope_scaling": scaling}


def build_config(arch: str, preset: str, tokenizer: "PreTrainedTokenizerFast", dtype: str,
                 **overrides: Any) -> "PretrainedConfig":
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {sorted(ARCHS)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    shape = dict(PRESETS[preset]["shape"])
    if preset == "tiny":
        shape.update(_TINY_ARCH_SHAPE.get(arch, {}))
        shape.setdefault("vocab_size", 64 * math.ceil(len(tokenizer) / 64))
    shape.update(overrides)
    if shape["vocab_size"] < len(tokenizer):
        raise ValueError(f"vocab_size {shape['vocab_size']} is smaller than the tokenizer ({len(tokenizer)})")
    if arch == "mistral":
        shape.setdefault("sliding_window", None)  # full attention, like current Mistral checkpoints
    config_cls_name, architecture = ARCHS[arch]
    config = getattr(transformers, config_cls_name)(
        **_rope_kwargs(shape),
        **shape,
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS),
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD),
        architectures=[architecture],
    )
    config.dtype = dtype
    return config


@torch.no_grad()
def _init_informative_weights(model, seed: int) -> None:
    """Unit-gain random weights (N(0, 1/fan_in)), unit-scale embeddings, norm weights near 1,
    small biases; the LM head is then calibrated by `_calibrate_head`."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith(".bias"):
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))


def _probe_ids(vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, vocab, (2, 48), generator=gen)


@torch.no_grad()
def peakedness(model: "PreTrainedModel", input_ids: torch.Tensor) -> dict[str, float]:
    """How informative a model's next-token distributions are on `input_ids`."""
    logits = model(input_ids=input_ids).logits.float()
    probs = logits.softmax(-1)
    return {
        "logit_std": float(logits.std(-1).mean()),
        "mean_top1_prob": float(probs.max(-1).values.mean()),
    }


@torch.no_grad()
def _calibrate_head(model, probe: torch.Tensor) -> dict[str, float]:
    """Scale the LM head (the embedding when tied) so the mean top-1 probability on the probe
    is about TARGET_TOP1_PROB (bisection in log-scale; the top-1 mass grows with the scale)."""
    head = model.get_output_embeddings().weight
    base = head.detach().clone()
    lo, hi = math.log(0.05), math.log(50.0)
    for _ in range(24):
        mid = (lo + hi) / 2
        head.copy_(base * math.exp(mid))
        if peakedness(model, probe)["mean_top1_prob"] < TARGET_TOP1_PROB:
            lo = mid
        else:
            hi = mid
    head.copy_(base * math.exp(hi))
    return peakedness(model, probe)


def make_checkpoint(
    out_dir: str,
    arch: Optional[str] = None,
    preset: str = "tiny",
    seed: int = 0,
    with_weights: Optional[bool] = None,
    dtype: str = "float32",
    shards: int = 1,
    **overrides: Any,
) -> str:
    """Write a checkpoint folder and return its path.

    `arch` defaults to the preset's own; `with_weights` defaults to True for `tiny` and False for
    the real-shape presets (config and tokenizer only: serve them with `--load-format dummy`).
    `shards` > 1 writes a sharded checkpoint with `model.safetensors.index.json`. `overrides` are
    config fields (e.g. `num_hidden_layers=1`, `tie_word_embeddings=True`, `rope_scaling={...}`).
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    arch = arch or PRESETS[preset]["arch"]
    if with_weights is None:
        with_weights = not PRESETS[preset]["config_only"]

    os.makedirs(out_dir, exist_ok=True)
    tokenizer = build_tokenizer()
    config = build_config(arch, preset, tokenizer, dtype, **overrides)
    gen_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=[tokenizer.convert_tokens_to_ids(EOS), tokenizer.convert_tokens_to_ids(IM_END)],
        pad_token_id=config.pad_token_id,
    )
    tokenizer.save_pretrained(out_dir)
    if not with_weights:
        config.save_pretrained(out_dir)
        gen_config.save_pretrained(out_dir)
        return out_dir

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    _init_informative_weights(model, seed)
    _calibrate_head(model, _probe_ids(len(tokenizer), seed))
    model.generation_config = gen_config
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(out_dir)
    if shards > 1:
        _reshard(out_dir, shards)
    return out_dir


def _reshard(out_dir: str, shards: int) -> None:
    """Split the single `model.safetensors` transformers wrote into exactly `shards` files of
    about equal size, in its tensor order, with the `model.safetensors.index.json` loaders read.
    (transformers' own `max_shard_size` fills shards greedily, so it may write one file more than
    asked.)"""
    from safetensors.torch import load_file, save_file

    single = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(single)
    if shards > len(tensors):
        raise ValueError(f"shards={shards} exceeds the checkpoint's {len(tensors)} tensors")
    names = list(tensors)
    sizes = [tensors[n].numel() * tensors[n].element_size() for n in names]
    total = sum(sizes)
    # Cut where the running size passes k/shards of the total, keeping every shard non-empty.
    groups: list[list[str]] = [[] for _ in range(shards)]
    done = 0
    shard = 0
    for i, (name, size) in enumerate(zip(names, sizes)):
        left_after = len(names) - i - 1
        if groups[shard] and (done >= total * (shard + 1) / shards or left_after < shards - shard - 1):
            shard += 1
        groups[shard].append(name)
        done += size
    assert all(groups) and shard == shards - 1, (len(names), shards)
    weight_map: dict[str, str] = {}
    for k, group in enumerate(groups):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in group}, os.path.join(out_dir, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, file))
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
    os.remove(single)


def measure_checkpoint(path: str, seed: int = 0) -> dict[str, float]:
    """Load a written checkpoint with transformers (float32) and measure `peakedness` on the
    same probe the calibration used."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return peakedness(model, _probe_ids(len(AutoTokenizer.from_pretrained(path)), seed))


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sglang.srt.tools.make_checkpoint", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=sorted(ARCHS), default=None, help="Default: the preset's own.")
    parser.add_argument("--preset", choices=list(PRESETS), default="tiny")
    parser.add_argument("--out", required=True)
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--no-weights", dest="with_weights", action="store_false", default=None,
                         help="Config and tokenizer only (the default for real-shape presets).")
    weights.add_argument("--weights", dest="with_weights", action="store_true",
                         help="Also write random weights for a real-shape preset.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--shards", type=int, default=1, help="Write a sharded checkpoint of exactly N files.")
    args = parser.parse_args(argv)
    out = make_checkpoint(args.out, arch=args.arch, preset=args.preset, seed=args.seed,
                          with_weights=args.with_weights, dtype=args.dtype, shards=args.shards)
    report: dict[str, Any] = {"out": out, "arch": args.arch or PRESETS[args.preset]["arch"], "preset": args.preset}
    if os.path.exists(os.path.join(out, "model.safetensors")) or os.path.exists(
        os.path.join(out, "model.safetensors.index.json")
    ):
        report.update(measure_checkpoint(out, args.seed))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
