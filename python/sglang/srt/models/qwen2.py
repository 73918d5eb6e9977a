"""Qwen2 / Qwen2.5: the Llama decoder with a bias on the q, k, v projections (not on o_proj)."""

from __future__ import annotations

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.models.llama import AttentionLayout, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_layout(config: ModelConfig) -> AttentionLayout:
        return AttentionLayout(qkv_bias=True, o_bias=False)


EntryClass = [Qwen2ForCausalLM]
