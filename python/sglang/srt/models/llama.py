"""Llama (and Mistral, whose dense checkpoints have the same layout): the shared decoder.

Qwen2 and Qwen3 reuse every block here; they differ only in `AttentionLayout` (which projections
carry a bias, and Qwen3's per-head q/k RMSNorm). The body, `model.model(...)`, is token-wise except
for the attention call and has no host syncs or value-dependent control flow, so graphs can
capture it; `forward` adds the eager head (LogitsProcessor).

A layer on the Triton path (CUDA) is a handful of kernels (DESIGN §9), the residual stream carried
as (hidden, residual):
    input_layernorm       residual += hidden; hidden = rmsnorm(residual)     one kernel
    qkv_proj              GEMM (+ LoRA)
    rotary_emb            (q/k norm,) RoPE in place, K/V into the pool       one kernel
    attn                  attention into a preallocated output (the graph break)
    o_proj                GEMM (+ LoRA)
    post_attention_layernorm                                                 one kernel
    gate_up_proj, act_fn, down_proj                                          GEMM, one kernel, GEMM
The linear modules are called as modules: the LoRA wrappers replace them after the model is built.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch import nn

from sglang.srt.configs.forward_batch_info import ForwardBatch
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed import SINGLE_RANK, TensorParallelGroup
from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from sglang.srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.rotary_embedding import RotaryEmbedding, get_rope
from sglang.srt.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from sglang.srt.model_loader.weight_utils import default_weight_loader

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionLayout:
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, tp_group: TensorParallelGroup,
                 bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias,
                                                       tp_group=tp_group)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, tp_group=tp_group)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_id: int, layout: AttentionLayout, rotary_emb: RotaryEmbedding,
        tp_group: TensorParallelGroup,
    ) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=layout.qkv_bias,
            tp_group=tp_group,
        )
        # This rank's heads (all of them at tp 1), as the built layer split them: the fused RoPE
        # kernel, attention and the KV pool see only the local heads.
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.qkv_proj.q_proj_shard_size
        self.kv_size = self.qkv_proj.kv_proj_shard_size
        # o_proj takes the full attention width; it keeps the input columns of this rank's heads.
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=layout.o_bias, tp_group=tp_group
        )
        self.qk_norm = layout.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.rotary_emb = rotary_emb  # one module shared by all layers: one cos/sin cache
        self.attn = RadixAttention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_id
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        # One kernel on the Triton path: (q/k norm,) RoPE in place, and the K/V store.
        q, k, v, kv_stored = self.rotary_emb(
            positions,
            qkv,
            self.num_heads,
            self.num_kv_heads,
            q_norm=self.q_norm if self.qk_norm else None,
            k_norm=self.k_norm if self.qk_norm else None,
            kv_store=self.attn.kv_store(forward_batch),
        )
        out = self.attn(q, k, v, forward_batch, save_kv_cache=not kv_stored)
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_id: int, layout: AttentionLayout, rotary_emb: RotaryEmbedding,
        tp_group: TensorParallelGroup,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.self_attn = LlamaAttention(config, layer_id, layout, rotary_emb, tp_group)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, tp_group, bias=config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        forward_batch: ForwardBatch,
        residual: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, forward_batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, layout: AttentionLayout, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_group=tp_group)
        rotary_emb = get_rope(
            config.head_dim,
            max(config.max_position_embeddings, config.context_len),
            config.rope_theta,
            config.rope_scaling,
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, layout, rotary_emb, tp_group) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """The body: token ids [T] -> final-normed hidden states [T, H]."""
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, forward_batch, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


# HF checkpoint name fragment -> (our fused parameter fragment, shard id).
STACKED_PARAMS = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)


class LlamaForCausalLM(nn.Module):
    # The layers shard over a TP group (DESIGN §11): attention by heads, the MLP by the
    # intermediate size, embedding and head by the vocabulary; loading reads only a rank's slices.
    supports_tensor_parallel = True

    @staticmethod
    def attention_layout(config: ModelConfig) -> AttentionLayout:
        return AttentionLayout(qkv_bias=config.attention_bias, o_bias=config.attention_bias)

    def __init__(self, config: ModelConfig, tp_group: TensorParallelGroup = SINGLE_RANK) -> None:
        """Every layer shards over `tp_group` (SINGLE_RANK: the whole model on one device)."""
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.attention_layout(config), tp_group)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_group=tp_group)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> LogitsProcessorOutput:
        hidden = self.model(input_ids, positions, forward_batch)
        return self.logits_processor(input_ids, hidden, self.lm_head, forward_batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into our (fused) parameters; returns the names of the parameters
        that received data. Unknown tensor names are reported once, not loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            if "rotary_emb." in name:  # precomputed RoPE buffers of old checkpoints
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding is the head (some checkpoints store both copies)
            target, shard = name, None
            for hf_part, fused_part, shard_id in STACKED_PARAMS:
                if hf_part in name:
                    target, shard = name.replace(hf_part, fused_part), shard_id
                    break
            param = params.get(target)
            if param is None:
                unexpected.append(name)
                continue
            try:
                getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard)
            except ValueError as e:
                raise ValueError(f"cannot load {name!r}: {e}") from None
            loaded.add(target)
        if unexpected:
            logger.warning(
                "Ignored %d checkpoint tensor(s) this model has no parameter for: %s",
                len(unexpected),
                ", ".join(unexpected[:8]) + (" ..." if len(unexpected) > 8 else ""),
            )
        return loaded


class MistralForCausalLM(LlamaForCausalLM):
    """Dense Mistral checkpoints are Llama-shaped (sliding windows: see ModelConfig)."""


EntryClass = [LlamaForCausalLM, MistralForCausalLM]
