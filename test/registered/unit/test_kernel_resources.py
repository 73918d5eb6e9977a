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


def test_the_table_shows_the_row_loop_in_one_wave_where_the_tile_takes_two():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmark", "kernel_resources.py"), "--models",
                           "qwen3-4b", "--rows", "64"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {}
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 8 and cells[1].startswith("norm_shrink_pack"):
            rows[cells[1]] = cells
    assert len(rows) == 8, proc.stdout
    tile, loop = rows["norm_shrink_pack qkv_proj folded tile"], rows["norm_shrink_pack qkv_proj folded row loop"]
    assert int(loop[2]) < int(tile[2]) and int(loop[6]) > int(tile[6]), (tile, loop)
    assert tile[7] == "768 (2)" and loop[7] == "768 (1)", (tile, loop)  # 64 rows x 12 column tiles
    assert all(r[3] == "0" for r in rows.values()), rows  # no spills
