"""The two graph sets of a LoRA server, and the wider LoRA prefill buckets, in process (GPU only).

A LoRA runner with the default bucket ladders (`--chunked-prefill-size 4096`: the set with LoRA
kernels goes up to 4096 tokens, the set without them up to 2048) against an eager runner on the
same peaked tiny checkpoint and adapters (bf16, triton attention). For the triton and csgmv LoRA
backends:
  - in alternation, an all-base batch replays the set without LoRA kernels and an adapter batch
    the set with them (the replay counters say which), prefill and decode, each bit-equal to eager
    (token counts that fill their bucket exactly, so graph and eager run the same GEMM shapes);
  - a 3000-token prefill of two adapter requests (above the former 2048-token top bucket, and above
    the checkpoint's 2048-token context, so its bucket was captured as two requests) replays the
    3072 bucket, matches eager and is moved by the adapter;
  - breakable graphs borrow their break inputs and share their break outputs: graph memory does not
    grow with the sum of the buckets.
"""

from __future__ import annotations

import functools
import tempfile

import pytest
import torch

from helpers import hf_model, make_runner, tiny_checkpoint
from lora_testlib import write_peft_adapter
from test_graph_runners_gpu import _prompts, greedy, max_diff, prompt_logprobs as prefill

from sglang.srt.configs.cuda_graph_config import Backend

pytestmark = pytest.mark.gpu

TOL = 1e-2
LORA_EFFECT = 5e-2


@functools.lru_cache(maxsize=None)
def assets() -> tuple[str, str]:
    root = tempfile.mkdtemp(prefix="sglang-graph-sets-")
    ckpt = tiny_checkpoint("qwen3", hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    return ckpt, write_peft_adapter(f"{root}/a", r=16, base_model=hf_model(ckpt), seed=31, b_std=0.2)


@functools.lru_cache(maxsize=None)
def runner(lora_backend: str, graphs: bool):
    ckpt, adapter = assets()
    cfg = dict(disable_cuda_graph=False, chunked_prefill_size=4096) if graphs else dict(disable_cuda_graph=True)
    return make_runner(ckpt, device="cuda", dtype="bfloat16", attention_backend="triton", max_total_tokens=16384,
                       max_running_requests=32, lora_paths=[f"a={adapter}"], max_loras_per_batch=2,
                       lora_backend=lora_backend, enable_deterministic_inference=True, **cfg)


@pytest.mark.parametrize("lora_backend", ["triton", "csgmv"])
def test_default_ladders_of_the_two_sets(lora_backend):
    g = runner(lora_backend, True)
    assert g.prefill_graph_runner.capture_lora and not g.base_prefill_graph_runner.capture_lora
    assert g.prefill_graph_runner.buckets[-1] == 4096 and g.base_prefill_graph_runner.buckets[-1] == 2048
    assert g.decode_graph_runner.capture_lora and not g.base_decode_graph_runner.capture_lora


@pytest.mark.parametrize("lora_backend", ["triton", "csgmv"])
def test_sets_alternate_and_equal_eager_bit_for_bit(lora_backend):
    g, e = runner(lora_backend, True), runner(lora_backend, False)
    prompts = _prompts([20, 44], seed=1)  # 64 tokens: a bucket of the default ladder, no padding
    for round_ in range(2):
        for names in ([None, None], ["a", None], ["a", "a"], [None, None]):
            stats = g.graph_stats()
            got, used = prefill(g, prompts, names)
            after = g.graph_stats()
            want, _ = prefill(e, prompts, names)
            base_batch = names == [None, None]
            assert used and after["prefill_graph_replays"] == stats["prefill_graph_replays"] + 1
            took_base_set = after["base_prefill_graph_replays"] == stats["base_prefill_graph_replays"] + 1
            assert took_base_set is base_batch, (names, stats, after)
            diff = max_diff(got, want)
            print(f"{lora_backend} round {round_} {names}: max |graph - eager| = {diff:.3e}")
            assert diff == 0.0, (names, diff)
    lora, _ = prefill(g, prompts, ["a", "a"])
    base, _ = prefill(g, prompts, [None, None])
    assert max_diff(lora, base) > LORA_EFFECT  # the adapter is applied under the LoRA set
    # Decode: 4 requests (a decode bucket), all base then mixed, every step replayed.
    prompts = _prompts([9, 30, 14, 5], seed=2)
    for names in ([None] * 4, ["a", None, "a", None]):
        stats = g.graph_stats()
        got, used = greedy(g, prompts, names, steps=12)
        after = g.graph_stats()
        want, _ = greedy(e, prompts, names, steps=12)
        assert all(used) and got == want, names
        base_replays = after["base_decode_graph_replays"] - stats["base_decode_graph_replays"]
        assert base_replays == (12 if names == [None] * 4 else 0), (names, base_replays)


@pytest.mark.parametrize("lora_backend", ["triton", "csgmv"])
def test_serving_size_lora_prefill_replays_above_the_old_top_bucket(lora_backend):
    g, e = runner(lora_backend, True), runner(lora_backend, False)
    prompts = _prompts([1800, 1200], seed=3)  # 3000 tokens -> the 3072 bucket
    got, used = prefill(g, prompts, ["a", "a"])
    want, _ = prefill(e, prompts, ["a", "a"])
    assert used, "the 3000-token LoRA prefill ran eagerly"
    diff = max_diff(got, want)
    print(f"{lora_backend} 3000 tokens: max |graph - eager| = {diff:.3e}")
    assert diff < TOL
    base, _ = prefill(g, prompts, [None, None])  # above the set without LoRA (2048): eager
    assert max_diff(got, base) > LORA_EFFECT


def test_graph_memory_does_not_grow_with_the_bucket_sum():
    """One 4096-token bucket vs ten buckets summing to ~13k tokens: with break inputs borrowed and
    break outputs shared, the ladder costs about what its largest bucket costs."""
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner

    ckpt, _ = assets()
    r = make_runner(ckpt, device="cuda", dtype="bfloat16", attention_backend="triton", max_total_tokens=16384,
                    max_running_requests=32, disable_cuda_graph=True)
    r.graph_capture_stream = torch.cuda.Stream(r.device)
    cfg = r.config.cuda_graph.prefill

    def graph_bytes(buckets: list[int]) -> int:
        import gc

        cfg.bs = buckets
        r.graph_memory_pool = torch.cuda.graph_pool_handle()
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # what an earlier measurement cached must not be reused unseen
        before = torch.cuda.memory_reserved()
        with torch.no_grad():
            runner_ = PrefillCudaGraphRunner(r, Backend.BREAKABLE, capture_lora=False)
        torch.cuda.synchronize()
        used = torch.cuda.memory_reserved() - before
        del runner_
        r.graph_memory_pool = None
        return used

    one = graph_bytes([4096])
    ladder = graph_bytes([256, 384, 512, 768, 1024, 1536, 2048, 2560, 3072, 4096])
    print(f"breakable graph memory: 1 bucket {one / 2**20:.1f} MiB, 10 buckets {ladder / 2**20:.1f} MiB")
    assert ladder < 1.5 * one + (16 << 20)
