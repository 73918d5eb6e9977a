"""ModelConfig: what the engine needs from a checkpoint's `config.json`, resolved once.

The raw JSON is read directly (no `AutoConfig`), so that a config written by transformers 4.x
(`rope_theta` / `rope_scaling` / `torch_dtype`) and one written by 5.x (`rope_parameters` / `dtype`)
resolve to the same fields, and an unknown `model_type` fails with our message, not a hub lookup.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)

_DTYPE_NAMES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _read_json(path: str) -> Optional[dict]:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None


def parse_rope(cfg: dict) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling) from either the 4.x keys or the 5.x `rope_parameters`.

    `rope_scaling` is None for plain RoPE, else a dict whose `rope_type` is one of
    SUPPORTED_ROPE_TYPES (the old key `type` is accepted too).
    """
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" not in params and "rope_type" not in params:
        # Per-layer-type parameters ({"full_attention": {...}}): this engine has one attention type.
        params = params.get("full_attention") or next(iter(params.values()), None)
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling: Optional[dict] = {k: v for k, v in params.items() if k != "rope_theta"}
        if scaling.get("rope_type", scaling.get("type", "default")) == "default" and cfg.get("rope_scaling"):
            # The 4.x key beside a plain 5.x one: a scaling added by hand (the model card's way to
            # turn YaRN on, or --json-model-override-args) to a config that transformers 5 wrote.
            scaling = dict(cfg["rope_scaling"])
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling")
        scaling = dict(scaling) if scaling else None
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope scaling type {rope_type!r}; supported: {list(SUPPORTED_ROPE_TYPES)}"
            )
        if rope_type == "default":
            scaling = None
        else:
            scaling["rope_type"] = rope_type
            scaling.pop("type", None)
    return theta, scaling


def _complete_yarn(scaling: dict, cfg: dict, max_pos: int) -> tuple[dict, int]:
    """YaRN's parameters with transformers' defaults filled in, and the context they extend to.

    `original_max_position_embeddings` (the pre-training context) defaults to the config's
    top-level key of that name, else to max_position_embeddings; a missing `factor` is the ratio of
    the two. The context is original x factor when that is longer than max_position_embeddings:
    Qwen3's model card adds {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings":
    32768} for 131,072 tokens while max_position_embeddings stays 40,960 (vLLM reads it the same way).
    """
    scaling = dict(scaling)
    original = scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    original = int(original or max_pos)
    if original <= 0:
        raise ValueError(f"rope scaling: original_max_position_embeddings must be positive, got {original}")
    factor = scaling.get("factor")
    factor = float(max_pos / original if factor is None else factor)
    if factor < 1.0:
        raise ValueError(f"rope scaling: yarn's factor must be at least 1, got {factor}")
    scaling.update(factor=factor, original_max_position_embeddings=original)
    return scaling, max(max_pos, int(original * factor))


def resolve_dtype(requested: str, config_dtype: Optional[str], device: str) -> torch.dtype:
    """`--dtype auto`: float32 on CPU; on CUDA bfloat16 unless the checkpoint says float16."""
    if requested != "auto":
        if requested not in _DTYPE_NAMES:
            raise ValueError(f"--dtype must be auto, bfloat16, float16 or float32, got {requested!r}")
        return _DTYPE_NAMES[requested]
    if device != "cuda":
        return torch.float32
    if config_dtype in ("float16", "half"):
        return torch.float16
    return torch.bfloat16


@dataclass
class ModelConfig:
    model_path: str
    architectures: list[str]
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_act: str
    eos_token_ids: list[int]
    bos_token_id: Optional[int]
    pad_token_id: Optional[int]
    hf_dtype: Optional[str]  # the dtype the checkpoint declares
    context_len: int  # longest sequence the engine accepts
    dtype: torch.dtype  # the dtype the engine runs in
    sliding_window: Optional[int] = None
    hf_config: dict = field(default_factory=dict, repr=False)

    @property
    def architecture(self) -> str:
        return self.architectures[0]

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_pretrained(
        cls,
        model_path: str,
        *,
        context_length: Optional[int] = None,
        dtype: str = "auto",
        device: str = "cpu",
        overrides: Optional[dict] = None,
    ) -> "ModelConfig":
        """Read `model_path/config.json` (and `generation_config.json` for extra EOS ids);
        `context_length`, `dtype` and `device` are `--context-length`, `--dtype` and the device;
        `overrides` (--json-model-override-args) replace config.json's top-level keys."""
        if not os.path.isdir(model_path):
            raise ValueError(f"model path {model_path!r} is not a directory")
        cfg = _read_json(os.path.join(model_path, "config.json"))
        if cfg is None:
            raise ValueError(f"no config.json in {model_path!r} (--model-path): not a Hugging Face checkpoint")
        if overrides:
            cfg = {**cfg, **overrides}
            logger.info("config.json with --json-model-override-args: %s", json.dumps(overrides))
        return cls.from_dict(
            cfg,
            model_path=model_path,
            context_length=context_length,
            dtype=dtype,
            device=device,
            generation_config=_read_json(os.path.join(model_path, "generation_config.json")),
        )

    @classmethod
    def from_dict(
        cls,
        cfg: dict,
        *,
        model_path: str = "",
        context_length: Optional[int] = None,
        dtype: str = "auto",
        device: str = "cpu",
        generation_config: Optional[dict] = None,
    ) -> "ModelConfig":
        def need(key: str) -> Any:
            if key not in cfg:
                raise ValueError(f"config.json of {model_path!r} lacks {key!r}")
            return cfg[key]

        architectures = list(cfg.get("architectures") or [])
        if not architectures:
            raise ValueError(f"config.json of {model_path!r} has no 'architectures' entry")
        hidden_size = int(need("hidden_size"))
        num_heads = int(need("num_attention_heads"))
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        head_dim = cfg.get("head_dim") or hidden_size // num_heads
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
            )
        hidden_act = cfg.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; only 'silu' is supported")
        rope_theta, rope_scaling = parse_rope(cfg)
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        rope_context = max_pos  # the longest context the positions are meant for
        if rope_scaling is not None and rope_scaling["rope_type"] == "yarn":
            rope_scaling, rope_context = _complete_yarn(rope_scaling, cfg, max_pos)

        eos = _as_id_list(cfg.get("eos_token_id"))
        if generation_config:
            # Chat checkpoints often list their end-of-turn ids only in generation_config.json.
            eos += [i for i in _as_id_list(generation_config.get("eos_token_id")) if i not in eos]

        # Sliding-window attention is not implemented; capping the context at the window keeps
        # every sequence we accept exact (Mistral v0.1). Qwen2/3 carry the key but switch it off.
        window = cfg.get("sliding_window")
        if cfg.get("use_sliding_window") is False:
            window = None
        context_len = rope_context
        if window:
            context_len = min(context_len, int(window))
        if context_length is not None:
            if window and context_length > int(window):
                raise ValueError(
                    f"--context-length {context_length} exceeds the model's sliding window ({window}); "
                    "sliding-window attention is not supported"
                )
            if context_length > rope_context:
                # As upstream SGLang: a context past what the model was trained for is refused
                # unless asked for (it also sizes the rotary tables and the request rows).
                limit = f"max_position_embeddings ({max_pos})" if rope_context == max_pos else (
                    f"YaRN context ({rope_context} = original_max_position_embeddings x factor)")
                if os.environ.get("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN") != "1":
                    raise ValueError(
                        f"--context-length {context_length} exceeds the model's {limit}; "
                        "set SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 to allow it"
                    )
                logger.warning("--context-length %d exceeds the model's %s; quality may degrade.",
                               context_length, limit)
            context_len = int(context_length)
        elif window and window < max_pos:
            logger.warning(
                "Sliding-window attention is not supported; capping the context length at the window "
                "(%d tokens).",
                window,
            )

        hf_dtype = cfg.get("dtype", cfg.get("torch_dtype"))
        return cls(
            model_path=model_path,
            architectures=architectures,
            model_type=str(cfg.get("model_type", "")),
            hidden_size=hidden_size,
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=int(head_dim),
            intermediate_size=int(need("intermediate_size")),
            vocab_size=int(need("vocab_size")),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            hidden_act=hidden_act,
            eos_token_ids=eos,
            bos_token_id=cfg.get("bos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
            hf_dtype=str(hf_dtype) if hf_dtype is not None else None,
            context_len=context_len,
            dtype=resolve_dtype(dtype, hf_dtype, device),
            sliding_window=int(window) if window else None,
            hf_config=cfg,
        )
