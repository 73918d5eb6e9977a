"""Helpers for the server-level LoRA tests: tiny checkpoints (hidden 64), PEFT adapters written by
`peft` itself, HF+PEFT reference logprobs, and thin `/generate` / adapter-endpoint clients."""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Optional, Sequence

import requests
import torch

from lora_testlib import write_peft_adapter
from helpers import hf_model
from server_helpers import tiny_checkpoint

# name -> write_peft_adapter kwargs: ranks 4, 8 and 16; one on q/v only, one on all-linear (rsLoRA).
ADAPTERS: dict[str, dict[str, Any]] = {
    "r4": dict(r=4, seed=11),
    "qv8": dict(r=8, target_modules=["q_proj", "v_proj"], seed=12, b_std=0.05),
    "rs16": dict(r=16, lora_alpha=8, target_modules="all-linear", use_rslora=True, seed=13),
}

# Prompts as token ids (the tiny vocabulary has 512 entries), of a few lengths.
PROMPTS: list[list[int]] = [
    [(i * 37 + 11 * k) % 500 + 3 for i in range(n)] for k, n in enumerate((9, 14, 6, 17))
]

TIMEOUT = 300


def tiny_lora_checkpoint(arch: str) -> str:
    """A tiny random checkpoint with hidden size 64 (tokenizer included), built once per machine."""
    return tiny_checkpoint(arch, hidden_size=64, intermediate_size=128)


def write_adapter(ckpt: str, out_dir: str, **kwargs: Any) -> str:
    """A PEFT adapter for `ckpt`. peft injects its layers into the model it is given, so every
    adapter gets a fresh base model."""
    return write_peft_adapter(out_dir, base_model=hf_model(ckpt), **kwargs)


# Modules of the refusal tests' pool (down_proj left out, so an adapter on it is refused).
POOL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]


def zoo_server_launch(lora_ckpt: str, adapter_zoo: dict[str, str], module: Any) -> dict:
    """server_helpers.popen_launch_server's arguments for conftest's `zoo_server` (a module that
    starts it beside other servers with launch_servers takes them from here): a CPU server
    (float32, torch_native LoRA) whose pool fits the zoo's good adapters (3 slots, rank 16,
    POOL_MODULES), serving `keep` from the start, with the module's ZOO_SERVER_FLAGS."""
    return dict(model=lora_ckpt, other_args=[
        "--device", "cpu", "--dtype", "float32", "--lora-backend", "torch_native",
        "--max-loras-per-batch", "3", "--max-lora-rank", "16", "--lora-target-modules", *POOL_MODULES,
        "--lora-paths", f"keep={adapter_zoo['keep']}", *getattr(module, "ZOO_SERVER_FLAGS", ()),
    ])


def write_adapter_zoo(ckpt: str, root: str, seed: int) -> dict[str, str]:
    """Adapters for load/refusal tests against a pool of rank 16 on POOL_MODULES: the loadable
    `keep` (r8 q/v) and `good` (r16 on the pool's modules), and one adapter per refusal reason:
    rank32, down (a module outside the pool), dora, modules_to_save, rank_pattern, added_tokens,
    no_config, bad_config, zero_rank, nan_alpha, huge_alpha, no_weights, truncated, wrong_shape."""
    import shutil

    from lora_testlib import edit_adapter_config
    from safetensors.torch import load_file, save_file

    paths = {
        "keep": write_adapter(ckpt, f"{root}/keep", r=8, target_modules=["q_proj", "v_proj"], seed=seed),
        "good": write_adapter(ckpt, f"{root}/good", r=16, target_modules=POOL_MODULES, seed=seed + 1),
        "rank32": write_adapter(ckpt, f"{root}/rank32", r=32, target_modules=["q_proj"], seed=seed + 2),
        "down": write_adapter(ckpt, f"{root}/down", r=4, target_modules=["down_proj"], seed=seed + 3),
    }

    def variant(name: str, change=None, **config: Any) -> None:
        path = paths[name] = f"{root}/{name}"
        shutil.copytree(paths["good"], path)
        if config:
            edit_adapter_config(path, **config)
        if change is not None:
            change(path)

    def truncate(path: str) -> None:
        file = f"{path}/adapter_model.safetensors"
        with open(file, "rb") as f:
            data = f.read()
        with open(file, "wb") as f:
            f.write(data[: len(data) // 2])

    def reshape(path: str) -> None:  # one lora_A with a wrong input width, as if for another base model
        file = f"{path}/adapter_model.safetensors"
        tensors = load_file(file)
        name = next(k for k in sorted(tensors) if k.endswith("q_proj.lora_A.weight"))
        tensors[name] = tensors[name][:, :48].contiguous()
        save_file(tensors, file)

    def add_tokens(path: str) -> None:
        with open(f"{path}/added_tokens.json", "w") as f:
            json.dump({"<new-token>": 600}, f)  # beyond the base vocabulary of 512

    def write_text(name: str, text: str):
        def change(path: str) -> None:
            with open(f"{path}/{name}", "w") as f:
                f.write(text)
        return change

    variant("dora", use_dora=True)
    variant("modules_to_save", modules_to_save=["lm_head"])
    variant("rank_pattern", rank_pattern={"q_proj": 4})
    variant("added_tokens", add_tokens)
    variant("no_config", lambda p: os.remove(f"{p}/adapter_config.json"))
    variant("bad_config", write_text("adapter_config.json", '{"r": 16,'))
    variant("zero_rank", r=0)
    variant("nan_alpha", lora_alpha=float("nan"))
    variant("huge_alpha", lora_alpha=1e300)
    variant("no_weights", lambda p: os.remove(f"{p}/adapter_model.safetensors"))
    variant("truncated", truncate)
    variant("wrong_shape", reshape)
    return paths


def write_adapters(ckpt: str, root: str, specs: Optional[dict[str, dict[str, Any]]] = None) -> dict[str, str]:
    specs = ADAPTERS if specs is None else specs
    return {name: write_adapter(ckpt, os.path.join(root, name), **kw) for name, kw in specs.items()}


@functools.lru_cache(maxsize=None)
def _hf_lora_model(ckpt: str, adapter_path: Optional[str]):
    from peft import PeftModel

    model = hf_model(ckpt)
    if adapter_path is not None:
        model = PeftModel.from_pretrained(model, adapter_path).eval()
    return model


@torch.no_grad()
def hf_prompt_logprobs(ckpt: str, adapter_path: Optional[str], ids: Sequence[int]) -> list[float]:
    """HF(+PEFT) float32 logprob of prompt token t given tokens < t, for t = 1..len-1."""
    logits = _hf_lora_model(ckpt, adapter_path)(input_ids=torch.tensor([list(ids)])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist()


# ---------------------------------------------------------------------------- HTTP
def post(url: str, path: str, body: Any, timeout: float = TIMEOUT) -> requests.Response:
    return requests.post(f"{url}{path}", json=body, timeout=timeout)


def generate(url: str, body: dict) -> Any:
    r = post(url, "/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def served_prompt_logprobs(url: str, prompts: list[list[int]], loras: list[Optional[str]]) -> list[list[float]]:
    """Prompt logprobs of a batch in ONE /generate call (prefill only)."""
    outs = generate(url, {
        "input_ids": prompts, "lora_path": loras, "return_logprob": True, "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 0},
    })
    result = []
    for out, ids in zip(outs, prompts):
        entries = out["meta_info"]["input_token_logprobs"]
        assert [e[1] for e in entries] == list(ids) and entries[0][0] is None
        result.append([e[0] for e in entries[1:]])
    return result


def greedy(url: str, ids: list[int], lora: Optional[str], n: int = 6) -> dict:
    """Greedy tokens and their logprobs (plus prompt logprobs): a probe whose every number must
    repeat exactly when nothing about the adapter changed."""
    out = generate(url, {
        "input_ids": ids, "lora_path": lora, "return_logprob": True, "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
    })
    meta = out["meta_info"]
    return {"ids": out["output_ids"], "input": meta["input_token_logprobs"], "output": meta["output_token_logprobs"]}


def load_adapter(url: str, name: str, path: str, pinned: bool = False, prefix: str = "") -> requests.Response:
    return post(url, f"{prefix}/load_lora_adapter", {"lora_name": name, "lora_path": path, "pinned": pinned})


def unload_adapter(url: str, name: str, prefix: str = "") -> requests.Response:
    return post(url, f"{prefix}/unload_lora_adapter", {"lora_name": name})


def assert_unload_waits(url: str, unload: dict) -> None:
    """An unload (its reply in `unload["r"]` once it answered) has not answered while its adapter's
    request still runs in the scheduler.

    What a client has read of that request's stream says nothing about it: the server's events wait
    in socket buffers, and on a slow machine the test's own requests take long enough for the whole
    generation to end meanwhile. So ask the scheduler, after looking at the unload: an answer seen
    first and a request still running afterwards is the violation.
    """
    answered = "r" in unload
    running = server_info(url)["num_running_reqs"]
    assert not (answered and running), "the unload answered while its adapter's request ran"


def model_ids(url: str) -> list[str]:
    r = requests.get(f"{url}/v1/models", timeout=30)
    assert r.status_code == 200, r.text
    return [m["id"] for m in r.json()["data"]]


def server_info(url: str) -> dict:
    r = requests.get(f"{url}/get_server_info", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def lora_info(url: str) -> dict:
    return server_info(url)["lora"]


def stream_generate(url: str, body: dict) -> dict:
    """Stream a /generate request to its end; returns the last event."""
    r = requests.post(f"{url}/generate", json={**body, "stream": True}, stream=True, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    last = None
    for line in r.iter_lines(decode_unicode=True):
        if line.startswith("data: ") and line != "data: [DONE]":
            last = json.loads(line[6:])
    assert last is not None and "error" not in last, last
    return last


def assert_same_answer(got: dict, want: dict, atol: float = 1e-5, what: str = "") -> None:
    """Two `greedy` probes agree: the same tokens, logprobs equal up to float32 rounding (a request
    batched with different neighbours runs matmuls of other shapes, which may round differently)."""
    assert got["ids"] == want["ids"], what
    for key in ("input", "output"):
        assert [e[1] for e in got[key]] == [e[1] for e in want[key]], what
        diffs = [abs(a[0] - b[0]) for a, b in zip(got[key], want[key]) if a[0] is not None or b[0] is not None]
        assert max(diffs, default=0.0) <= atol, f"{what}: {key} logprobs differ by {max(diffs):.3g}"


def assert_close(got: list[float], want: list[float], atol: float, what: str) -> None:
    diff = (torch.tensor(got) - torch.tensor(want)).abs().max().item()
    assert diff <= atol, f"{what}: max |served - reference| = {diff:.3g} > {atol}"
