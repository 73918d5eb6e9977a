"""The kernel benchmarks' CPU dry runs (tiny shapes, Triton interpreter): they run end to end and
their candidates agree with the reference they are timed against, so a device call never finds
them broken."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def dry_run(script: str, tmp_path) -> list[list[str]]:
    out = tmp_path / "table.md"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"), TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, script), "--cpu-dry-run", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines() if re.match(r"^\| (tiny|\d)", line)]
    assert rows, out.read_text()
    return rows


@pytest.mark.parametrize("script,min_rows", [("benchmark/bench_gemv.py", 10), ("benchmark/lora/bench_norm_shrink.py", 2)])
def test_dry_run_agrees_with_its_reference(script, min_rows, tmp_path):
    rows = dry_run(script, tmp_path)
    assert len(rows) >= min_rows
    assert all(float(r[-1]) < 1e-5 for r in rows), rows  # max relative difference, float32
