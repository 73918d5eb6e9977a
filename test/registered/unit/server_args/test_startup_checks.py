"""Start-up mistakes caught before (or instead of) a long load, each a ValueError that the launcher
prints as one line (exit status 2) rather than a traceback or a server that fails every request."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from server_helpers import PYTHON_DIR, free_port, kill_server, popen_launch_server, read_log, tiny_checkpoint
from sglang.srt.configs.chat_templates import resolve_chat_template
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.configs.tokenizer import TokenizerSpec, load_tokenizer
from sglang.srt.entrypoints.http_server import reserve_address
from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator
from sglang.srt.server_args import ServerArgs


def test_a_context_past_the_models_needs_the_upstream_opt_in(monkeypatch) -> None:
    path = tiny_checkpoint("qwen3")
    max_pos = ModelConfig.from_pretrained(path).context_len
    monkeypatch.delenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", raising=False)
    with pytest.raises(ValueError, match="SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1"):
        ModelConfig.from_pretrained(path, context_length=max_pos * 2)
    assert ModelConfig.from_pretrained(path, context_length=max_pos // 2).context_len == max_pos // 2
    monkeypatch.setenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "1")
    assert ModelConfig.from_pretrained(path, context_length=max_pos * 2).context_len == max_pos * 2


def test_json_model_override_args_turn_on_yarn_from_the_command_line() -> None:
    from sglang.srt.server_configs import build_run_configs
    from sglang.srt.server_args import prepare_server_args

    path = tiny_checkpoint("qwen3")  # max_position_embeddings 2048, plain RoPE
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    args = prepare_server_args(["--model-path", path, "--device", "cpu",
                                "--json-model-override-args", json.dumps({"rope_scaling": yarn})])
    model = build_run_configs(args).scheduler.runner.model
    assert model.rope_scaling == yarn and model.context_len == 4096  # 1024 x 4, past the 2048
    assert model.hf_config["rope_scaling"] == yarn  # what /get_server_info and the loader see
    assert build_run_configs(prepare_server_args(["--model-path", path, "--device", "cpu"])).scheduler.runner.model.rope_scaling is None
    for bad, match in (("{rope", "not valid JSON"), ('["rope_scaling"]', "must be a JSON object")):
        with pytest.raises(ValueError, match=match):
            ServerArgs(model_path=path, json_model_override_args=bad)


def test_triton_attention_on_a_cpu_needs_the_interpreter(monkeypatch) -> None:
    args = ServerArgs(model_path=tiny_checkpoint("qwen3"), device="cpu", attention_backend="triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="--attention-backend triton needs a CUDA device"):
        args.resolved_attention_backend()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert args.resolved_attention_backend() == "triton"


def test_a_busy_port_or_an_unknown_host_is_refused_before_loading() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot listen on --host 127.0.0.1 --port {port}"):
            reserve_address("127.0.0.1", port)
    with pytest.raises(ValueError, match="--host 'no-such-host.invalid' does not resolve"):
        reserve_address("no-such-host.invalid", 30000)
    # Free again: reserved while the model loads, no other process can take it (the server used to
    # say it was ready and then fail to listen); connections are refused until the server listens.
    reserved = reserve_address("127.0.0.1", port)
    try:
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        with socket.socket() as client, pytest.raises(ConnectionRefusedError):
            client.connect(("127.0.0.1", port))
    finally:
        reserved.close()
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))


def test_a_chat_template_that_does_not_parse_is_refused(tmp_path) -> None:
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }}{% endfor %}\n{{ oops }")
    with pytest.raises(ValueError, match="line 2"):
        resolve_chat_template(str(bad))
    good = tmp_path / "good.jinja"
    good.write_text("{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}{{ m.content }}{% endfor %}")
    assert "messages" in resolve_chat_template(str(good))


def test_a_missing_tokenizer_is_a_configuration_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="could not load a tokenizer from .*--tokenizer-path"):
        load_tokenizer(TokenizerSpec(str(tmp_path / "nowhere")))


def test_a_truncated_checkpoint_names_its_file(tmp_path) -> None:
    src = tiny_checkpoint("qwen3")
    (weights,) = [f for f in os.listdir(src) if f.endswith(".safetensors")]
    broken = tmp_path / weights
    shutil.copy(os.path.join(src, weights), broken)
    with open(broken, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match=f"cannot read the checkpoint file .*{weights}.*truncated or corrupt"):
        list(safetensors_weights_iterator([str(broken)], progress=False))


@pytest.mark.parametrize("flag, value", [("--max-total-tokens", 10**12), ("--max-running-requests", 10**9)])
def test_pools_larger_than_host_memory_are_refused_naming_the_flag(flag: str, value: int) -> None:
    """On the CPU the KV cache and the request table come out of host memory: a size that cannot
    fit was the allocator's traceback, printed twice, the flag never named."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", tiny_checkpoint("qwen3"), "--device", "cpu",
           "--port", str(free_port()), flag, str(value)]
    env = {**os.environ, "PYTHONPATH": PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    log = out.stdout + out.stderr
    assert out.returncode == 2, log[-3000:]
    assert "error: the KV cache of --max-total-tokens" in log and flag in log and str(value) in log, log[-3000:]
    assert "of memory available" in log and "Traceback" not in log, log[-3000:]


def test_a_kv_cache_too_small_for_any_request_is_said_at_start_and_by_the_probe() -> None:
    """--max-total-tokens 1 holds no request (a prompt token and an output token): the start-up log
    says what the KV cache limits, and /health_generate answers 503 (the server's fault), not the
    400 of a client error."""
    import requests

    proc, url = popen_launch_server(tiny_checkpoint("qwen3"), other_args=["--device", "cpu", "--max-total-tokens", "1"])
    try:
        r = requests.get(f"{url}/health_generate", timeout=60)
        assert r.status_code == 503 and "cannot run a one-token request" in r.json()["error"]["message"], r.text
        assert requests.get(f"{url}/health", timeout=60).status_code == 200
        assert "fewer than the context length" in read_log(proc)
    finally:
        kill_server(proc)
