"""How a model splits over N tensor-parallel ranks, and why it cannot (checked before any process
starts, from config.json alone).

Query heads split evenly; KV heads split evenly, or, when there are fewer KV heads than ranks, each
KV head is replicated on N / num_kv_heads ranks (so N must be a multiple of it); the MLP's
intermediate size splits evenly; the vocabulary is padded up to a multiple of N (the padding rows
are zero and sliced off the logits), so it never prevents a split.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.utils import cdiv


@dataclass(frozen=True)
class TPSplit:
    """One rank's share of a model (the same on every rank)."""

    tp_size: int
    num_heads: int
    num_kv_heads: int
    num_kv_head_replicas: int  # ranks holding each KV head (1 unless num_kv_heads < tp_size)
    intermediate_size: int
    vocab_size_padded: int
    vocab_per_rank: int


def split_problems(config: ModelConfig, tp_size: int) -> list[str]:
    heads, kv, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    problems = []
    if heads % tp_size:
        problems.append(f"num_attention_heads ({heads}) is not divisible by {tp_size}")
    if kv >= tp_size and kv % tp_size:
        problems.append(f"num_key_value_heads ({kv}) is not divisible by {tp_size}")
    if kv < tp_size and tp_size % kv:
        problems.append(
            f"{tp_size} is not a multiple of num_key_value_heads ({kv}) (a KV head is replicated on "
            f"tp_size / num_key_value_heads ranks when there are fewer KV heads than ranks)"
        )
    if inter % tp_size:
        problems.append(f"intermediate_size ({inter}) is not divisible by {tp_size}")
    return problems


def tp_split(config: ModelConfig, tp_size: int) -> TPSplit:
    """This model's per-rank sizes; ValueError saying every reason it cannot be split N ways."""
    if tp_size < 1:
        raise ValueError(f"--tp-size must be >= 1, got {tp_size}")
    problems = split_problems(config, tp_size)
    if problems:
        valid = [n for n in range(1, config.num_attention_heads + 1) if not split_problems(config, n)]
        raise ValueError(
            f"{config.architecture} cannot be split across --tp-size {tp_size} tensor-parallel ranks: "
            f"{'; '.join(problems)}. Sizes that work for this model: {', '.join(map(str, valid[:12]))}."
        )
    kv = config.num_key_value_heads
    padded = cdiv(config.vocab_size, tp_size) * tp_size
    return TPSplit(
        tp_size=tp_size,
        num_heads=config.num_attention_heads // tp_size,
        num_kv_heads=max(1, kv // tp_size),
        num_kv_head_replicas=max(1, tp_size // kv),
        intermediate_size=config.intermediate_size // tp_size,
        vocab_size_padded=padded,
        vocab_per_rank=padded // tp_size,
    )
