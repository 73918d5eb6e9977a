"""`sglang.Engine` (offline, same scheduler child process) and process lifetimes: no orphan
scheduler after shutdown, an exception, a killed parent, or SIGINT to the server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from server_helpers import (PYTHON_DIR, cache_dir_for_tests, kill_server, read_log, server_env, servers_for_tests,
                            started)
from sglang.srt.managers.generate_request import InvalidRequestError


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def wait_gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.1)
    return False


def children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(x) for x in f.read().split()]
    return out


@pytest.fixture(scope="module")
def engine():
    from sglang import Engine

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SGLANG_CACHE_DIR", cache_dir_for_tests())
        eng = Engine(model_path="demo", device="cpu")
    yield eng
    pid = eng.tokenizer_manager.client.proc.pid
    eng.shutdown()
    assert wait_gone(pid)


def test_import_sglang_is_light() -> None:
    code = "import sys, sglang; assert 'torch' not in sys.modules and 'fastapi' not in sys.modules; print(sglang.Engine.__name__)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": PYTHON_DIR},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "Engine", out.stderr


def test_engine_generate(engine) -> None:
    params = {"max_new_tokens": 8, "temperature": 0}
    one = engine.generate("The boats were", params)
    assert isinstance(one, dict) and one["meta_info"]["completion_tokens"] == len(one["output_ids"]) <= 8
    batch = engine.generate(["The boats were", "Numbers:"], params)
    assert isinstance(batch, list) and batch[0]["output_ids"] == one["output_ids"]
    chunks = list(engine.generate("The boats were", params, stream=True))
    assert chunks[-1]["text"] == one["text"] and chunks[-1]["output_ids"] == one["output_ids"]
    assert all(chunks[-1]["text"].startswith(c["text"]) for c in chunks)
    ids = engine.generate(input_ids=one["output_ids"][:3], sampling_params=params, return_logprob=True,
                          logprob_start_len=0, top_logprobs_num=2)
    assert len(ids["meta_info"]["input_token_logprobs"]) == 3
    with pytest.raises(InvalidRequestError, match="not loaded.*demo-all-r16.*demo-qv-r8"):
        engine.generate("x", params, lora_path="no-such-adapter")


def test_engine_prefix_cache(engine) -> None:
    params = {"max_new_tokens": 2, "temperature": 0}
    prompt = "A prompt for the prefix cache, long enough to be worth caching"
    first = engine.generate(prompt, params, cache_salt="engine-tenant")["meta_info"]
    second = engine.generate(prompt, params, cache_salt="engine-tenant")["meta_info"]
    assert first["cached_tokens"] == 0 and second["cached_tokens"] == second["prompt_tokens"] - 1
    out = engine.flush_cache()
    assert out["success"] is True and "flushed" in out["message"]
    assert engine.generate(prompt, params, cache_salt="engine-tenant")["meta_info"]["cached_tokens"] == 0
    assert engine.get_server_info()["prefix_cache"]["hits"] >= 1


def test_engine_serves_the_demo_adapters_and_loads_more(engine) -> None:
    from sglang.srt.tools.demo import ensure_demo_model

    params = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    demo = ensure_demo_model(cache_dir_for_tests())
    base = engine.generate("The boats were", params)["output_ids"]
    qv = engine.generate("The boats were", params, lora_path="demo-qv-r8")["output_ids"]
    assert qv != base  # the demo adapter is served and changes the answer
    out = engine.load_lora_adapter("copy", demo.adapters["demo-qv-r8"])
    assert out["success"] is True and out["error_message"] == "" and "copy" in out["loaded_adapters"]
    assert engine.generate("The boats were", params, lora_path="copy")["output_ids"] == qv
    again = engine.load_lora_adapter("copy", demo.adapters["demo-qv-r8"])
    assert again["success"] is False and "already loaded" in again["error_message"]
    bad = engine.load_lora_adapter("bad", "/no/such/adapter")
    assert bad["success"] is False and "does not exist" in bad["error_message"]
    assert set(bad["loaded_adapters"]) == {"demo-qv-r8", "demo-all-r16", "copy"}
    assert engine.unload_lora_adapter("copy")["success"] is True
    with pytest.raises(InvalidRequestError, match="not loaded"):
        engine.generate("x", params, lora_path="copy")
    assert engine.unload_lora_adapter("copy")["success"] is False
    assert engine.get_server_info()["lora"]["loaded_adapters"].keys() == {"demo-qv-r8", "demo-all-r16"}


def test_engine_stream_stopped_early_frees_kv(engine) -> None:
    before = engine.get_server_info()["kv_available_tokens"]
    stream = engine.generate("Tell a long story", {"max_new_tokens": 1000, "ignore_eos": True}, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.monotonic() + 10
    while engine.get_server_info()["kv_available_tokens"] != before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine.get_server_info()["kv_available_tokens"] == before


def test_engine_async_generate(engine) -> None:
    """As upstream's: awaited from the caller's own loop, concurrent calls batch, a stream is an
    async iterator, and a cancelled call aborts its request (its KV comes back)."""
    import asyncio

    params = {"max_new_tokens": 6, "temperature": 0}
    prompts = ["The boats were", "Once upon a time", "A quiet harbour"]
    want = [engine.generate(p, params) for p in prompts]
    before = engine.get_server_info()["kv_available_tokens"]

    async def main() -> None:
        got = await asyncio.gather(*(engine.async_generate(p, params) for p in prompts))
        assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
        chunks = [c async for c in await engine.async_generate(prompts[0], params, stream=True)]
        # Cumulative dicts; news that arrives while the reader is away is merged into one chunk (as
        # upstream's), so how many chunks a 6-token stream gives depends on timing: not asserted.
        ids = [c["output_ids"] for c in chunks]
        assert all(a == b[:len(a)] for a, b in zip(ids, ids[1:])) and ids[-1] == want[0]["output_ids"]
        # A stream delivers before its request ends: the first chunk of a long one is unfinished.
        # Closing the stream early aborts the request (the KV check below sees it freed).
        endless = await engine.async_generate("Tell a long story", {"max_new_tokens": 1000, "ignore_eos": True},
                                              stream=True)
        first = await endless.__anext__()
        assert first["meta_info"]["finish_reason"] is None and len(first["output_ids"]) < 1000
        await endless.aclose()
        with pytest.raises(InvalidRequestError, match="not loaded"):
            await engine.async_generate("x", params, lora_path="no-such-adapter")
        long = asyncio.ensure_future(engine.async_generate("Tell a long story", {"max_new_tokens": 1000,
                                                                                 "ignore_eos": True}))
        await asyncio.sleep(0.5)
        long.cancel()
        with pytest.raises(asyncio.CancelledError):
            await long

    asyncio.run(main())
    deadline = time.monotonic() + 10
    while engine.get_server_info()["kv_available_tokens"] != before and time.monotonic() < deadline:
        time.sleep(0.1)
    info = engine.get_server_info()
    assert info["kv_available_tokens"] == before and info["num_running_reqs"] == 0


def test_engine_exception_inside_with_block_reaps_the_scheduler(monkeypatch) -> None:
    monkeypatch.setenv("SGLANG_CACHE_DIR", cache_dir_for_tests())
    from sglang import Engine

    pid = None
    with pytest.raises(RuntimeError, match="boom"):
        with Engine(model_path="demo", device="cpu", max_total_tokens=512) as eng:
            pid = eng.tokenizer_manager.client.proc.pid
            raise RuntimeError("boom")
    assert pid is not None and wait_gone(pid, 5)


def test_scheduler_exits_when_its_parent_is_killed(tmp_path) -> None:
    script = tmp_path / "victim.py"
    # No __main__ guard on purpose: the engine must not re-run this script in its child.
    script.write_text(textwrap.dedent("""
        import os, signal, sys
        from sglang import Engine
        eng = Engine(model_path="demo", device="cpu", max_total_tokens=512)
        print(eng.tokenizer_manager.client.proc.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """))
    env = {**os.environ, "PYTHONPATH": PYTHON_DIR, **server_env()}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    child = int(out.stdout.split()[0])
    assert wait_gone(child, 10), "the scheduler outlived its killed parent"


@pytest.fixture(scope="module")
def servers(request):
    """A fresh demo server for each of the two tests below (each stops its own), both started side
    by side up front (each start keeps about one core busy)."""
    demo = dict(model="demo", other_args=["--device", "cpu", "--max-total-tokens", "512"], env=server_env())
    with servers_for_tests(request, {"test_sigint_shuts_the_server_down_cleanly": demo,
                                     "test_server_exits_with_an_error_when_the_scheduler_dies": demo}) as started_servers:
        yield started_servers


def test_sigint_shuts_the_server_down_cleanly(servers, request) -> None:
    proc, _ = started(servers[request.node.name])
    scheduler = children(proc.pid)
    assert scheduler, "the server should have a scheduler child"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 0
    assert all(wait_gone(pid, 5) for pid in scheduler)
    assert "The scheduler has exited" in read_log(proc)
    kill_server(proc)


def test_server_exits_with_an_error_when_the_scheduler_dies(servers, request) -> None:
    proc, url = started(servers[request.node.name])
    try:
        scheduler = [pid for pid in children(proc.pid) if "resource_tracker" not in open(f"/proc/{pid}/cmdline").read()]
        assert len(scheduler) == 1
        os.kill(scheduler[0], signal.SIGKILL)
        assert proc.wait(30) == 1  # a supervisor sees the failure and can restart the server
        assert "the scheduler process exited unexpectedly" in read_log(proc)
    finally:
        kill_server(proc)


def test_resolve_model_serves_the_demo_adapters_and_a_runnable_lora_backend(monkeypatch) -> None:
    from sglang.srt.server_configs import resolve_model
    from sglang.srt.server_args import ServerArgs

    monkeypatch.setenv("SGLANG_CACHE_DIR", cache_dir_for_tests())
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    demo = resolve_model(ServerArgs(device="cpu"))
    assert demo.enable_lora and [s.lora_name for s in demo.lora_paths] == ["demo-qv-r8", "demo-all-r16"]
    assert demo.resolved_lora_backend() == "csgmv"  # the interpreter runs the Triton kernels on the CPU
    # A bare --enable-lora changes nothing (it was refused for want of --max-lora-rank).
    from sglang.srt.server_args import prepare_server_args

    for flags in (["--enable-lora"], ["--enable-lora", "--max-lora-rank", "32"], ["--max-lora-rank", "32"]):
        args = resolve_model(prepare_server_args(["--device", "cpu", *flags]))
        assert args.enable_lora and [s.lora_name for s in args.lora_paths] == ["demo-qv-r8", "demo-all-r16"], flags
    # A pool sized in part serves the demo adapters that fit it (demo-all-r16 stopped the start).
    for flags in (["--max-lora-rank", "8"], ["--enable-lora", "--lora-target-modules", "q_proj", "v_proj"]):
        args = resolve_model(prepare_server_args(["--device", "cpu", *flags]))
        assert [s.lora_name for s in args.lora_paths] == ["demo-qv-r8"], flags
    assert not resolve_model(prepare_server_args(["--device", "cpu", "--max-lora-rank", "4"])).enable_lora
    # LoRA configured by hand: the user's pool, no demo adapters.
    own = resolve_model(ServerArgs(device="cpu", enable_lora=True, max_lora_rank=4, lora_target_modules=["all"]))
    assert own.enable_lora and not own.lora_paths
    with pytest.raises(ValueError, match="more than --max-loaded-loras"):  # flags are checked with the demo adapters
        resolve_model(ServerArgs(device="cpu", max_loaded_loras=1, max_loras_per_batch=1))
    # No GPU and no interpreter: the Triton backends cannot run, torch_native serves instead.
    monkeypatch.delenv("TRITON_INTERPRET")
    assert resolve_model(ServerArgs(device="cpu")).resolved_lora_backend() == "torch_native"
    assert ServerArgs(device="cpu", lora_backend="triton").resolved_lora_backend() == "torch_native"
    # /get_server_info's top level reports the backend that runs, as its "lora" section does.
    assert ServerArgs(device="cpu", lora_backend="triton").to_public_dict()["lora_backend"] == "torch_native"
