"""The tensor-parallel process layout end to end on the CPU (2 gloo ranks): a real server and a
real Engine, each rank a scheduler process; rank 0 receives and broadcasts, every rank schedules
the same batches, rank 0 alone replies (DESIGN §11). Each rank holds its shard of the model and of
every adapter.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests


from lora_server_testlib import PROMPTS, greedy, load_adapter, tiny_lora_checkpoint, unload_adapter, write_adapter
from server_helpers import PYTHON_DIR, free_port, kill_server, popen_launch_server, read_log, server_env

def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def all_gone(pids: list[int], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(pid_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def run_cli(args: list[str], env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    """Run the server CLI to its exit (a failing start-up); afterwards nothing of it may be left."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--port", str(free_port()), "--device", "cpu", *args]
    full_env = {**os.environ, "PYTHONPATH": PYTHON_DIR, **server_env(), **env}
    proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group: its ranks are in it
    stdout, stderr = proc.communicate(timeout=timeout)
    deadline = time.monotonic() + 15
    while group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_alive(proc.pid), "a rank process outlived the failed start-up"
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.fixture(scope="module")
def ckpt() -> str:
    return tiny_lora_checkpoint("llama")  # 4 attention heads, 2 KV heads


def test_bad_tp_size_is_a_clear_startup_error(ckpt) -> None:
    out = run_cli(["--model-path", ckpt, "--tp-size", "3"], {})
    assert out.returncode == 2, out.stderr[-3000:]
    assert ("error: LlamaForCausalLM cannot be split across --tp-size 3 tensor-parallel ranks: "
            "num_attention_heads (4) is not divisible by 3") in out.stderr, out.stderr[-3000:]
    assert "Sizes that work for this model: 1, 2, 4." in out.stderr
    assert "Joined the tensor-parallel group" not in out.stderr + out.stdout  # checked before any rank starts
    assert "Traceback" not in out.stderr


def test_a_rank_failing_at_start_is_named(ckpt) -> None:
    out = run_cli(["--model-path", ckpt, "--tp-size", "2", "--enable-test-hooks"],
                  {"SGLANG_TEST_TP_FAIL_AT_START": "1"})
    assert out.returncode == 1, out.stderr[-3000:]
    assert re.search(r"error: TP rank 1 \(pid \d+\): The scheduler failed to start:", out.stderr), out.stderr[-3000:]
    assert "RuntimeError: injected start-up failure of TP rank 1" in out.stderr


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-adapters")
    adapters = {"a": write_adapter(ckpt, str(root / "a"), r=8, seed=61),
                "b": write_adapter(ckpt, str(root / "b"), r=4, seed=62)}
    proc, url = popen_launch_server(ckpt, [
        "--device", "cpu", "--dtype", "float32", "--tp-size", "2", "--enable-test-hooks",
        "--lora-paths", f"a={adapters['a']}", "--max-loras-per-batch", "3",
        "--max-lora-rank", "8", "--lora-target-modules", "all",
    ], env=server_env())
    yield proc, url, adapters
    kill_server(proc)


def server_info(url: str) -> dict:
    r = requests.get(f"{url}/get_server_info", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle_check(url: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = server_info(url)
        check = info["last_integrity_check"]
        if (check.get("idle") and info["num_running_reqs"] == 0) or time.monotonic() > deadline:
            return check
        time.sleep(0.2)


def test_ranks_serve_in_lockstep_and_stop_on_sigint(server) -> None:
    proc, url, adapters = server
    info = server_info(url)
    assert info["tp_size"] == 2 and [r["tp_rank"] for r in info["tp_ranks"]] == [0, 1]
    pids = [r["pid"] for r in info["tp_ranks"]]
    assert len(set(pids)) == 2 and all(pid_alive(p) for p in pids)
    for rank in info["tp_ranks"]:  # NVLink multicast off in every rank process
        assert rank["env"] == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                               "NVSHMEM_DISABLE_NVLS": "1"}

    # A mixed batch (base + adapter), then adapters loaded and unloaded while serving: every rank
    # must see the same requests, adapter commands and slot assignments.
    r = requests.post(f"{url}/generate", json={
        "input_ids": PROMPTS[:3], "lora_path": [None, "a", None],
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}, timeout=300)
    assert r.status_code == 200 and all(len(o["output_ids"]) == 6 for o in r.json()), r.text
    assert load_adapter(url, "b", adapters["b"]).status_code == 200
    assert greedy(url, PROMPTS[1], "b")["input"] != greedy(url, PROMPTS[1], None)["input"]  # b is applied
    assert unload_adapter(url, "a").status_code == 200
    assert greedy(url, PROMPTS[2], "b")["ids"]
    # Constrained requests: every rank compiles the grammars and admits them at the same turn (rank
    # 0's GrammarReady), and every rank's matchers accept rank 0's sampled tokens.
    r = requests.post(f"{url}/generate", json={"text": ["Pick one", "A number", "Free text"], "sampling_params": [
        {"max_new_tokens": 16, "temperature": 1.0, "seed": 1, "ebnf": 'root ::= "left" | "right" | "up down"'},
        {"max_new_tokens": 16, "temperature": 0.8, "seed": 2, "regex": "[1-9][0-9]{2}"},
        {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}]}, timeout=300)
    assert r.status_code == 200, r.text
    outs = r.json()
    assert outs[0]["text"] in ("left", "right", "up down") and re.fullmatch("[1-9][0-9]{2}", outs[1]["text"]), outs
    assert server_info(url)["grammar_matchers"] == 0
    check = wait_idle_check(url)
    assert check["ok"] and check["tp_ranks_agree"], check
    assert server_info(url)["lora"]["loaded_adapters"] == {"b": adapters["b"]}

    # Ctrl-C with an adapter's reply streaming: the reply ends with the shutdown's 503, the server
    # shuts down cleanly and takes every rank with it.
    events: list[str] = []
    streaming = threading.Event()

    def stream() -> None:
        r = requests.post(f"{url}/generate", stream=True, timeout=120, json={
            "input_ids": PROMPTS[0], "lora_path": "b", "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}})
        for line in r.iter_lines(decode_unicode=True):
            if line.startswith("data: "):
                events.append(line[6:])
                streaming.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert streaming.wait(60), "the stream did not start"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0, read_log(proc)[-3000:]
    reader.join(30)
    assert all_gone(pids), "a TP rank outlived the server"
    assert events[-1] == "[DONE]" and "shutting down" in events[-2], events[-2:]
    log = read_log(proc)
    # rank 0 kept sending news of that request until it was stopped, after the HTTP server's
    # event loop had closed: that news is dropped, not a traceback per message.
    assert "Traceback" not in log, log[-3000:]
    assert "Joined the tensor-parallel group: rank 1 of 2 (gloo)" in log
    assert "The scheduler has exited" in log
    # The ranks leave by os._exit: nothing of theirs may be left to the resource tracker.
    assert "leaked semaphore" not in log, log[-3000:]


def test_engine_with_tp2_and_a_killed_rank(ckpt, monkeypatch) -> None:
    from sglang import Engine

    for key, value in server_env().items():
        monkeypatch.setenv(key, value)
    engine = Engine(model_path=ckpt, device="cpu", dtype="float32", tp_size=2, enable_test_hooks=True)
    try:
        out = engine.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 4, "temperature": 0})
        assert len(out["output_ids"]) == 4
        info = engine.get_server_info()
        pids = [r["pid"] for r in info["tp_ranks"]]
        assert info["tp_size"] == 2 and len(pids) == 2
        # A rank dies: the engine reports which one and why, and no rank is left behind.
        os.kill(pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while engine.tokenizer_manager.dead_reason is None and time.monotonic() < deadline:
            time.sleep(0.1)
        reason = engine.tokenizer_manager.dead_reason
        assert reason is not None and re.fullmatch(
            rf"TP rank 1 \(pid {pids[1]}\) exited unexpectedly \(killed by SIGKILL\)", reason), reason
        with pytest.raises(RuntimeError, match="TP rank 1"):
            engine.generate(input_ids=PROMPTS[1], sampling_params={"max_new_tokens": 2})
        assert all_gone(pids), "rank 0 must not be left waiting for its dead peer"
    finally:
        engine.shutdown()


def test_a_batch_failing_on_one_rank_stops_every_rank(ckpt, monkeypatch) -> None:
    """A decode step fails on rank 1 alone, while rank 0 goes on into the forward and waits in its
    first all-reduce for a peer that will never join: rank 1 stops, the engine names it and the
    cause, and rank 0 is not left hanging."""
    from sglang import Engine

    for key, value in server_env().items():
        monkeypatch.setenv(key, value)
    engine = Engine(model_path=ckpt, device="cpu", dtype="float32", tp_size=2, enable_test_hooks=True)
    try:
        pids = [r["pid"] for r in engine.get_server_info()["tp_ranks"]]
        engine.tokenizer_manager.inject_fault("boom", where="decode", after_tokens=2, tp_rank=1)
        start = time.monotonic()
        out = engine.generate(input_ids=PROMPTS[1], rid="boom-1",
                              sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert time.monotonic() - start < 60
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and reason["status_code"] == 500, reason
        assert re.search(rf"TP rank 1 \(pid {pids[1]}\) exited unexpectedly \(exit code 1\): .*TP rank 1: a batch "
                         r"of 1 request\(s\) failed on this rank \(RuntimeError: injected fault", reason["message"]), reason
        with pytest.raises(RuntimeError, match="TP rank 1"):
            engine.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 2})
        assert all_gone(pids), "a rank outlived its failed peer"
    finally:
        engine.shutdown()


def test_two_nodes_on_one_host(ckpt) -> None:
    """--nnodes 2: node 0 serves and runs rank 0, node 1 runs rank 1 and serves nothing; stopping
    node 0 shuts the whole group down, node 1 included."""
    addr = f"127.0.0.1:{free_port()}"
    common = ["--device", "cpu", "--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr, "--enable-test-hooks"]
    env = {**os.environ, "PYTHONPATH": PYTHON_DIR, **server_env()}
    node1 = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", "--model-path", ckpt, *common,
                              "--node-rank", "1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
    try:
        node0, url = popen_launch_server(ckpt, [*common, "--node-rank", "0"], env=server_env())
        try:
            assert greedy(url, PROMPTS[0], None, n=3)["ids"]
            assert [r["tp_rank"] for r in server_info(url)["tp_ranks"]] == [0]  # node 0's own ranks
            node0.send_signal(signal.SIGINT)
            assert node0.wait(60) == 0, read_log(node0)[-3000:]
        finally:
            kill_server(node0)
        out, _ = node1.communicate(timeout=60)
        assert node1.returncode == 0, out[-3000:]
        assert "Node 1 runs TP ranks 1" in out and "Rank 0 shut the group down" in out
    finally:
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
            node1.wait(10)
