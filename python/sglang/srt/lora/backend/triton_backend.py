"""`triton` LoRA backend: the token-major backend (token_backend.py) with its own kernels throughout.

Folded modules run shrink_pack + one GEMM; unfolded modules (over fold.should_fold's bound, or
`--lora-fold off`) run the token-major shrink and expand, split-K and, on Hopper, the expand as a
programmatic dependent of the shrink. Best where batches are short (decode, small prefills): every
launch is prepared once per batch and no host-side sorting is needed. Compare `csgmv`.
"""

from __future__ import annotations

from sglang.srt.lora.backend.token_backend import TokenLoRABackend


class TritonLoRABackend(TokenLoRABackend):
    name = "triton"
