"""Triton kernels for LoRA: segmented shrink/expand (`triton`) and chunked SGMV (`csgmv`)."""

from sglang.srt.lora.triton_ops.chunked_sgmv_expand import chunked_sgmv_lora_expand_forward
from sglang.srt.lora.triton_ops.chunked_sgmv_shrink import chunked_sgmv_lora_shrink_forward
from sglang.srt.lora.triton_ops.gate_up_lora_b import gate_up_lora_b_fwd
from sglang.srt.lora.triton_ops.qkv_lora_b import qkv_lora_b_fwd
from sglang.srt.lora.triton_ops.sgemm_lora_a import sgemm_lora_a_fwd
from sglang.srt.lora.triton_ops.sgemm_lora_b import sgemm_lora_b_fwd

__all__ = [
    "chunked_sgmv_lora_expand_forward",
    "chunked_sgmv_lora_shrink_forward",
    "gate_up_lora_b_fwd",
    "qkv_lora_b_fwd",
    "sgemm_lora_a_fwd",
    "sgemm_lora_b_fwd",
]
