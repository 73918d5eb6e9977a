"""The fused layer kernels compile for sm_90 (CPU only: Triton's compiler and its bundled ptxas)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _has_nvidia_backend() -> bool:
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return False
    return os.path.exists(os.path.join(os.path.dirname(spec.origin), "backends", "nvidia", "bin", "ptxas"))


@pytest.mark.skipif(not _has_nvidia_backend(), reason="Triton's NVIDIA backend (ptxas) is not installed")
def test_fused_kernels_compile_for_sm90() -> None:
    # This checkout's package, not an installed one.
    python_dir = os.path.join(HERE, "..", "..", "..", "python")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join([python_dir, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "fused_kernels_sm90.py")],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ok ") == 15  # 4 rmsnorm, 2 x (silu, decode merge), 5 rope, 2 top-k/top-p
