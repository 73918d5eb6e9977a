"""The one decision per forward on a LoRA server with two graph sets, on the CPU.

`ModelRunner.choose_forward_path` picks the path and whether LoRA kernels run; `prepare` hands the
same plan to `LoRAManager.prepare_forward`. The graph runners here are the real classes,
built with `capture=False` (no CUDA graph can run on a CPU), so their eligibility rules are the
ones the GPU uses; nothing is replayed. Checked, for the triton and csgmv LoRA backends:
  - an all-base batch (prefill or decode) takes the set without LoRA kernels: the backend's
    `batch_info` is cleared and no static LoRA metadata is touched;
  - a batch with an adapter takes the set with LoRA kernels, and exactly that set's static
    metadata is refreshed in place (prefill info for prefill, decode info for decode);
  - a batch no set can serve runs eagerly, with LoRA (a fresh eager info) or without (cleared);
  - eagerly, an all-base batch on the LoRA server gives the logits of a server without LoRA bit for
    bit, and a mixed batch moves only its adapter request.
"""

from __future__ import annotations

import pytest
import torch
from helpers import hf_model, make_runner, tiny_checkpoint
from lora_testlib import write_peft_adapter

from sglang.srt.model_executor.batch_builder import (
    DecodeRequest,
    ExtendRequest,
    build_decode_batch,
    build_extend_batch,
)
from sglang.srt.configs.cuda_graph_config import Backend
from sglang.srt.configs.forward_path import ForwardPath, ForwardPlan
from sglang.srt.model_executor.runner.cuda_graph_runner import CudaGraphRunner
from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner

PREFILL_BUCKETS = [8, 16, 32]
DECODE_BUCKETS = [1, 2, 4]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    ckpt = tiny_checkpoint("llama", hidden_size=64, intermediate_size=128)
    path = write_peft_adapter(str(tmp_path_factory.mktemp("graph-sets") / "a"), r=8, base_model=hf_model(ckpt),
                              b_std=0.3)
    return ckpt, path


def runner_with_graph_sets(assets, backend: str):
    ckpt, path = assets
    mr = make_runner(ckpt, lora_paths=[f"a={path}"], lora_backend=backend, max_running_requests=32,
                     cuda_graph_bs_prefill=PREFILL_BUCKETS, cuda_graph_bs_decode=DECODE_BUCKETS)
    # What ModelRunner.init_cuda_graphs builds on a GPU, minus the capture.
    mr.prefill_graph_runner = PrefillCudaGraphRunner(mr, Backend.BREAKABLE, capture_lora=True, capture=False)
    mr.base_prefill_graph_runner = PrefillCudaGraphRunner(mr, Backend.BREAKABLE, capture_lora=False, capture=False)
    mr.decode_graph_runner = CudaGraphRunner(mr, Backend.BREAKABLE, capture_lora=True, capture=False)
    mr.base_decode_graph_runner = CudaGraphRunner(mr, Backend.BREAKABLE, capture_lora=False, capture=False)
    return mr, next(iter(mr.lora_manager.refs))


def extend(mr, lens, lora_ids):
    reqs = []
    for n, lid in zip(lens, lora_ids):
        row = mr.req_to_token_pool.alloc(1)[0]
        ids = [(7 * i + 3 * n) % 200 + 3 for i in range(n)]
        reqs.append(ExtendRequest(row, ids, 0, mr.token_to_kv_pool_allocator.alloc(n), lora_id=lid))
    return build_extend_batch(reqs, mr.req_to_token_pool, mr.device, enable_lora=mr.lora_manager is not None)


def decode(mr, lora_ids):
    reqs = []
    for i, lid in enumerate(lora_ids):
        row = mr.req_to_token_pool.alloc(1)[0]
        slots = mr.token_to_kv_pool_allocator.alloc(4)
        mr.req_to_token_pool.write(row, 0, slots)
        reqs.append(DecodeRequest(row, 5 + i, 4, int(slots[-1]), lora_id=lid))
    return build_decode_batch(reqs, mr.req_to_token_pool, mr.device, enable_lora=True)


def snapshot(info) -> list[torch.Tensor]:
    return [t.clone() for t in (info.permutation, info.seg_indptr, info.weight_indices, info.lora_ranks, info.scalings)]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("backend", ["triton", "csgmv"])
def test_each_batch_takes_one_set_and_refreshes_only_its_metadata(assets, backend):
    mr, a = runner_with_graph_sets(assets, backend)
    lora_backend = mr.lora_manager.lora_backend
    prefill_info, decode_info = lora_backend.prefill_cuda_graph_batch_info, lora_backend.cuda_graph_batch_info
    assert prefill_info is not None and decode_info is not None  # the LoRA set initialised them

    # An adapter prefill: the LoRA set, its static prefill info written in place.
    plan = mr.prepare(extend(mr, [5, 6], [a, None]))
    assert plan == ForwardPlan(ForwardPath.PREFILL_GRAPH, lora=True)
    assert lora_backend.batch_info is prefill_info
    slot = mr.lora_manager.pool.get_slot(a)
    assert int(prefill_info.lora_ranks[slot]) == 8
    before = snapshot(prefill_info), snapshot(decode_info)

    # All-base prefill and decode: the set without LoRA; nothing static is touched.
    for fb, path in ((extend(mr, [9, 4], [None, None]), ForwardPath.PREFILL_GRAPH), (decode(mr, [None] * 3), ForwardPath.DECODE_GRAPH)):
        plan = mr.prepare(fb)
        assert plan == ForwardPlan(path, lora=False)
        assert lora_backend.batch_info is None
        assert same(snapshot(prefill_info), before[0]) and same(snapshot(decode_info), before[1])
    stats = mr.graph_stats()
    assert stats["eager_prefills"] == stats["eager_decodes"] == 0

    # An adapter decode: the LoRA set's decode info, and only it.
    plan = mr.prepare(decode(mr, [None, a, a]))
    assert plan == ForwardPlan(ForwardPath.DECODE_GRAPH, lora=True) and lora_backend.batch_info is decode_info
    assert int(decode_info.lora_ranks[slot]) == 8 and not same(snapshot(decode_info), before[1])
    assert same(snapshot(prefill_info), before[0])
    refreshes, writes = mr.graph_stats()["lora_metadata_refreshes"], mr.graph_stats()["lora_metadata_writes"]
    mr.prepare(decode(mr, [None, a, a]))  # the same batch again: refreshed, nothing written
    assert (mr.graph_stats()["lora_metadata_refreshes"], mr.graph_stats()["lora_metadata_writes"]) == (
        refreshes + 1, writes)

    # Too many tokens for either set: eager, with LoRA (a fresh info) or without (cleared).
    plan = mr.prepare(extend(mr, [30, 10], [a, None]))
    assert plan == ForwardPlan(ForwardPath.EAGER, lora=True)
    assert lora_backend.batch_info is not None and not lora_backend.batch_info.use_cuda_graph
    plan = mr.prepare(extend(mr, [30, 10], [None, None]))
    assert plan == ForwardPlan(ForwardPath.EAGER, lora=False) and lora_backend.batch_info is None
    assert mr.graph_stats()["eager_prefills"] == 2
    assert same(snapshot(prefill_info), before[0])


def test_eager_all_base_batch_matches_a_server_without_lora(assets):
    ckpt, _ = assets
    mr, a = runner_with_graph_sets(assets, "csgmv")
    plain = make_runner(ckpt, max_running_requests=32)
    lens = [30, 11]  # 41 tokens: above every bucket, so eager
    base = mr.forward_logits(extend(mr, lens, [None, None])).next_token_logits
    assert mr.lora_manager.lora_backend.batch_info is None
    ref = plain.forward_logits(extend(plain, lens, [None, None])).next_token_logits
    assert torch.equal(base, ref)
    mixed = mr.forward_logits(extend(mr, lens, [a, None])).next_token_logits
    # The base request of a mixed batch: untouched, up to the summation order of the folded GEMM
    # (its row of [x | 0] times [W | B] adds exact zeros, in a longer reduction).
    torch.testing.assert_close(mixed[1], ref[1], rtol=0, atol=1e-4)
    assert (mixed[0] - ref[0]).abs().max() > 1e-3  # the adapter request: moved
