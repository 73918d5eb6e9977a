"""Qwen3 (dense): the Llama decoder with an explicit head_dim and a per-head RMSNorm on q and k
before RoPE; projection biases follow `attention_bias` (off in released checkpoints)."""

from __future__ import annotations

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.models.llama import AttentionLayout, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_layout(config: ModelConfig) -> AttentionLayout:
        return AttentionLayout(qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=True)


EntryClass = [Qwen3ForCausalLM]
