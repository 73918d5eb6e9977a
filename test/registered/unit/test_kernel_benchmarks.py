"""The kernel benchmarks' CPU dry runs (tiny shapes, Triton interpreter): they run end to end and
their candidates agree with the reference they are timed against, so a device call never finds
them broken."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

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


@pytest.mark.parametrize("script,min_rows", [("benchmark/bench_gemv.py", 10), ("benchmark/lora/bench_norm_shrink.py", 2),
                                             ("benchmark/bench_decode_chain.py", 6), ("benchmark/bench_sampler.py", 10),
                                             ("benchmark/lora/bench_gemm_shrink.py", 6),
                                             ("benchmark/lora/probe_norm_segment_pack.py", 2)])
def test_dry_run_agrees_with_its_reference(script, min_rows, tmp_path):
    rows = dry_run(script, tmp_path)
    assert len(rows) >= min_rows
    assert all(float(r[-1]) < 1e-5 for r in rows), rows  # max relative difference, float32


def test_expand_tiles_dry_run_checks_every_plan_against_the_default(tmp_path):
    out = tmp_path / "table.md"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"), TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmark/lora/bench_expand_tiles.py"), "--cpu-dry-run",
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| qkv_proj")]
    assert [r[1].strip() for r in rows] == ["decode 8 x 8", "prefill 2 x 20 x 2"], rows
    assert all(r[-1].strip() == "True" for r in rows), rows  # every plan: the same bits


def test_profile_forward_rounds_alternate_the_variants(tmp_path):
    """--rounds 2: every variant is measured in both rounds (its row's wall the median of the two)
    and compared with the base; a CPU dry run, eager, no device kernels."""
    out = tmp_path / "steps.md"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"), TRITON_INTERPRET="1")
    cmd = [sys.executable, os.path.join(ROOT, "benchmark/profile_forward.py"), "--device", "cpu", "--model", "tiny",
           "--tokens", "8", "--repeats", "1", "--warmup", "0", "--adapters", "2", "--lora", "none,lora-unfused,lora",
           "--no-hf-anchor", "--decode-bs", "2", "--decode-adapters", "2", "--tc-modes", "", "--rounds", "2",
           "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| tiny |")]
    assert sorted({r[1].strip() for r in rows}) == ["lora", "lora-unfused", "none"]
    for r in rows:
        walls = [float(w) for w in re.search(r"rounds ([\d.]+) / ([\d.]+)", r[3]).groups()]
        assert abs(float(r[4]) - (walls[0] + walls[1]) / 2) < 2e-3  # the median of two rounds
    assert "prefill 8 eager (lora-unfused): LoRA / base" in text and "decode bs2 x2 eager: LoRA / base" in text
    # Host phases, first round: every case of every variant; only LoRA runners spend time in LoRA's prepare.
    host = dict(re.findall(r"^- tiny (\S+ \S+ \S+(?: x\d)?) eager: prepare \d+ \(LoRA (\d+)\)", text, re.M))
    assert len(host) == 6, host  # prefill 8 and decode bs2 (x2 with LoRA), three variants
    assert all((int(us) > 0) == (not key.startswith("none")) for key, us in host.items()), host


def test_profile_host_dry_run_reports_every_case(tmp_path):
    """profile_host's CPU dry run: host phases for the base and both LoRA cases, cProfile tables for
    the base and the changing batch."""
    out = tmp_path / "host.md"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"), TRITON_INTERPRET="1")
    cmd = [sys.executable, os.path.join(ROOT, "benchmark/profile_host.py"), "--device", "cpu", "--model", "tiny",
           "--bs", "2", "--adapters", "2", "--repeats", "2", "--top", "3", "--root", str(tmp_path / "assets"),
           "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    lora = dict(re.findall(r"^- bs 2, (.+?): prepare \d+ \(LoRA (\d+)\)", text, re.M))
    assert sorted(lora) == ["LoRA, changing batch", "LoRA, same batch", "base"], lora
    assert lora["base"] == "0" and int(lora["LoRA, changing batch"]) > 0
    assert text.count("ncalls") == 2 and "#### bs 2, LoRA, changing batch" in text


def test_profile_scheduler_dry_run_times_the_turn_outside_the_forward(tmp_path):
    """profile_scheduler on the CPU: a row per batch size with every phase measured, the forward
    inside the turn and the scheduler's share positive (all the requests reached decode, or it
    fails)."""
    out = tmp_path / "scheduler.md"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    cmd = [sys.executable, os.path.join(ROOT, "benchmark/profile_scheduler.py"), "--device", "cpu", "--model", "tiny",
           "--bs", "2", "4", "--steps", "5", "--overlap", "--root", str(tmp_path / "assets"), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    # --overlap: the turn with the overlap schedule beside each ordinary one.
    assert re.findall(r"^- overlap schedule, (\d+) requests: turn \d+ µs against \d+ ordinary", text, re.M) == ["2", "4"]
    rows = [ln.split("|")[1:-1] for ln in text.splitlines() if re.match(r"^\| \d+ \|", ln)]
    assert [int(r[0]) for r in rows] == [2, 4], rows
    for r in rows:
        turn, forward, rest = (float(c.strip("* ")) for c in r[1:4])
        assert 0 < forward < turn and rest > 0, r
        assert len(r) == 12 and all(float(c) >= 0 for c in r[4:]), r


def test_host_phases_times_each_phase_and_restores_the_methods():
    """host_phases wraps a runner's methods for the measurement only: nested phases are counted in
    their parents, and afterwards the instance has no attribute of its own left."""
    sys.path.insert(0, os.path.join(ROOT, "benchmark"))
    import host_phases

    class Backend:
        def init_forward_metadata_replay_cuda_graph(self):
            pass

    class Manager:
        def prepare_forward(self):
            time.sleep(0.002)

    class Runner:
        attn_backend, lora_manager = Backend(), Manager()

        def prepare(self):
            self.lora_manager.prepare_forward()

        def run_body(self):
            time.sleep(0.001)

        def _to_host(self):
            time.sleep(0.003)

        def run_eager_tail(self):
            self._to_host()

    runner = Runner()
    phases = host_phases.measure(runner, lambda: (runner.prepare(), runner.run_body(), runner.run_eager_tail()), 3)
    assert phases["prepare"] >= phases["prepare.lora"] >= 2000, phases
    assert phases["tail"] >= phases["tail.to_host"] >= 3000 and phases["body"] >= 1000, phases
    assert phases["wall"] >= phases["prepare"] + phases["body"] + phases["tail"], phases
    assert not {"prepare", "run_body", "run_eager_tail", "_to_host"} & set(vars(runner)), vars(runner)
    assert "prepare_forward" not in vars(runner.lora_manager)


def test_profile_forward_measures_every_wall_before_the_profiler(tmp_path):
    """A profiler session slows its process down after it ends, so each process measures every wall
    before its first profile: the HF anchor in a child process of its own, first (its compiled
    models never share the engine's process), then the engine's variants; the anchor's rows and
    ratios are reported (a CPU dry run, the anchor compiled with the eager backend)."""
    out = tmp_path / "anchor.md"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"), TRITON_INTERPRET="1")
    cmd = [sys.executable, os.path.join(ROOT, "benchmark/profile_forward.py"), "--device", "cpu", "--model", "tiny",
           "--tokens", "8", "--repeats", "1", "--warmup", "0", "--profile-repeats", "1", "--decode-bs", "2",
           "--tc-modes", "", "--hf-anchor", "--hf-compile-backend", "eager", "--hf-tokens", "8",
           "--root", str(tmp_path / "assets"), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()

    def where(pattern: str) -> list[int]:
        return [i for i, ln in enumerate(lines) if re.search(pattern, ln)]

    hf_walls, engine_walls = where(r"HF\+compile\S* +\d+: wall"), where(r"^ *(none|lora) .* wall +[\d.]+ ms")
    hf_profiling, engine_profiling = where("HF anchor: profiling every case"), where("tiny: profiling every case")
    assert len(hf_walls) == 2 and len(engine_walls) == 4, proc.stderr[-3000:]  # base and LoRA: 2 cases each
    assert len(hf_profiling) == 1 and len(engine_profiling) == 1, proc.stderr[-3000:]
    assert where("the HF anchor in a process of its own")[0] < min(hf_walls)
    assert max(hf_walls) < hf_profiling[0] < min(engine_walls) and max(engine_walls) < engine_profiling[0]
    text = out.read_text()
    assert "ours eager / HF+compile = " in text and "ours eager / HF+compile+PEFT = " in text
    assert text.count("| HF+compile") >= 2  # the anchor's rows, read back from the child


def test_profile_forward_idle_before_sums_gaps_by_the_waiting_event():
    """GPU idle is charged to the event that starts after it (overlapping events leave no gap),
    per forward; the first event's lead-in (the profiler's start) is not counted."""
    sys.path.insert(0, os.path.join(ROOT, "benchmark"))
    from profile_forward import _idle_before

    timeline = [(0.0, 10.0, "embed"), (12.0, 20.0, "gemm"), (15.0, 30.0, "norm"), (31.0, 32.0, "gemm"),
                (40.0, 41.0, "embed"), (45.0, 50.0, "gemm")]
    got = {name: (us, calls) for name, us, calls in _idle_before(timeline, 2)}
    assert got == {"embed": (4.0, 0.5), "gemm": (3.5, 1.5)}, got


def test_adapter_reads_dry_run_times_every_way(tmp_path):
    """bench_adapter_reads' CPU dry run: every read way at 1 and 2 threads, with positive times."""
    out = tmp_path / "reads.md"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmark/lora/bench_adapter_reads.py"), "--cpu-dry-run",
                           "--root", str(tmp_path / "assets"), "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.read_text().splitlines()
            if re.match(r"^\| (file bytes|library|load) ", line)]
    assert sorted((r[0], r[1]) for r in rows) == sorted((w, t) for w in ("file bytes", "library", "load")
                                                        for t in ("1", "2")), rows
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows), rows
