"""Fused Triton kernels of the model body (RMSNorm + residual, SiLU-and-mul, RoPE + q/k norm + KV
store). Each sits beside the torch reference in its layer module (`layernorm.py`, `activation.py`,
`rotary_embedding.py`), which stays the CPU path and the test oracle; `dispatch.py` picks one."""
