"""The kernel benchmarks' CPU dry runs (tiny shapes, Triton interpreter): they run end to end and
their candidates agree with the reference they are timed against, so a device call never finds
them broken. The dry runs run two at a time in the background (`dry_runs`); each test checks its own."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
REFERENCE_SCRIPTS = [("benchmark/bench_gemv.py", 10), ("benchmark/lora/bench_norm_shrink.py", 2),
                     ("benchmark/bench_decode_chain.py", 6), ("benchmark/bench_sampler.py", 10),
                     ("benchmark/lora/bench_gemm_shrink.py", 6)]


# bench_gemv also checks the engine's one-row folded GEMVs against cuBLAS's folded GEMM.
EXTRA_ARGS = {"benchmark/bench_gemv.py": ["--fold-slots", "2"]}


def _commands(tmp: str) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Each test's dry run: name -> (argv after the interpreter, extra environment), its files in `tmp`."""
    interpret = {"TRITON_INTERPRET": "1"}
    cmds = {script: ([script, "--cpu-dry-run", *EXTRA_ARGS.get(script, []), "--out", f"{tmp}/{i}.md"], interpret)
            for i, (script, _) in enumerate(REFERENCE_SCRIPTS)}
    cmds["expand_tiles"] = (["benchmark/lora/bench_expand_tiles.py", "--cpu-dry-run", "--out", f"{tmp}/tiles.md"],
                            interpret)
    cmds["forward_rounds"] = ([
        "benchmark/profile_forward.py", "--device", "cpu", "--model", "tiny", "--tokens", "8", "--repeats", "1",
        "--warmup", "0", "--adapters", "2", "--lora", "none,lora-unfused,lora", "--no-hf-anchor", "--decode-bs",
        "2", "--decode-adapters", "2", "--tc-modes", "", "--rounds", "2", "--out", f"{tmp}/steps.md"], interpret)
    cmds["host"] = ([
        "benchmark/profile_host.py", "--device", "cpu", "--model", "tiny", "--bs", "2", "--adapters", "2",
        "--repeats", "2", "--top", "3", "--root", f"{tmp}/assets-host", "--out", f"{tmp}/host.md"], interpret)
    cmds["scheduler"] = ([
        "benchmark/profile_scheduler.py", "--device", "cpu", "--model", "tiny", "--bs", "2", "4", "--steps", "5",
        "--overlap", "--root", f"{tmp}/assets-scheduler", "--out", f"{tmp}/scheduler.md"], {})
    cmds["forward_anchor"] = ([
        "benchmark/profile_forward.py", "--device", "cpu", "--model", "tiny", "--tokens", "8", "--repeats", "1",
        "--warmup", "0", "--profile-repeats", "1", "--decode-bs", "2", "--tc-modes", "", "--hf-anchor",
        "--hf-compile-backend", "eager", "--hf-tokens", "8", "--root", f"{tmp}/assets-anchor",
        "--out", f"{tmp}/anchor.md"], interpret)
    cmds["adapter_reads"] = (["benchmark/lora/bench_adapter_reads.py", "--cpu-dry-run", "--root",
                              f"{tmp}/assets-reads", "--out", f"{tmp}/reads.md"], {})
    return cmds


# The test that reads each dry run (its original name), for leaving out the deselected ones.
_TESTS = {"expand_tiles": "test_expand_tiles_dry_run_checks_every_plan_against_the_default",
          "forward_rounds": "test_profile_forward_rounds_alternate_the_variants",
          "host": "test_profile_host_dry_run_reports_every_case",
          "scheduler": "test_profile_scheduler_dry_run_times_the_turn_outside_the_forward",
          "forward_anchor": "test_profile_forward_measures_every_wall_before_the_profiler",
          "adapter_reads": "test_adapter_reads_dry_run_times_every_way"}


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory, request):
    """name -> Future of (CompletedProcess, the `--out` file) for the session's selected dry runs,
    two at a time in the background from the first test that needs one: each is a single-threaded
    process (imports, the Triton interpreter), so on the 2-core CPU machine two side by side take
    about 60 % of the time of one after the other. Each test waits for its own and checks it."""
    tmp = str(tmp_path_factory.mktemp("dry-runs"))
    wanted = {item.originalname if getattr(item, "callspec", None) is None or "script" not in item.callspec.params
              else item.callspec.params["script"]
              for item in request.session.items if item.module is request.module}
    cmds = {name: cmd for name, cmd in _commands(tmp).items() if name in wanted or _TESTS.get(name) in wanted}
    pool = ThreadPoolExecutor(2)

    def run(argv: list[str], extra_env: dict[str, str]):
        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"), **extra_env)
        proc = subprocess.run([sys.executable, os.path.join(ROOT, argv[0]), *argv[1:]], env=env,
                              capture_output=True, text=True, timeout=600)
        return proc, Path(argv[argv.index("--out") + 1])

    futures = {name: pool.submit(run, *cmds[name]) for name in sorted(cmds, key=_LONGEST_FIRST.index)}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


# The dry runs, longest first (about 16 s down to 2.5 s one at a time on the CPU machine).
_LONGEST_FIRST = ["forward_anchor", "host", "forward_rounds", "benchmark/bench_sampler.py", "scheduler",
                  "benchmark/bench_decode_chain.py", "adapter_reads",
                  "benchmark/lora/bench_norm_shrink.py", "expand_tiles", "benchmark/bench_gemv.py",
                  "benchmark/lora/bench_gemm_shrink.py"]


def finished(dry_runs, name: str):
    """The dry run's CompletedProcess and output file, once it exited with status 0."""
    proc, out = dry_runs[name].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, out


def table_rows(out) -> list[list[str]]:
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines() if re.match(r"^\| (tiny|\d)", line)]
    assert rows, out.read_text()
    return rows


@pytest.mark.parametrize("script,min_rows", REFERENCE_SCRIPTS)
def test_dry_run_agrees_with_its_reference(script, min_rows, dry_runs):
    rows = table_rows(finished(dry_runs, script)[1])
    assert len(rows) >= min_rows
    assert all(float(r[-1]) < 1e-5 for r in rows), rows  # max relative difference, float32


def test_expand_tiles_dry_run_checks_every_plan_against_the_default(dry_runs):
    _, out = finished(dry_runs, "expand_tiles")
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| qkv_proj")]
    # The last row: the first's live segments in a smaller server's segment capacity.
    assert [r[1].strip() for r in rows] == ["decode 8 x 8", "prefill 2 x 20 x 2", "decode 8 x 2, 3-slot capacity"], rows
    assert all(r[-1].strip() == "True" for r in rows), rows  # every plan: the same bits


def test_profile_forward_rounds_alternate_the_variants(dry_runs):
    """--rounds 2: every variant is measured in both rounds (its row's wall the median of the two)
    and compared with the base; a CPU dry run, eager, no device kernels."""
    _, out = finished(dry_runs, "forward_rounds")
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


def test_profile_host_dry_run_reports_every_case(dry_runs):
    """profile_host's CPU dry run: host phases for the base and both LoRA cases, cProfile tables for
    the base and the changing batch."""
    _, out = finished(dry_runs, "host")
    text = out.read_text()
    lora = dict(re.findall(r"^- bs 2, (.+?): prepare \d+ \(LoRA (\d+)\)", text, re.M))
    assert sorted(lora) == ["LoRA, changing batch", "LoRA, same batch", "base"], lora
    assert lora["base"] == "0" and int(lora["LoRA, changing batch"]) > 0
    assert text.count("ncalls") == 2 and "#### bs 2, LoRA, changing batch" in text


def test_profile_scheduler_dry_run_times_the_turn_outside_the_forward(dry_runs):
    """profile_scheduler on the CPU: a row per batch size with every phase measured, the forward
    inside the turn and the scheduler's share positive (all the requests reached decode, or it
    fails)."""
    _, out = finished(dry_runs, "scheduler")
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


def test_profile_forward_measures_every_wall_before_the_profiler(dry_runs):
    """A profiler session slows its process down after it ends, so each process measures every wall
    before its first profile: the HF anchor in a child process of its own, first (its compiled
    models never share the engine's process), then the engine's variants; the anchor's rows and
    ratios are reported (a CPU dry run, the anchor compiled with the eager backend)."""
    proc, out = finished(dry_runs, "forward_anchor")
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


def test_profile_forward_caps_the_decode_adapters_at_the_batch():
    """A batch of one request takes one adapter when 8 are asked for (not no LoRA row at all), and
    never more than the adapters loaded; each count once."""
    sys.path.insert(0, os.path.join(ROOT, "benchmark"))
    from profile_forward import decode_adapter_counts

    assert decode_adapter_counts([8], 1, 8) == [1]
    assert decode_adapter_counts([8], 64, 8) == [8]
    assert decode_adapter_counts([1, 8, 32], 64, 8) == [1, 8]
    assert decode_adapter_counts([4, 8], 2, 8) == [2]


def test_adapter_reads_dry_run_times_every_way(dry_runs):
    """bench_adapter_reads' CPU dry run: every read way at 1 and 2 threads, with positive times."""
    _, out = finished(dry_runs, "adapter_reads")
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.read_text().splitlines()
            if re.match(r"^\| (file bytes|library|load) ", line)]
    assert sorted((r[0], r[1]) for r in rows) == sorted((w, t) for w in ("file bytes", "library", "load")
                                                        for t in ("1", "2")), rows
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows), rows
