"""The serving runtime. Under TRITON_INTERPRET=1 (Triton kernels on the CPU), Triton's interpreter
is first made to patch `triton.language` once per launch (layers/triton_ops/interpreter.py)."""

import os as _os

if _os.environ.get("TRITON_INTERPRET", "0") == "1":
    from sglang.srt.layers.triton_ops.interpreter import install as _install_interpreter_patch

    _install_interpreter_patch()
