"""bench_lora_serving's CPU dry run: real servers (tiny checkpoint, CPU), real bench_serving loads.
Loads that share a server each start from an empty prefix cache, and base-again has a server of
its own, so no load's numbers come from an earlier load's cache (every load sends the same
prompts)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "benchmark", "lora"))

import bench_lora_serving as bench  # noqa: E402
from server_helpers import free_port  # noqa: E402


def test_base_again_gets_its_own_server_and_zipf_shares_csgmv_s():
    configs = [bench.CONFIGS[n] for n in ("base", "base-again", "csgmv", "csgmv-zipf")]
    groups = [[c.name for c in g] for g in bench.group_by_server(configs)]
    assert groups == [["base"], ["base-again"], ["csgmv", "csgmv-zipf"]]


def test_dry_run_loads_on_one_server_start_from_an_empty_cache(tmp_path):
    out = tmp_path / "table.md"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmark/lora/bench_lora_serving.py"), "--dry-run",
                           "--configs", "csgmv,csgmv-zipf", "--root", str(tmp_path / "root"),
                           "--port", str(free_port()), "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = out.read_text()
    rows = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| csgmv")]
    assert rows == ["csgmv", "csgmv-zipf"], table  # two loads on one server
    assert "failed" not in table and "from the prefix cache" not in table, table
    assert "after an unmeasured load of 4 prompts per server" in table, table
