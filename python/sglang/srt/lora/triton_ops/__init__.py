"""Triton kernels for LoRA: token-major (shrink_pack, token shrink/expand) and chunked SGMV (`csgmv`'s
unfolded modules)."""

from sglang.srt.lora.triton_ops.chunked_sgmv_expand import chunked_sgmv_lora_expand_forward
from sglang.srt.lora.triton_ops.chunked_sgmv_shrink import chunked_sgmv_lora_shrink_forward

__all__ = ["chunked_sgmv_lora_expand_forward", "chunked_sgmv_lora_shrink_forward"]
