"""The soak (soak_lib.py): mixed traffic against a real LoRA server under memory pressure, then
nothing may be lost. Ends by waiting for idle and asserting zero leaked KV slots, request rows,
adapter references and request states, both integrity checks clean, no dead process, no 5xx, and
writes a report (counts, retractions, graph replays, prefix cache) to JSON (`SGLANG_SOAK_REPORT` if
set). The prefix cache is on (the default): "no leak" means free + evictable == total with nothing
locked, and the soak must have hit and evicted cached prefixes.

  * `test_soak` (CPU CI): tiny llama, 3 adapters + 1 cycling, 2 LoRA adapter slots,
    a 384-token KV pool (so requests are retracted), 32-token prefill chunks; load for
    `SGLANG_SOAK_SECONDS` (default 30: ~700 requests, ~30 retractions, ~20 adapter loads and
    unloads, ~170 prefix-cache hits on the CI machine; the CPU suite stays near 15 minutes).
  * `test_soak_overlap_schedule` (CPU CI): the same through `--enable-overlap-schedule` for half
    of `SGLANG_SOAK_SECONDS`, 22.5 s by default (the wait bound below is a quarter of the run's
    requests: a shorter run leaves it less room).
  * `test_soak_long` (`-m slow`, runs only with SGLANG_SOAK_LONG=1): the same for
    `SGLANG_SOAK_SECONDS` (default 900).
  * `test_soak_gpu` (`-m gpu`, runs only with SGLANG_SOAK_GPU=1, i.e. `GPU_SUITE_PARTS=soak
    scripts/gpu_suite.sh`): the Qwen3-4B shape with dummy weights, triton attention, CUDA graphs
    on (breakable prefill, full decode), csgmv LoRA with rank-16 adapters. Dummy weights make the
    text meaningless, so it checks leaks, integrity, the absence of 5xx and that graphs replayed.
"""

from __future__ import annotations

import json
import os

import pytest
import requests

from lora_server_testlib import tiny_lora_checkpoint, write_adapter
from reliability_lib import assert_no_leaks, wait_idle
from server_helpers import kill_server, popen_launch_server, read_log
from soak_lib import Soak, SoakConfig, final_report, write_report

from sglang.srt.lora.lora_config import PEFT_PROJECTIONS



def soak_seconds(default: float) -> float:
    return float(os.environ.get("SGLANG_SOAK_SECONDS") or default)


def run_soak(proc, cfg: SoakConfig, report_path: str, capsys) -> dict:
    load = Soak(cfg).run()
    report = final_report(cfg.url, read_log(proc), load, lambda url: wait_idle(url, timeout=120))
    path = write_report(report, report_path)
    c = report["counts"]
    with capsys.disabled():
        print(f"\n[soak] {report['load_seconds']} s of load: ok {c.get('ok', 0)}, failed {c.get('failed', 0)}, "
              f"client aborts {c.get('client_abort', 0)}, /abort_request aborts {c.get('rid_abort', 0)}, "
              f"refused (cycling adapter unloaded) {c.get('refused_unloaded_adapter', 0)}, "
              f"adapter loads/unloads {c.get('adapter_load', 0)}/{c.get('adapter_unload', 0)}, "
              f"retractions in the log {report['retractions_in_log']}, graph stats {report['graph_stats']}, "
              f"overlapped decode steps / prefills {report['server_info'].get('overlapped_decode_steps')} / "
              f"{report['server_info'].get('overlapped_prefills')}, "
              f"pool loads/evictions {report['lora']['num_adapter_loads']}/{report['lora']['num_evictions']}, "
              f"latency {report['latency_s']}, requests ended meanwhile {report['ended_meanwhile']} "
              f"of {report['requests_ended']}; prefix cache {report['prefix_cache']}; "
              f"integrity: scheduler {report['scheduler_integrity']['ok']} "
              f"(runs {report['scheduler_integrity']['runs']}), tokenizer {report['tokenizer_integrity']['ok']} "
              f"(runs {report['tokenizer_integrity']['runs']}); report {path}")
    return report


def check_report(proc, url: str, report: dict) -> None:
    c = report["counts"]
    assert c.get("failed", 0) == 0, json.dumps(report["failures"], indent=1)
    assert proc.poll() is None, "the server died"
    assert requests.get(f"{url}/health", timeout=30).status_code == 200  # the scheduler process too
    assert_no_leaks(report["server_info"])
    assert report["num_forward_failures"] == 0 and report["integrity_errors_in_log"] == 0
    for outcome in ("ok", "client_abort", "rid_abort", "adapter_load", "adapter_unload"):
        assert c.get(outcome, 0) > 0, f"the soak never produced {outcome!r}: {c}"
    cache = report["prefix_cache"]
    assert cache["enabled"] and cache["hits"] > 0 and cache["evicted_tokens"] > 0, cache
    # Nobody waited unboundedly: a starved request waits until the load stops, while most of the
    # run's requests end. Counted in requests that ended while it ran, not in seconds: a loaded
    # machine (a neighbour's burst, a stall) slows every request alike, which leaves that count
    # where it was but stretches a wall-clock latency (on the CI machine the slowest request took
    # about half of a bound of a quarter of the run's seconds).
    waits = report["ended_meanwhile"]
    assert waits["max"] < report["requests_ended"] / 4, (waits, report["requests_ended"], report["latency_s"])


# ---------------------------------------------------------------------------- CPU
@pytest.fixture(scope="module")
def cpu_adapters(tmp_path_factory) -> dict[str, str]:
    ckpt = tiny_lora_checkpoint("llama")
    root = tmp_path_factory.mktemp("soak")
    specs = {"a": dict(r=4, seed=81), "b": dict(r=8, target_modules=["q_proj", "v_proj"], seed=82),
             "c": dict(r=16, target_modules="all-linear", seed=83), "cyc": dict(r=8, seed=84)}
    return {name: write_adapter(ckpt, str(root / name), **kw) for name, kw in specs.items()}


def cpu_soak(cpu_adapters, tmp_path, capsys, seconds: float, extra: tuple[str, ...] = ()) -> dict:
    proc, url = popen_launch_server(tiny_lora_checkpoint("llama"), [
        "--device", "cpu", "--dtype", "float32", "--lora-backend", "torch_native",
        "--max-loras-per-batch", "2", "--max-lora-rank", "16", "--lora-target-modules", "all",
        "--max-total-tokens", "384", "--chunked-prefill-size", "32", "--max-running-requests", "6",
        "--decode-log-interval", "200", "--lora-paths", *[f"{n}={cpu_adapters[n]}" for n in "abc"], *extra,
    ])
    try:
        cfg = SoakConfig(url=url, duration=seconds, adapters=["a", "b", "c"], cycling={"cyc": cpu_adapters["cyc"]},
                         workers=8)
        report = run_soak(proc, cfg, str(tmp_path / "soak_report.json"), capsys)
        check_report(proc, url, report)
        assert report["retractions_in_log"] > 0, "the KV pool never ran out: not a stress test"
        assert report["lora"]["num_evictions"] > 0
        return report
    finally:
        assert kill_server(proc) == 0, read_log(proc)[-3000:]


def test_soak(cpu_adapters, tmp_path, capsys) -> None:
    cpu_soak(cpu_adapters, tmp_path, capsys, soak_seconds(30))


def test_soak_overlap_schedule(cpu_adapters, tmp_path, capsys) -> None:
    """The same load through the overlap schedule (the default on one CUDA GPU, off on the CPU):
    decode steps launched ahead and prefills queued behind them meet aborts, retraction, adapter
    evictions and unloads, and still nothing is lost."""
    report = cpu_soak(cpu_adapters, tmp_path, capsys, soak_seconds(45) / 2, ("--enable-overlap-schedule",))
    info = report["server_info"]
    assert info["overlapped_decode_steps"] > 0 and info["overlapped_prefills"] > 0, info


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("SGLANG_SOAK_LONG") != "1", reason="set SGLANG_SOAK_LONG=1 for the long soak")
def test_soak_long(cpu_adapters, tmp_path, capsys) -> None:
    cpu_soak(cpu_adapters, tmp_path, capsys, soak_seconds(900))


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("SGLANG_SOAK_GPU") != "1", reason="set SGLANG_SOAK_GPU=1 (GPU_SUITE_PARTS=soak)")
def test_soak_gpu(tmp_path, capsys) -> None:
    from sglang.srt.tools.demo import DemoAdapterSpec, write_peft_adapter
    from sglang.srt.tools.make_checkpoint import make_checkpoint

    ckpt = make_checkpoint(str(tmp_path / "qwen3-4b"), preset="qwen3-4b", with_weights=False)
    with open(os.path.join(ckpt, "config.json")) as f:
        base_config = json.load(f)
    attn = ("q_proj", "k_proj", "v_proj", "o_proj")
    specs = [DemoAdapterSpec("a", 16, 32, attn, 91), DemoAdapterSpec("b", 16, 16, attn + ("gate_proj", "up_proj"), 92),
             DemoAdapterSpec("c", 8, 16, PEFT_PROJECTIONS, 93),
             DemoAdapterSpec("cyc", 16, 32, PEFT_PROJECTIONS, 94)]
    paths = {}
    for spec in specs:
        paths[spec.name] = str(tmp_path / "adapters" / spec.name)
        os.makedirs(paths[spec.name])
        write_peft_adapter(paths[spec.name], base_config, spec)
    log_dir = os.environ.get("SGLANG_SOAK_LOG_DIR")
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    proc, url = popen_launch_server(ckpt, [
        "--load-format", "dummy", "--attention-backend", "triton", "--lora-backend", "csgmv",
        "--max-loras-per-batch", "3", "--max-lora-rank", "16", "--lora-target-modules", "all",
        "--max-total-tokens", "12288", "--chunked-prefill-size", "512", "--max-running-requests", "48",
        "--lora-paths", *[f"{n}={paths[n]}" for n in "abc"],
    ], timeout=900, log_dir=log_dir, env={"TRITON_INTERPRET": "0"})  # real kernels, not the interpreter
    try:
        cfg = SoakConfig(url=url, duration=soak_seconds(180), adapters=["a", "b", "c"], cycling={"cyc": paths["cyc"]},
                         workers=40, prompt_tokens=(8, 1200), prompt_words=(4, 400), max_new_tokens=(1, 256))
        report = run_soak(proc, cfg, str(tmp_path / "soak_report.json"), capsys)
        check_report(proc, url, report)
        graphs = report["graph_stats"]
        assert graphs["prefill_graph_replays"] > 0 and graphs["decode_graph_replays"] > 0, graphs
        # One CUDA GPU: the overlap schedule is the default, and the soak runs through it.
        assert report["server_info"]["overlapped_decode_steps"] > 0, report["server_info"]
    finally:
        assert kill_server(proc) == 0, read_log(proc)[-3000:]
