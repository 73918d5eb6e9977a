"""CPU checks of the prefill-graph rules: bucket ladder, default caps, bucket choice, padding
refusal, the static input buffers (what a replay writes into them, and what the padded tail holds),
capture batches valid for the model's context length, and the shared buffer of break outputs."""

import dataclasses

import pytest
import torch

from sglang.srt.configs.cuda_graph_config import (
    default_prefill_graph_cap,
    fillable_buckets,
    prefill_bucket_ladder,
)
from sglang.srt.model_executor.runner.breakable_cuda_graph import BreakOutputs
from sglang.srt.configs.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.model_executor.runner.graph_buffers import (
    MAX_PADDING_FACTOR,
    GraphInputBuffers,
    pick_bucket,
    prefill_replay_bucket,
)


def test_ladder_is_sorted_unique_and_capped():
    for cap in (1, 7, 100, 1024, 2048, 8192):
        ladder = prefill_bucket_ladder(cap)
        assert ladder == sorted(set(ladder))
        assert ladder[0] == 1 and ladder[-1] == cap
    assert prefill_bucket_ladder(1024)[:4] == [1, 2, 4, 8]
    # Lean: few graphs to capture, coarse above 2048.
    assert len(prefill_bucket_ladder(2048)) == 23 and len(prefill_bucket_ladder(8192)) == 31
    assert prefill_bucket_ladder(8192)[-8:] == [2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192]
    ladder = prefill_bucket_ladder(16384)
    for small, big in zip(ladder, ladder[1:]):  # above 256 tokens a bucket pads by at most 25%
        assert big <= 2 * small and (big <= 256 or 4 * big <= 5 * small), (small, big)


def test_default_caps_serving_size_with_lora_2048_without():
    # --chunked-prefill-size 8192 (default), --max-prefill-tokens 16384 (default)
    assert default_prefill_graph_cap(8192, 16384, with_lora=True) == 8192
    assert default_prefill_graph_cap(8192, 16384, with_lora=False) == 2048
    assert default_prefill_graph_cap(4096, 16384, with_lora=True) == 4096  # never above the chunk
    assert default_prefill_graph_cap(8192, 1000, with_lora=True) == 1000  # nor the prefill budget
    assert default_prefill_graph_cap(-1, 16384, with_lora=True) == 8192  # chunking off: capped
    assert default_prefill_graph_cap(512, 16384, with_lora=False) == 512


def test_fillable_buckets_drop_what_no_batch_can_fill():
    buckets = [64, 256, 1024, 4096]
    assert fillable_buckets(buckets, None, 128) == buckets  # breakable, no LoRA: any request count
    assert fillable_buckets(buckets, 32, 128) == [64, 256, 1024, 4096]  # 32 x 128 >= 4096
    assert fillable_buckets(buckets, 16, 128) == [64, 256, 1024]  # a full graph's 16 slots
    assert fillable_buckets(buckets, 1, 300) == [64, 256]


def test_pick_bucket_is_the_smallest_that_fits():
    buckets = [4, 8, 16, 64]
    assert [pick_bucket(buckets, n) for n in (1, 4, 5, 16, 17, 64, 65)] == [4, 4, 8, 16, 64, 64, None]


def test_prefill_replay_bucket_refuses_overflow_and_excess_padding():
    buckets = [4, 8, 16, 64]
    assert prefill_replay_bucket(buckets, 3) == 4
    assert prefill_replay_bucket(buckets, 2) == 4  # exactly 2x padding is allowed
    assert prefill_replay_bucket(buckets, 1) is None  # 4 > 2 * 1
    assert prefill_replay_bucket(buckets, 32) == 64
    assert prefill_replay_bucket(buckets, 31) is None  # 64 > 62: eager
    assert prefill_replay_bucket(buckets, 65) is None  # above the largest bucket
    assert prefill_replay_bucket(buckets, 0) is None
    ladder = prefill_bucket_ladder(2048)
    for n in range(1, 2049):
        b = prefill_replay_bucket(ladder, n)
        assert b is not None and n <= b <= MAX_PADDING_FACTOR * n, n  # the default ladder never refuses


def _live_batch(n_tokens: int) -> ForwardBatch:
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=1,
        input_ids=torch.arange(100, 100 + n_tokens),
        positions=torch.arange(5, 5 + n_tokens),
        out_cache_loc=torch.arange(40, 40 + n_tokens),
        req_pool_indices=torch.tensor([3]),
        seq_lens=torch.tensor([5 + n_tokens]),
        seq_lens_cpu=torch.tensor([5 + n_tokens]),
        extend_num_tokens=n_tokens,
    )


def test_load_tokens_pads_with_the_dummy_slot():
    bufs = GraphInputBuffers.allocate(16, 4, torch.device("cpu"), dummy_req_row=0)
    bufs.load_tokens(_live_batch(12), 16)  # a larger batch leaves values behind...
    bufs.load_tokens(_live_batch(5), 8)  # ...the smaller one must neutralise its own padding
    assert bufs.input_ids[:5].tolist() == list(range(100, 105))
    assert bufs.out_cache_loc[:5].tolist() == list(range(40, 45))
    assert bufs.positions[:5].tolist() == list(range(5, 10))
    for t in (bufs.input_ids, bufs.positions, bufs.out_cache_loc):
        assert t[5:8].tolist() == [0, 0, 0]  # pad tokens: token 0, position 0, KV slot 0


def test_load_tokens_copies_a_packed_batch_in_one_block(monkeypatch):
    """Back-to-back token vectors (what the batch builders' one packed copy produces) load with one
    [3, n] copy and one padding fill; separate ones with a copy each; the values are the same."""
    from sglang.srt.utils import stacked_view

    packed = torch.cat([torch.arange(100, 105), torch.arange(5, 10), torch.arange(40, 45)])
    ids, pos, locs = packed.split([5, 5, 5])
    assert stacked_view(ids, pos, locs).tolist() == [list(range(100, 105)), list(range(5, 10)), list(range(40, 45))]
    assert stacked_view(pos, ids, locs) is None and stacked_view(ids, locs) is None  # order, gaps
    assert stacked_view(ids, torch.arange(5, 10)) is None  # another storage
    assert stacked_view(ids, pos.to(torch.int32)) is None and stacked_view(ids, packed[5:9]) is None
    calls = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, **kw: (calls.append(self.shape), real_copy(self, src, **kw))[1])
    results = []
    for fb in (dataclasses.replace(_live_batch(5), input_ids=ids, positions=pos, out_cache_loc=locs), _live_batch(5)):
        bufs = GraphInputBuffers.allocate(16, 4, torch.device("cpu"), dummy_req_row=0)
        bufs.load_tokens(_live_batch(12), 16)
        calls.clear()
        bufs.load_tokens(fb, 8)
        results.append((len(calls), bufs.tokens[:, :8].tolist()))
    assert results[0][0] == 1 and results[1][0] == 3
    assert results[0][1] == results[1][1]
    assert results[0][1][0] == list(range(100, 105)) + [0, 0, 0]


def test_static_rows_keep_their_alignment_at_any_size():
    """The rows of the packed static buffers start 128 bytes apart (a multiple of it), whatever the
    size: kernels specialised on 16-byte-aligned inputs see each row as they saw a tensor of its own."""
    from sglang.srt.layers.attention.triton_backend import _StaticBuffers

    for n in (1, 161, 8192):
        bufs = GraphInputBuffers.allocate(n, 3, torch.device("cpu"), dummy_req_row=0)
        attn = _StaticBuffers.allocate(n, torch.device("cpu"))
        for rows in ((bufs.input_ids, bufs.positions, bufs.out_cache_loc),
                     (attn.req_pool_indices, attn.seq_lens, attn.extend_seq_lens, attn.extend_start_loc)):
            assert all(r.shape == (n,) and r.is_contiguous() for r in rows)
            assert all((r.data_ptr() - rows[0].data_ptr()) % 128 == 0 for r in rows)


def test_builders_lay_a_batch_out_for_one_copy():
    """build_decode_batch and build_extend_batch move the token vectors, and the requests' rows and
    lengths, as back-to-back views: the graph runners' one-copy loads apply to every real batch."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.model_executor.batch_builder import DecodeRequest, ExtendRequest, build_decode_batch, build_extend_batch
    from sglang.srt.utils import stacked_view

    pool = ReqToTokenPool(4, 64, torch.device("cpu"))
    decode = build_decode_batch([DecodeRequest(0, 7, 10, 9), DecodeRequest(1, 8, 20, 19)], pool, "cpu")
    extend = build_extend_batch([ExtendRequest(2, [1, 2, 3], 0, [30, 31, 32]), ExtendRequest(3, [4], 0, [40])], pool, "cpu")
    for fb in (decode, extend):
        tokens = stacked_view(fb.input_ids, fb.positions, fb.out_cache_loc)
        requests = stacked_view(fb.req_pool_indices, fb.seq_lens)  # views past the buffer's start
        assert torch.equal(tokens, torch.stack([fb.input_ids, fb.positions, fb.out_cache_loc]))
        assert torch.equal(requests, torch.stack([fb.req_pool_indices, fb.seq_lens]))


def test_capture_batches_point_at_the_dummy_row():
    bufs = GraphInputBuffers.allocate(32, 4, torch.device("cpu"), dummy_req_row=0)
    fb = bufs.capture_extend_batch(24, 4, with_lora=True)
    assert fb.extend_seq_lens_cpu == [24, 0, 0, 0] and fb.extend_num_tokens == 24
    assert fb.extend_start_loc.tolist() == [0, 24, 24, 24]
    assert fb.req_pool_indices.tolist() == [0, 0, 0, 0]
    assert fb.lora_ids == [None] * 4  # capture with the base model: LoRA kernels recorded, idle
    assert fb.out_cache_loc.tolist() == [0] * 24
    assert fb.input_ids.data_ptr() == bufs.input_ids.data_ptr()  # views of the static buffers
    dec = bufs.capture_decode_batch(4, seq_len_fill=1, with_lora=False)
    assert dec.lora_ids is None and dec.seq_lens.tolist() == [1] * 4


def test_capture_batches_keep_positions_inside_the_context():
    """A bucket above the context length (max_position_embeddings 256 here) is captured as several
    requests of at most 256 tokens, each from position 0: the rotary table has 256 rows and a
    request's req_to_token row 256 + pad columns (positions 0..bucket-1 crashed the GPU at start)."""
    bufs = GraphInputBuffers.allocate(1024, 8, torch.device("cpu"), dummy_req_row=0)
    fb = bufs.capture_extend_batch(600, 4, with_lora=False, max_req_tokens=256)
    assert fb.extend_seq_lens_cpu == [256, 256, 88, 0] and fb.extend_num_tokens == 600
    assert fb.seq_lens.tolist() == [256, 256, 88, 0] and fb.seq_lens_cpu.tolist() == [256, 256, 88, 0]
    assert fb.extend_start_loc.tolist() == [0, 256, 512, 600]
    assert int(fb.positions.max()) == 255
    assert fb.positions[:256].tolist() == list(range(256)) and fb.positions[512:].tolist() == list(range(88))
    assert fb.lora_ids is None
    # Within the context, one request holds every token as before.
    small = bufs.capture_extend_batch(200, 1, with_lora=True, max_req_tokens=256)
    assert small.extend_seq_lens_cpu == [200] and small.positions.tolist() == list(range(200))
    with pytest.raises(ValueError, match="does not fit"):
        bufs.capture_extend_batch(1000, 3, with_lora=False, max_req_tokens=256)


def test_break_outputs_share_one_buffer_sized_by_the_first():
    outs = BreakOutputs()
    big = torch.randn(32, 8)
    held = outs.hold(big)
    assert torch.equal(held, big) and held.data_ptr() != big.data_ptr()
    small = torch.randn(4, 8)
    held_small = outs.hold(small)  # a smaller bucket, another layer: the same memory
    assert torch.equal(held_small, small) and held_small.data_ptr() == held.data_ptr()
    assert outs.nbytes == big.numel() * big.element_size()
    with pytest.raises(ValueError, match="largest bucket first"):
        outs.hold(torch.randn(64, 8))
    # A break that wrote into the buffer itself (RadixAttention asks the breaker for it) is held
    # as is: no copy, so a replay copies nothing either.
    written = outs.view((16, 8), torch.float32, torch.device("cpu"))
    assert outs.hold(written) is written and outs.owns(written) and not outs.owns(big)


def test_capture_batch_above_the_context_runs_through_the_model():
    """The start-up crash on the CPU: a checkpoint with a 256-token context, a 600-token bucket.
    Positions 0..599 index past the rotary table (an IndexError here, a device assert on a GPU);
    the capture batch split into requests of at most 256 tokens runs the body."""
    from helpers import make_runner, tiny_checkpoint

    runner = make_runner(tiny_checkpoint("qwen3", max_position_embeddings=256), max_total_tokens=1024)
    assert runner.context_len == 256
    bufs = GraphInputBuffers.allocate(600, 3, runner.device, runner.padding_req_pool_index)

    def body(max_req_tokens):
        fb = bufs.capture_extend_batch(600, 3, with_lora=False, max_req_tokens=max_req_tokens)
        runner.attach_pools(fb)
        runner.attn_backend.init_forward_metadata(fb)
        return runner.model.model(fb.input_ids, fb.positions, fb)

    with pytest.raises(IndexError):
        body(None)  # one request of 600 tokens: what capture used to build
    hidden = body(runner.context_len)
    assert hidden.shape == (600, runner.model_config.hidden_size) and bool(torch.isfinite(hidden).all())
