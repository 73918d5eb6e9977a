"""KV memory: the allocator and pools, how ModelRunner sizes them, and how the batch builder
fills request rows."""

from __future__ import annotations

import pytest
import torch
from helpers import EngineDriver, make_runner, tiny_checkpoint

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
from sglang.srt.model_executor.batch_builder import (
    DecodeRequest,
    ExtendRequest,
    build_decode_batch,
    build_extend_batch,
    prompt_logprob_targets,
)
from sglang.srt.configs.forward_batch_info import ForwardMode


def test_allocator_never_hands_out_slot_zero() -> None:
    alloc = TokenToKVPoolAllocator(10)
    first = alloc.alloc(4)
    rest = alloc.alloc(6)
    assert sorted(torch.cat([first, rest]).tolist()) == list(range(1, 11))
    assert alloc.alloc(1) is None and alloc.available_size() == 0
    alloc.free(first[1:3])
    again = alloc.alloc(2)
    assert sorted(again.tolist()) == sorted(first[1:3].tolist())
    alloc.free(rest)
    alloc.free(again)
    assert 0 not in alloc.alloc(alloc.available_size()).tolist()
    with pytest.raises(AssertionError):
        alloc.free(torch.tensor([0, 3]))
    alloc.clear()
    assert alloc.available_size() == 10


def test_req_to_token_pool_rows() -> None:
    pool = ReqToTokenPool(3, 8, "cpu")
    rows = pool.alloc(2)
    assert rows == [0, 1] and pool.alloc(2) is None
    pool.write(rows[1], 2, torch.tensor([5, 6, 7]))
    assert pool.req_to_token[1].tolist() == [0, 0, 5, 6, 7, 0, 0, 0]
    pool.free(rows[0])
    assert pool.available_size() == 2


def test_kv_pool_stores_per_layer_and_casts() -> None:
    pool = MHATokenToKVPool(6, torch.float32, head_num=2, head_dim=4, layer_num=3, device="cpu")
    assert pool.k_buffer[0].shape == (7, 2, 4)  # slot 0 plus 6
    k = torch.randn(2, 8, dtype=torch.float64)
    pool.set_kv_buffer(1, torch.tensor([2, 5]), k, -k)
    torch.testing.assert_close(pool.get_key_buffer(1)[[2, 5]], k.float().view(2, 2, 4))
    torch.testing.assert_close(pool.get_value_buffer(1)[[2, 5]], -k.float().view(2, 2, 4))
    assert pool.get_key_buffer(0).abs().sum() == 0
    assert MHATokenToKVPool.bytes_per_token(torch.bfloat16, 2, 4, 3) == 2 * 3 * 2 * 4 * 2


def test_batch_builder_writes_rows_and_offsets() -> None:
    pool = ReqToTokenPool(4, 16, "cpu")
    pool.req_to_token[2, :3] = torch.tensor([11, 12, 13], dtype=torch.int32)  # a cached prefix
    reqs = [
        ExtendRequest(1, [7, 8], 0, torch.tensor([1, 2])),
        ExtendRequest(2, [9, 10, 11], 3, [3, 4, 5], return_logprob=True, logprob_start_len=1,
                      logprob_target_ids=[11], top_logprobs_num=2),
    ]
    fb = build_extend_batch(reqs, pool, "cpu")
    assert fb.forward_mode == ForwardMode.EXTEND and fb.batch_size == 2
    assert fb.input_ids.tolist() == [7, 8, 9, 10, 11]
    assert fb.positions.tolist() == [0, 1, 3, 4, 5]
    assert fb.out_cache_loc.tolist() == [1, 2, 3, 4, 5]
    assert fb.seq_lens.tolist() == [2, 6] and fb.seq_lens_cpu.tolist() == [2, 6]
    assert fb.extend_start_loc.tolist() == [0, 2] and fb.extend_num_tokens == 5
    assert fb.extend_prefix_lens_cpu == [0, 3] and fb.extend_seq_lens_cpu == [2, 3]
    assert pool.req_to_token[1, :3].tolist() == [1, 2, 0]
    assert pool.req_to_token[2, :7].tolist() == [11, 12, 13, 3, 4, 5, 0]
    assert fb.return_logprob and fb.return_logprob_per_req == [False, True]
    assert fb.extend_logprob_start_lens == [0, 1] and fb.extend_logprob_target_ids == [[], [11]]
    assert fb.lora_ids is None

    fb = build_decode_batch(
        [DecodeRequest(1, 42, 3, 6), DecodeRequest(2, 43, 7, 7, lora_id=None)], pool, "cpu", enable_lora=True
    )
    assert fb.forward_mode == ForwardMode.DECODE and fb.positions.tolist() == [2, 6]
    assert pool.req_to_token[1, 2] == 6 and pool.req_to_token[2, 6] == 7
    assert fb.lora_ids == [None, None] and not fb.return_logprob
    assert fb.input_ids.tolist() == [42, 43] and fb.out_cache_loc.tolist() == [6, 7]
    assert fb.req_pool_indices.tolist() == [1, 2] and fb.seq_lens.tolist() == [3, 7]
    assert fb.seq_lens_cpu.tolist() == [3, 7] and fb.seq_lens_cpu.data_ptr() != fb.seq_lens.data_ptr()
    assert all(t.dtype == torch.int64 for t in (fb.input_ids, fb.positions, fb.seq_lens, fb.seq_lens_cpu))
    with pytest.raises(ValueError, match="LoRA"):
        build_decode_batch([DecodeRequest(1, 1, 4, 8, lora_id="a")], pool, "cpu")
    for bad in (0, pool.max_context_len + 1):  # the message names the offending request
        with pytest.raises(ValueError, match=f"row 2: seq_len {bad} out of range"):
            build_decode_batch([DecodeRequest(1, 1, 4, 8), DecodeRequest(2, 1, bad, 9)], pool, "cpu")
    with pytest.raises(ValueError, match="KV slots"):
        build_extend_batch([ExtendRequest(1, [1, 2], 0, [1])], pool, "cpu")
    with pytest.raises(ValueError, match="context"):
        build_extend_batch([ExtendRequest(1, [1] * 4, 14, [1, 2, 3, 4])], pool, "cpu")


def test_prompt_logprob_targets() -> None:
    prompt = [10, 11, 12, 13, 14, 15]
    assert prompt_logprob_targets(prompt, 0, 6, 0) == (0, [11, 12, 13, 14, 15])
    # Two chunks: the last position of chunk 1 predicts the first token of chunk 2.
    assert prompt_logprob_targets(prompt, 0, 3, 0) == (0, [11, 12, 13])
    assert prompt_logprob_targets(prompt, 3, 3, 0) == (0, [14, 15])
    assert prompt_logprob_targets(prompt, 0, 3, 2) == (2, [13])
    assert prompt_logprob_targets(prompt, 3, 3, 4) == (1, [15])
    assert prompt_logprob_targets(prompt, 0, 3, 5) == (3, [])
    assert prompt_logprob_targets(prompt, 0, 6, 9) == (6, [])


def test_model_runner_sizes_pools_and_reserves_the_padding_row() -> None:
    path = tiny_checkpoint("qwen3")
    runner = make_runner(path, max_total_tokens=300, max_running_requests=5)
    cfg = runner.model_config
    assert runner.max_total_num_tokens == 300 and runner.max_running_requests == 5
    assert runner.token_to_kv_pool.k_buffer[0].shape == (301, cfg.num_key_value_heads, cfg.head_dim)
    assert len(runner.token_to_kv_pool.k_buffer) == cfg.num_hidden_layers
    assert runner.req_to_token_pool.req_to_token.shape == (6, runner.context_len + 8)
    # The padding row is taken: exactly max_running_requests rows are left for requests.
    assert runner.req_to_token_pool.available_size() == 5
    assert runner.padding_req_pool_index not in runner.req_to_token_pool.free_slots
    assert runner.sampler is not None and runner.lora_manager is None
    default = make_runner(path, max_total_tokens=None, max_running_requests=None, load_format="dummy")
    assert default.max_total_num_tokens == 16384 and default.max_running_requests == 4096


def test_slot_zero_stays_untouched_through_generation() -> None:
    runner = make_runner(tiny_checkpoint("qwen3"), max_total_tokens=200)
    driver = EngineDriver(runner)
    seqs = [driver.add([5, 6, 7, 8]), driver.add([9, 10])]
    out = driver.extend(seqs)
    for _ in range(3):
        for seq, t in zip(seqs, out.next_token_ids.tolist()):
            seq.tokens.append(t)
        out = driver.decode(seqs)
    used = torch.cat([s for seq in seqs for s in seq.slots])
    assert 0 not in used.tolist()
    for seq in seqs:
        row = runner.req_to_token_pool.req_to_token[seq.row, : seq.kv_len]
        assert (row > 0).all()
    for layer in range(runner.model_config.num_hidden_layers):
        assert runner.token_to_kv_pool.get_key_buffer(layer)[0].abs().sum() == 0
    for seq in seqs:
        driver.release(seq)
    assert runner.token_to_kv_pool_allocator.available_size() == 200


def test_the_host_twin_follows_every_write(monkeypatch):
    """A separate host twin (as on a GPU) gets every write, so the scheduler reads a request's KV
    slots without a device->host copy: row writes from host and device tensors, scattered writes
    with and without the builder's device copies."""
    from sglang.srt.mem_cache import memory_pool

    monkeypatch.setattr(memory_pool, "SEPARATE_HOST_TWIN", True)
    pool = ReqToTokenPool(4, 8, "cpu")
    assert pool.host is not pool.req_to_token
    pool.write(1, 2, torch.tensor([5, 6, 7]))
    pool.write(2, 0, torch.tensor([9, 8], dtype=torch.int32))
    rows, positions, locs = torch.tensor([1, 3, 3]), torch.tensor([5, 0, 7]), torch.tensor([11, 12, 13])
    pool.write_rows(rows, positions, locs)
    pool.write_rows(torch.tensor([0]), torch.tensor([1]), torch.tensor([21]),
                    (torch.tensor([0]), torch.tensor([1]), torch.tensor([21])))
    assert torch.equal(pool.host, pool.req_to_token)
    assert pool.slots([1, 3], 8).tolist() == [[0, 0, 5, 6, 7, 11, 0, 0], [12, 0, 0, 0, 0, 0, 0, 13]]
    assert pool.slots([3], 8).dtype == torch.int64
    assert pool.slots([1], 5, start=2).tolist() == [[5, 6, 7]]
    monkeypatch.setattr(memory_pool, "SEPARATE_HOST_TWIN", None)
    cpu_pool = ReqToTokenPool(2, 4, "cpu")
    assert cpu_pool.host is cpu_pool.req_to_token
