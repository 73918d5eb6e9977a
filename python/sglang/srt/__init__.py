"""The serving runtime. Under TRITON_INTERPRET=1 (Triton kernels on the CPU), Triton's interpreter
is first made to patch `triton.language` once per launch (layers/triton_ops/interpreter.py)."""

import os as _os

# The same test as layers/triton_ops/common.interpreting(), spelled out: common imports torch and
# triton, and `import sglang.srt` (tokenizer and HTTP processes too) must not pay for them.
if _os.environ.get("TRITON_INTERPRET", "0") == "1":
    from sglang.srt.layers.triton_ops.interpreter import install as _install_interpreter_patch

    _install_interpreter_patch()
