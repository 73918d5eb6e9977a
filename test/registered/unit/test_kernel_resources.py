"""benchmark/kernel_resources.py: programs an SM from a kernel's resources (pure arithmetic), and
the script's table at sm_90 for the decode LoRA kernels (compiled without a GPU, in a subprocess
without TRITON_INTERPRET)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "benchmark"))

from kernel_resources import Usage  # noqa: E402


def test_programs_an_sm_follow_the_scarcest_resource():
    assert Usage(64, 0, 1024).programs_per_sm(8) == 4  # 64K registers / (64 x 256 threads)
    assert Usage(40, 0, 1024).programs_per_sm(8) == 6  # 40 x 32 = 1,280 a warp, a multiple of 256
    assert Usage(39, 0, 1024).programs_per_sm(8) == 6  # rounded up to 40 a thread
    assert Usage(162, 0, 1024).programs_per_sm(4) == 3
    assert Usage(16, 0, 1024).programs_per_sm(8) == 8  # warps: 64 an SM
    assert Usage(16, 0, 1024).programs_per_sm(1) == 32  # programs: 32 an SM
    assert Usage(32, 0, 100 * 1024).programs_per_sm(4) == 2  # shared memory: 228 KB an SM


def test_the_table_shows_qkv_proj_in_two_waves_at_64_rows():
    """The tile held from before the norm takes 64 registers a thread at Qwen3-4B's qkv_proj: four
    programs an SM, so 64 rows x 12 column tiles run in two waves; gate_up_proj's 8 tiles a row in one."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmark", "kernel_resources.py"), "--models",
                           "qwen3-4b", "--rows", "64"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {}
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 8 and cells[1].startswith("norm_shrink_pack"):
            rows[cells[1]] = cells
    assert len(rows) == 4, proc.stdout
    qkv, gate_up = rows["norm_shrink_pack qkv_proj folded"], rows["norm_shrink_pack gate_up_proj folded"]
    assert qkv[6] == "4" and qkv[7] == "768 (2)", qkv
    assert gate_up[7] == "512 (1)", gate_up
    assert all(r[3] == "0" for r in rows.values()), rows  # no spills
