"""LoRA through a real server (`python -m sglang.launch_server`, CPU, float32) against HF + PEFT.

One server per (architecture, LoRA backend) -- Llama and Qwen3 (explicit head_dim, q/k norms), each
on torch_native, triton and csgmv -- with three PEFT adapters loaded at start (ranks 4, 8 and 16;
q/v only; all-linear rsLoRA); the servers start side by side. The Triton kernels run under
TRITON_INTERPRET=1, inherited by the server from the test process.

Checked per server: prompt logprobs of the base model and every adapter match HF(+PEFT) within
1e-4; a mixed batch (A, base, B, A) in ONE /generate call gives each request what it gets alone;
an unknown adapter gets 400 listing the loaded ones.
"""

from __future__ import annotations

import pytest

from lora_server_testlib import (
    ADAPTERS,
    PROMPTS,
    assert_close,
    greedy,
    hf_prompt_logprobs,
    post,
    served_prompt_logprobs,
    tiny_lora_checkpoint,
    write_adapters,
)
from server_helpers import read_log, servers_running, started

ATOL = 1e-4
COMBOS = [(arch, backend) for arch in ("llama", "qwen3") for backend in ("torch_native", "triton", "csgmv")]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict:
    """arch -> (checkpoint, {adapter name: path})."""
    out = {}
    for arch in sorted({a for a, _ in COMBOS}):
        ckpt = tiny_lora_checkpoint(arch)
        out[arch] = (ckpt, write_adapters(ckpt, str(tmp_path_factory.mktemp(f"adapters-{arch}"))))
    return out


@pytest.fixture(scope="module")
def servers(worlds, request):
    """(arch, backend) -> (process, url) for every combination the session runs, the servers
    started side by side (each start keeps about one core busy) and stopped together after the
    module."""
    selected = [getattr(item, "callspec", None) for item in request.session.items if item.module is request.module]
    wanted = [c for c in COMBOS if any(s is not None and s.params.get("served") == c for s in selected)]
    launches = []
    for arch, backend in wanted:
        ckpt, paths = worlds[arch]
        launches.append(dict(model=ckpt, other_args=[
            "--device", "cpu", "--dtype", "float32", "--lora-backend", backend,
            "--max-total-tokens", "4096", "--lora-paths", *[f"{n}={p}" for n, p in paths.items()],
        ]))
    with servers_running(*launches) as results:
        yield dict(zip(wanted, results))


@pytest.fixture(scope="module", params=COMBOS, ids=[f"{a}-{b}" for a, b in COMBOS])
def served(request, worlds, servers):
    arch, backend = request.param
    ckpt, paths = worlds[arch]
    proc, url = started(servers[request.param])  # or the error of its start
    assert proc.poll() is None, read_log(proc)[-3000:]
    return {"url": url, "ckpt": ckpt, "paths": paths, "arch": arch, "backend": backend}


def test_prompt_logprobs_match_hf_peft(served) -> None:
    names = [None, *ADAPTERS]
    # Every (adapter, prompt) pair, as one batched call: all four pool users in one forward.
    pairs = [(name, p) for name in names for p in (PROMPTS[0], PROMPTS[3])]
    got = served_prompt_logprobs(served["url"], [p for _, p in pairs], [n for n, _ in pairs])
    for (name, prompt), lp in zip(pairs, got):
        path = None if name is None else served["paths"][name]
        want = hf_prompt_logprobs(served["ckpt"], path, prompt)
        assert_close(lp, want, ATOL, f"{served['arch']}/{served['backend']} adapter {name}")
        if name is not None:  # the adapter must move the logprobs, or the comparison proves nothing
            base = hf_prompt_logprobs(served["ckpt"], None, prompt)
            assert max(abs(a - b) for a, b in zip(want, base)) > 5e-2, name


def test_mixed_batch_equals_each_request_alone(served) -> None:
    url = served["url"]
    loras = ["r4", None, "rs16", "r4"]
    prompts = PROMPTS[:4]
    body = {
        "input_ids": prompts, "lora_path": loras, "return_logprob": True, "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
    }
    r = post(url, "/generate", body)
    assert r.status_code == 200, r.text
    together = r.json()
    for out, ids, lora in zip(together, prompts, loras):
        alone = greedy(url, ids, lora, n=5)
        meta = out["meta_info"]
        assert out["output_ids"] == alone["ids"], lora
        assert_close([e[0] for e in meta["input_token_logprobs"][1:]], [e[0] for e in alone["input"][1:]],
                     ATOL, f"prompt logprobs of {lora} in the mixed batch")
        assert_close([e[0] for e in meta["output_token_logprobs"]], [e[0] for e in alone["output"]],
                     ATOL, f"output logprobs of {lora} in the mixed batch")
    # Two requests for the same adapter in one batch got the same adapter.
    assert together[0]["meta_info"].get("lora_path") == together[3]["meta_info"].get("lora_path") == "r4"


def test_unknown_adapter_is_a_400_listing_the_loaded_ones(served) -> None:
    r = post(served["url"], "/generate", {"text": ["hello", "there"], "lora_path": ["r4", "nope"]})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "nope" in message and all(name in message for name in ADAPTERS), message
