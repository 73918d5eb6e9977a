"""`--lora-paths` entries the server must refuse at start-up with a clear message instead of
starting and serving something other than what was asked.

  * an adapter named like the base model (its served name, or the alias "default"):
    `/load_lora_adapter` refuses such a name (400, "the name is the base model's"); given at start
    it used to be served, so `model="<served name>"` silently ran the adapter, the base model
    could no longer be chosen by name, and /v1/models listed the name twice;
  * the JSON form with a `pinned` that is not a boolean (`"pinned": "false"` used to pin the
    adapter); `/load_lora_adapter` refuses a non-boolean `pinned` the same way.

Each case launches `python -m sglang.launch_server` (CPU) with real PEFT adapters written by `peft`
and expects it to exit with status 2 and an "error: ..." line, no traceback; the failures happen
before any model is loaded, so each launch takes a few seconds.

With --max-loras-per-batch unset, startup adapters that are all pinned are served: the pool sized
for them keeps the one slot pinning must leave free (it used to take exactly 8 slots for 8 pinned
adapters and then refuse the 8th pin, a flag the user never gave).

And the offline `Engine(lora_paths={name: path})` (the Python API's mapping form, as in SGLang),
which used to be refused as one malformed spec, serves those adapters under those names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import requests

from lora_server_testlib import write_adapter
from server_helpers import PYTHON_DIR, free_port

LAUNCH_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def adapter(lora_ckpt, tmp_path_factory) -> str:
    """A rank-8 PEFT adapter on q_proj / v_proj of the tiny Llama checkpoint."""
    return write_adapter(lora_ckpt, str(tmp_path_factory.mktemp("qa-adapter") / "a"), r=8,
                         target_modules=["q_proj", "v_proj"], seed=5)


def launch_expecting_refusal(ckpt: str, flags: list[str]) -> str:
    """Launch a CPU server that must refuse to start; returns its log. A server that starts
    instead fails the test with what it serves (and is stopped)."""
    port = free_port()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", ckpt, "--device", "cpu",
           "--dtype", "float32", "--lora-backend", "torch_native", "--host", "127.0.0.1",
           "--port", str(port), *flags]
    env = {**os.environ, "PYTHONPATH": PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                models = requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            except requests.RequestException:
                time.sleep(0.3)
                continue
            if models.status_code == 200:
                ids = [(m["id"], m["parent"]) for m in models.json()["data"]]
                pytest.fail(f"the server started instead of refusing {flags}; /v1/models (id, parent): {ids}")
        assert proc.poll() is not None, f"the server neither started nor exited in {LAUNCH_TIMEOUT_S} s"
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        log = proc.communicate()[0] or ""
    assert proc.returncode == 2, f"exit code {proc.returncode}:\n{log[-3000:]}"
    assert "Traceback" not in log, log[-3000:]  # a configuration error, not a crash
    return log


def test_startup_adapter_named_like_the_base_model_is_refused(lora_ckpt, adapter) -> None:
    log = launch_expecting_refusal(lora_ckpt, [
        "--served-model-name", "m", "--lora-paths", f"ok={adapter}", f"m={adapter}", f"default={adapter}",
    ])
    assert "error: --lora-paths" in log and "'default'" in log and "'m'" in log, log[-3000:]
    assert "base model" in log and "'ok'" not in log, log[-3000:]


def test_startup_adapter_named_like_the_model_path_is_refused(lora_ckpt, adapter) -> None:
    # Without --served-model-name the base model is served under its path.
    log = launch_expecting_refusal(lora_ckpt, ["--lora-paths", f"{lora_ckpt}={adapter}"])
    assert "error: --lora-paths" in log and "base model" in log and repr(lora_ckpt) in log, log[-3000:]


@pytest.mark.parametrize("flags, says", [
    (["--lora-paths", "a=/no/such/adapter"], "path '/no/such/adapter' does not exist"),
    (["--max-lora-rank", "4"], "its rank 8 is above --max-lora-rank 4; give --max-lora-rank 8"),
    (["--lora-target-modules", "o_proj", "--max-lora-rank", "8"], "['q_proj', 'v_proj'] outside --lora-target-modules"),
])
def test_a_startup_adapter_the_flags_cannot_serve_is_refused_before_the_model_loads(lora_ckpt, adapter, flags,
                                                                                   says) -> None:
    """Read from adapter_config.json in the launcher: no scheduler process starts (a typo in a path
    used to cost a whole weight load before the server said so)."""
    if flags[0] != "--lora-paths":
        flags = ["--lora-paths", f"a={adapter}", *flags]
    log = launch_expecting_refusal(lora_ckpt, flags)
    assert "Failed to load LoRA adapter 'a' at startup (--lora-paths)" in log and says in log, log[-3000:]
    assert "Scheduler]" not in log, log[-3000:]  # the scheduler's log lines carry its name


@pytest.mark.parametrize("pinned", ["false", None])
def test_startup_json_entry_with_a_non_boolean_pinned_is_refused(lora_ckpt, adapter, pinned) -> None:
    entry = json.dumps({"lora_name": "p", "lora_path": adapter, "pinned": pinned})
    log = launch_expecting_refusal(lora_ckpt, ["--lora-paths", entry])
    assert "error: --lora-paths" in log and "'pinned' must be true or false" in log, log[-3000:]


def test_startup_adapters_all_pinned_fit_an_unset_slot_count(lora_ckpt, adapter) -> None:
    from lora_server_testlib import generate, load_adapter, lora_info
    from server_helpers import kill_server, popen_launch_server, read_log

    names = [f"p{i}" for i in range(8)]  # DEFAULT_SLOTS of them
    specs = [json.dumps({"lora_name": n, "lora_path": adapter, "pinned": True}) for n in names]
    proc, url = popen_launch_server(lora_ckpt, [
        "--device", "cpu", "--dtype", "float32", "--lora-backend", "torch_native", "--max-total-tokens", "1024",
        "--lora-paths", *specs,
    ])
    try:
        info = lora_info(url)
        assert sorted(info["pinned_adapters"]) == names and info["max_loras_per_batch"] == 9, info
        # An adapter loaded later runs in one batch with every pinned one: all nine hold slots.
        assert load_adapter(url, "free", adapter).status_code == 200
        outs = generate(url, {"input_ids": [[5, 6, 7, 8]] * 9, "lora_path": [*names, "free"],
                              "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        assert all(out["output_ids"] == outs[0]["output_ids"] for out in outs)  # one adapter, nine names
        assert set(lora_info(url)["pool_slots"]) == {*names, "free"}
    finally:
        assert kill_server(proc) == 0, read_log(proc)[-3000:]


def test_engine_takes_lora_paths_as_a_name_to_path_mapping(lora_ckpt, adapter) -> None:
    """`Engine(lora_paths={name: path})`, the Python API's mapping form (as in SGLang), serves
    those adapters under those names; a single JSON-style spec dict still means one adapter."""
    from sglang import Engine
    from sglang.srt.server_args import LoRAPathSpec, ServerArgs

    single = ServerArgs(model_path="demo", lora_paths={"lora_name": "x", "lora_path": adapter, "pinned": True})
    assert single.lora_paths == [LoRAPathSpec("x", adapter, True)]

    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    with Engine(model_path=lora_ckpt, device="cpu", dtype="float32", lora_backend="torch_native",
                max_total_tokens=1024, lora_paths={"qa": adapter, "qb": adapter}) as engine:
        assert engine.get_server_info()["lora"]["loaded_adapters"] == {"qa": adapter, "qb": adapter}
        base = engine.generate(input_ids=[5, 6, 7, 8], sampling_params=sp)["output_ids"]
        qa = engine.generate(input_ids=[5, 6, 7, 8], sampling_params=sp, lora_path="qa")["output_ids"]
        qb = engine.generate(input_ids=[5, 6, 7, 8], sampling_params=sp, lora_path="qb")["output_ids"]
    assert qa == qb != base
