"""LoRA under the prefill CUDA graph, end to end through real servers (GPU only).

For each LoRA backend (triton, csgmv) and prefill graph backend (breakable, full), one server runs
with the graph and one fully eager (--disable-cuda-graph), same peaked test checkpoint and rank-16
PEFT adapter, --max-loras-per-batch 2. Checked:
  - prompt logprobs (max_new_tokens=0, logprob_start_len=0) agree within 1e-2 for LoRA requests,
    base requests and a mixed batch [adapter, None, adapter, None];
  - under the graph the adapter moves logprobs by more than 5e-2 (LoRA really applied);
  - the graph server's log shows `cuda graph: True` for some prefill batch AND for a lone LoRA
    request sent with nothing else in flight (guards against a vacuous pass);
  - decode graph: 32 greedy tokens with mixed adapters equal eager;
  - a batch of 40 adapter requests (~1160 tokens, under the 2048-token top bucket): replayed by the
    breakable graph on both LoRA backends (their segments have no request cap, only the bucket's
    tokens), eager on full (16 request slots); correct either way.
With two GPUs the same checks run at --tp-size 2 (the all-reduces captured inside the graphs) for
the default configuration, csgmv with the breakable prefill graph, against an eager tp-2 server.
"""

from __future__ import annotations

import os
import re
import tempfile
import time

import pytest
import requests
import torch

from server_helpers import kill_server, popen_launch_server

pytestmark = pytest.mark.gpu

GRAPH_VS_EAGER_TOLERANCE = 1e-2
LORA_EFFECT_THRESHOLD = 5e-2
LORA_NAME = "lora0"
PROMPTS = [
    "What is the capital of France?",
    "List three benefits of regular exercise. " * 8,
    "The quick brown fox jumps over the lazy dog. " * 40,
]
MIXED_PROMPTS = [
    "Summarize the plot of Romeo and Juliet.",
    "Explain how photosynthesis works. " * 6,
    "Write a haiku about the sea.",
    "Describe the water cycle in detail. " * 12,
]
MIXED_LORAS = [LORA_NAME, None, LORA_NAME, None]
BATCH_40 = [f"Request number {i}: tell me a fact about the number {i}." for i in range(40)]
GRAPH_LINE = re.compile(r"Prefill batch.*cuda graph: True")


def _assets() -> tuple[str, str]:
    """A peaked checkpoint a little larger than the CPU tests' (so bf16 GEMMs are realistic) and
    a rank-16 adapter on all seven modules written by peft."""
    root = os.environ.get("SGLANG_TEST_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "sglang-gpu-test")
    ckpt = os.path.join(root, "bcg-qwen3")
    adapter = os.path.join(root, "bcg-lora0")
    if not os.path.exists(os.path.join(ckpt, "config.json")):
        from sglang.srt.tools.make_checkpoint import make_checkpoint

        make_checkpoint(ckpt, arch="qwen3", preset="tiny", seed=7, with_weights=True,
                        num_hidden_layers=4, hidden_size=256, intermediate_size=512)
    if not os.path.exists(os.path.join(adapter, "adapter_config.json")):
        from transformers import AutoModelForCausalLM

        from lora_testlib import write_peft_adapter

        base = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        write_peft_adapter(adapter, r=16, base_model=base, seed=3, b_std=0.2)
    return ckpt, adapter


def _generate(base_url: str, text, lora, max_new_tokens: int = 0) -> list[dict]:
    resp = requests.post(
        f"{base_url}/generate",
        json={
            "text": text,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
            "return_logprob": True,
            "logprob_start_len": 0,
            "lora_path": lora,
        },
        timeout=120,
    )
    assert resp.status_code == 200, (resp.status_code, resp.text[:500])
    out = resp.json()
    return out if isinstance(out, list) else [out]


def _prompt_logprobs(item: dict) -> torch.Tensor:
    return torch.tensor([lp for lp, _, _ in item["meta_info"]["input_token_logprobs"][1:]], dtype=torch.float64)


def _output_ids(item: dict) -> list[int]:
    return [tok for _, tok, _ in item["meta_info"]["output_token_logprobs"]]


def _log_offsets(proc) -> dict[str, int]:
    return {p: os.path.getsize(p) for p in (proc.stdout_path, proc.stderr_path)}


def _read_log(proc, offsets: dict[str, int] | None = None) -> str:
    text = ""
    for path in (proc.stdout_path, proc.stderr_path):
        with open(path, "rb") as f:
            f.seek((offsets or {}).get(path, 0))
            text += f.read().decode("utf-8", errors="replace")
    return text


def _prefill_lines_since(proc, offsets: dict[str, int], wait_s: float = 30.0) -> list[str]:
    """Prefill log lines written after `offsets` (polls until some appear, up to wait_s)."""
    deadline = time.monotonic() + wait_s
    while True:
        lines = [ln for ln in _read_log(proc, offsets).splitlines() if "Prefill batch" in ln]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.5)


def _probe_lone_lora_request(proc, base_url: str) -> list[str]:
    """Send one LoRA request with nothing in flight; return the prefill log lines it produced."""
    last, stable_since = None, time.monotonic()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # wait until the log stops growing
        offsets = _log_offsets(proc)
        if offsets != last:
            last, stable_since = offsets, time.monotonic()
        elif time.monotonic() - stable_since > 1.0:
            break
        time.sleep(0.2)
    offsets = _log_offsets(proc)
    _generate(base_url, PROMPTS[0], LORA_NAME)
    return _prefill_lines_since(proc, offsets)


def _collect(proc, base_url: str, probe: bool) -> dict:
    res = {
        "lora": [_prompt_logprobs(_generate(base_url, p, LORA_NAME)[0]) for p in PROMPTS],
        "base": [_prompt_logprobs(_generate(base_url, p, None)[0]) for p in PROMPTS],
        "mixed": [_prompt_logprobs(x) for x in _generate(base_url, MIXED_PROMPTS, MIXED_LORAS)],
        "decode": [_output_ids(x) for x in _generate(base_url, MIXED_PROMPTS, MIXED_LORAS, max_new_tokens=32)],
    }
    offsets = _log_offsets(proc)
    res["batch40"] = [_prompt_logprobs(x) for x in _generate(base_url, BATCH_40, [LORA_NAME] * 40)]
    res["batch40_lines"] = _prefill_lines_since(proc, offsets)
    if probe:
        res["probe_lines"] = _probe_lone_lora_request(proc, base_url)
    res["log"] = _read_log(proc)
    return res


_CACHE: dict[tuple[str, str], dict] = {}


def _server_results(lora_backend: str, prefill_backend: str, tp_size: int = 1) -> dict:
    key = (lora_backend, prefill_backend, tp_size)
    if key not in _CACHE:
        ckpt, adapter = _assets()
        args = [
            "--lora-paths", f"{LORA_NAME}={adapter}", "--max-loras-per-batch", "2",
            "--lora-backend", lora_backend, "--dtype", "bfloat16", "--disable-radix-cache",
            "--random-seed", "42", "--enable-deterministic-inference",
            "--cuda-graph-max-bs-prefill", "2048", "--cuda-graph-max-bs-decode", "8",
            "--mem-fraction-static", "0.3", "--tp-size", str(tp_size),
        ]
        if prefill_backend == "disabled":
            args += ["--disable-cuda-graph"]
        else:
            args += ["--cuda-graph-backend-prefill", prefill_backend]
        proc, url = popen_launch_server(ckpt, other_args=args, env={"TRITON_INTERPRET": "0"}, timeout=600)
        try:
            _CACHE[key] = _collect(proc, url, probe=prefill_backend != "disabled")
        finally:
            kill_server(proc)
    return _CACHE[key]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max()) if a.numel() else 0.0


_TWO_GPUS = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
CONFIGS = [
    *[(1, lora, prefill) for lora in ("triton", "csgmv") for prefill in ("breakable", "full")],
    pytest.param(2, "csgmv", "breakable", marks=_TWO_GPUS, id="tp2-csgmv-breakable"),
]


@pytest.mark.parametrize("tp_size, lora_backend, prefill_backend", CONFIGS)
class TestLoRAUnderPrefillGraph:
    def test_prefill_graph_replay_logged(self, tp_size, lora_backend, prefill_backend):
        res = _server_results(lora_backend, prefill_backend, tp_size)
        assert GRAPH_LINE.search(res["log"]), "no prefill batch was served by the graph"

    def test_lone_lora_request_replays_prefill_graph(self, tp_size, lora_backend, prefill_backend):
        lines = _server_results(lora_backend, prefill_backend, tp_size)["probe_lines"]
        assert lines, "the probe request produced no prefill log line"
        assert any(GRAPH_LINE.search(ln) for ln in lines), f"LoRA request ran eagerly: {lines}"

    @pytest.mark.parametrize("kind", ["lora", "base", "mixed"])
    def test_prefill_logprobs_match_eager(self, tp_size, lora_backend, prefill_backend, kind):
        graph = _server_results(lora_backend, prefill_backend, tp_size)[kind]
        eager = _server_results(lora_backend, "disabled", tp_size)[kind]
        diffs = [_max_diff(g, e) for g, e in zip(graph, eager)]
        print(f"{lora_backend}/{prefill_backend}/{kind} max |graph - eager| per prompt: {diffs}")
        assert max(diffs) < GRAPH_VS_EAGER_TOLERANCE, diffs

    def test_lora_is_applied_under_graph(self, tp_size, lora_backend, prefill_backend):
        res = _server_results(lora_backend, prefill_backend, tp_size)
        effects = [_max_diff(a, b) for a, b in zip(res["lora"], res["base"])]
        print(f"{lora_backend}/{prefill_backend} max |lora - base| per prompt: {effects}")
        assert min(effects) > LORA_EFFECT_THRESHOLD, effects

    def test_decode_graph_greedy_matches_eager(self, tp_size, lora_backend, prefill_backend):
        graph = _server_results(lora_backend, prefill_backend, tp_size)["decode"]
        eager = _server_results(lora_backend, "disabled", tp_size)["decode"]
        assert all(len(g) == 32 for g in graph)
        assert graph == eager

    def test_batch_of_40_adapter_requests(self, tp_size, lora_backend, prefill_backend):
        res = _server_results(lora_backend, prefill_backend, tp_size)
        eager = _server_results(lora_backend, "disabled", tp_size)["batch40"]
        diffs = [_max_diff(g, e) for g, e in zip(res["batch40"], eager)]
        assert max(diffs) < GRAPH_VS_EAGER_TOLERANCE, diffs
        lines = res["batch40_lines"]
        big = [ln for ln in lines if int(re.search(r"#new-seq: (\d+)", ln).group(1)) > 32]
        if prefill_backend == "full":
            # More requests than the full graph's request slots: such a batch must run eagerly.
            assert all("cuda graph: False" in ln for ln in big), lines
        else:
            # The token-major backends (triton and csgmv) have no request cap, only the bucket's
            # tokens: a batch of more than 32 requests still replays.
            assert big and all("cuda graph: True" in ln for ln in big), lines
