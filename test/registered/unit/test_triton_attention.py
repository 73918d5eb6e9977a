"""The triton attention backend and its kernels, under TRITON_INTERPRET=1 on CPU at tiny shapes.

The interpreter tiles are 16x16 (extend) and 16-key blocks with 4 splits (decode), so the lengths
below cross tile, block and split boundaries. References are float64 SDPA over K/V gathered through
`req_to_token`.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from sglang.srt.layers.attention.triton_ops.decode_attention import decode_attention_fwd
from sglang.srt.layers.attention.triton_ops.extend_attention import (
    ExtendConfig,
    extend_attention_fwd,
)
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.configs.forward_batch_info import ForwardBatch, ForwardMode, GraphBreaker

DEV = "cpu"


# ---------------------------------------------------------------------------------- fixtures
def make_paged(seq_lens, num_kv_heads, head_dim, dtype=torch.float32, rows=None, gen=None,
               max_ctx=160):
    """Random K/V pool and req_to_token rows holding shuffled slots (never slot 0)."""
    total = sum(seq_lens)
    num_slots = total + 8
    k_buf = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_buf = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    rows = rows if rows is not None else list(range(len(seq_lens)))
    r2t = torch.zeros(max(rows) + 2, max_ctx, dtype=torch.int32)
    perm = torch.randperm(num_slots - 1, generator=gen) + 1
    off = 0
    for row, n in zip(rows, seq_lens):
        r2t[row, :n] = perm[off : off + n].to(torch.int32)
        off += n
    return k_buf, v_buf, r2t, torch.tensor(rows, dtype=torch.int64)


def ref_extend(q, k_buf, v_buf, r2t, rows, prefix_lens, extend_lens, starts, scale):
    """Per-request SDPA (float64) over the gathered K/V with the prefix-offset causal mask."""
    num_heads, group = q.shape[1], q.shape[1] // k_buf.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for row, p, e, s in zip(rows.tolist(), prefix_lens, extend_lens, starts):
        if e == 0:
            continue
        slots = r2t[row, : p + e].long()
        k = k_buf[slots].double().repeat_interleave(group, 1).transpose(0, 1)
        v = v_buf[slots].double().repeat_interleave(group, 1).transpose(0, 1)
        qq = q[s : s + e].double().transpose(0, 1)
        allowed = torch.arange(p + e)[None, :] <= (p + torch.arange(e))[:, None]
        o = F.scaled_dot_product_attention(qq, k, v, attn_mask=allowed, scale=scale)
        out[s : s + e] = o.transpose(0, 1)
        assert out.shape[1] == num_heads
    return out


def ref_decode(q, k_buf, v_buf, r2t, rows, seq_lens, scale):
    group = q.shape[1] // k_buf.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, (row, n) in enumerate(zip(rows.tolist(), seq_lens)):
        slots = r2t[row, :n].long()
        k = k_buf[slots].double().repeat_interleave(group, 1).transpose(0, 1)
        v = v_buf[slots].double().repeat_interleave(group, 1).transpose(0, 1)
        o = F.scaled_dot_product_attention(q[b].double()[:, None, :], k, v, scale=scale)
        out[b] = o[:, 0, :]
    return out


def extend_inputs(prefix_lens, extend_lens, num_heads, num_kv_heads, head_dim, dtype, seed,
                  rows=None):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    k_buf, v_buf, r2t, rows_t = make_paged(seq_lens, num_kv_heads, head_dim, dtype, rows, gen)
    starts = [sum(extend_lens[:i]) for i in range(len(extend_lens))]
    num_tokens = sum(extend_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    # The new tokens' K/V as the model produced them (RadixAttention wrote them to the pool).
    k_ext = torch.zeros(num_tokens, num_kv_heads, head_dim, dtype=dtype)
    v_ext = torch.zeros_like(k_ext)
    for row, p, e, s in zip(rows_t.tolist(), prefix_lens, extend_lens, starts):
        slots = r2t[row, p : p + e].long()
        k_ext[s : s + e], v_ext[s : s + e] = k_buf[slots], v_buf[slots]
    meta = dict(
        req_pool_indices=rows_t,
        seq_lens=torch.tensor(seq_lens),
        extend_seq_lens=torch.tensor(extend_lens),
        extend_start_loc=torch.tensor(starts),
    )
    return q, k_buf, v_buf, r2t, k_ext, v_ext, meta, starts


# ---------------------------------------------------------------------------------- kernels
EXTEND_CASES = [
    # (H, KVH, D, prefix_lens, extend_lens, kv_from_input)
    (2, 2, 64, [0, 0], [5, 33], True),  # MHA, no prefix, uneven, 3 token tiles
    (4, 2, 64, [7, 0, 16], [20, 1, 16], True),  # GQA 2, prefixes ragged and block aligned
    (4, 2, 64, [7, 0, 16], [20, 1, 16], False),  # same through the pool only
    (4, 1, 128, [40], [18], True),  # GQA 4, head dim 128, long prefix
    (2, 1, 80, [3, 21], [9, 17], False),  # head dim 80: padded to 128 and masked
]


@pytest.mark.parametrize("H,KVH,D,prefix_lens,extend_lens,kv_from_input", EXTEND_CASES)
def test_extend_matches_reference(H, KVH, D, prefix_lens, extend_lens, kv_from_input):
    q, k_buf, v_buf, r2t, k_ext, v_ext, meta, starts = extend_inputs(
        prefix_lens, extend_lens, H, KVH, D, torch.float32, seed=H * 100 + D
    )
    scale = 1.0 / math.sqrt(D)
    o = torch.full_like(q, float("nan"))
    extend_attention_fwd(
        q, o, k_buf, v_buf, r2t, **meta, max_extend_len=max(extend_lens), sm_scale=scale,
        k_extend=k_ext if kv_from_input else None, v_extend=v_ext if kv_from_input else None,
    )
    ref = ref_extend(q, k_buf, v_buf, r2t, meta["req_pool_indices"], prefix_lens, extend_lens,
                     starts, scale)
    err = (o.double() - ref).abs().max().item()
    assert err < 1e-5, f"max abs err {err}"


@pytest.mark.parametrize("block_m,block_n", [(16, 32), (32, 16)])
def test_extend_tile_shapes(block_m, block_n):
    # Key blocks wider and narrower than query tiles: the unmasked/diagonal split must hold.
    prefix_lens, extend_lens = [7, 0, 40], [45, 3, 20]
    q, k_buf, v_buf, r2t, k_ext, v_ext, meta, starts = extend_inputs(
        prefix_lens, extend_lens, 2, 1, 64, torch.float32, seed=block_m
    )
    ref = ref_extend(q, k_buf, v_buf, r2t, meta["req_pool_indices"], prefix_lens, extend_lens,
                     starts, 0.125)
    for kv in ((k_ext, v_ext), (None, None)):
        o = torch.full_like(q, float("nan"))
        extend_attention_fwd(q, o, k_buf, v_buf, r2t, **meta, max_extend_len=45, sm_scale=0.125,
                             k_extend=kv[0], v_extend=kv[1],
                             config=ExtendConfig(block_m, block_n, 4, 1))
        assert (o.double() - ref).abs().max().item() < 1e-5


def test_extend_zero_length_sentinels_and_oversized_grid():
    # Slots 1 and 3 are the graph's unused request slots; the token axis spans a 48-token bucket.
    prefix_lens, extend_lens = [4, 0, 10, 0], [13, 0, 6, 0]
    q, k_buf, v_buf, r2t, k_ext, v_ext, meta, starts = extend_inputs(
        prefix_lens, extend_lens, 4, 2, 64, torch.float32, seed=7
    )
    live = q.shape[0]
    pad = 48 - live
    q = torch.cat([q, torch.randn(pad, 4, 64)])
    k_ext = torch.cat([k_ext, torch.randn(pad, 2, 64)])
    v_ext = torch.cat([v_ext, torch.randn(pad, 2, 64)])
    meta["seq_lens"][[1, 3]] = 0
    meta["extend_start_loc"][[1, 3]] = 0  # sentinels point at row 0: must never write it
    o = torch.full_like(q, float("nan"))
    extend_attention_fwd(q, o, k_buf, v_buf, r2t, **meta, max_extend_len=48,
                         sm_scale=0.125, k_extend=k_ext, v_extend=v_ext)
    ref = ref_extend(q[:live], k_buf, v_buf, r2t, meta["req_pool_indices"], prefix_lens,
                     extend_lens, starts, 0.125)
    assert (o[:live].double() - ref).abs().max().item() < 1e-5
    assert torch.isnan(o[live:]).all(), "rows past the live tokens must not be computed"


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 3e-3), (torch.bfloat16, 2e-2)])
def test_extend_half_precision(dtype, tol):
    prefix_lens, extend_lens = [11, 0], [19, 6]
    q, k_buf, v_buf, r2t, k_ext, v_ext, meta, starts = extend_inputs(
        prefix_lens, extend_lens, 4, 2, 64, dtype, seed=3
    )
    o = torch.empty_like(q)
    extend_attention_fwd(q, o, k_buf, v_buf, r2t, **meta, max_extend_len=19, sm_scale=0.125,
                         k_extend=k_ext, v_extend=v_ext)
    ref = ref_extend(q, k_buf, v_buf, r2t, meta["req_pool_indices"], prefix_lens, extend_lens,
                     starts, 0.125)
    # Reference from the same rounded inputs: error is P's and O's rounding only.
    assert o.dtype == dtype
    assert (o.double() - ref).abs().max().item() < tol


DECODE_CASES = [
    # (H, KVH, D, seq_lens) with 4 splits of round_up(cdiv(n, 4), 16) keys
    (2, 2, 64, [1, 16, 17, 100]),  # MHA: one block, one split, two splits, four splits
    (4, 2, 64, [5, 64, 33]),  # GQA 2
    (8, 2, 128, [3, 70]),  # GQA 4, head dim 128
    (3, 1, 80, [9, 40]),  # group 3 (not a power of two), head dim 80
]


@pytest.mark.parametrize("H,KVH,D,seq_lens", DECODE_CASES)
def test_decode_matches_reference(H, KVH, D, seq_lens):
    gen = torch.Generator().manual_seed(H * 10 + D)
    rows = list(range(len(seq_lens)))[::-1]
    k_buf, v_buf, r2t, rows_t = make_paged(seq_lens, KVH, D, rows=rows, gen=gen)
    q = torch.randn(len(seq_lens), H, D, generator=gen)
    o = torch.full_like(q, float("nan"))
    scale = 1.0 / math.sqrt(D)
    decode_attention_fwd(q, o, k_buf, v_buf, r2t, rows_t, torch.tensor(seq_lens), scale, 4)
    ref = ref_decode(q, k_buf, v_buf, r2t, rows_t, seq_lens, scale)
    err = (o.double() - ref).abs().max().item()
    assert err < 1e-5, f"max abs err {err}"


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_garbage_in_the_padding_slot_never_leaks(poison):
    """Padded graph rows write whatever they hold (NaN after uninitialised memory) into slot 0,
    and masked key positions point at slot 0. Their zero probability must not meet that value:
    0 * NaN is NaN, which once reached the logprobs of real requests on the H200."""
    gen = torch.Generator().manual_seed(5)
    seq_lens = [1, 17, 40]  # ragged: every request has masked positions in its last key block
    k_buf, v_buf, r2t, rows_t = make_paged(seq_lens, 2, 64, gen=gen)
    k_buf[0], v_buf[0] = poison, poison
    q = torch.randn(len(seq_lens), 4, 64, generator=gen)
    o = torch.empty_like(q)
    decode_attention_fwd(q, o, k_buf, v_buf, r2t, rows_t, torch.tensor(seq_lens), 0.125, 4)
    ref = ref_decode(q, k_buf, v_buf, r2t, rows_t, seq_lens, 0.125)
    assert torch.isfinite(o).all() and (o.double() - ref).abs().max().item() < 1e-5

    prefix_lens, extend_lens = [3, 0, 21], [5, 9, 2]
    q, k_buf, v_buf, r2t, k_ext, v_ext, meta, starts = extend_inputs(
        prefix_lens, extend_lens, 4, 2, 64, torch.float32, seed=6)
    k_buf[0], v_buf[0] = poison, poison
    for kv_from_input in (True, False):
        o = torch.empty_like(q)
        extend_attention_fwd(q, o, k_buf, v_buf, r2t, **meta, max_extend_len=max(extend_lens), sm_scale=0.125,
                             k_extend=k_ext if kv_from_input else None, v_extend=v_ext if kv_from_input else None)
        ref = ref_extend(q, k_buf, v_buf, r2t, meta["req_pool_indices"], prefix_lens, extend_lens, starts, 0.125)
        assert torch.isfinite(o).all() and (o.double() - ref).abs().max().item() < 1e-5, kv_from_input


def test_decode_split_count_and_empty_rows():
    gen = torch.Generator().manual_seed(11)
    seq_lens = [50, 0, 7]  # row 1 is a zero-length request: zeros, not NaN
    k_buf, v_buf, r2t, rows_t = make_paged(seq_lens, 2, 64, gen=gen)
    q = torch.randn(3, 4, 64, generator=gen)
    outs = []
    for splits in (1, 8):
        o = torch.full_like(q, float("nan"))
        decode_attention_fwd(q, o, k_buf, v_buf, r2t, rows_t, torch.tensor(seq_lens), 0.125, splits)
        outs.append(o)
    assert torch.equal(outs[0][1], torch.zeros(4, 64))
    assert (outs[0] - outs[1]).abs().max().item() < 1e-5
    with pytest.raises(ValueError):
        decode_attention_fwd(q, o, k_buf, v_buf, r2t, rows_t, torch.tensor(seq_lens), 0.125, 3)


# ---------------------------------------------------------------------------------- backend
class Setup:
    """Real pools + backend + one RadixAttention layer; K/V of cached prefixes pre-written."""

    def __init__(self, H=4, KVH=2, D=64, num_layers=2, pool_rows=8, seed=0, **backend_kwargs):
        torch.manual_seed(seed)
        self.H, self.KVH, self.D = H, KVH, D
        self.req_pool = ReqToTokenPool(pool_rows, 128, DEV)
        self.kv_pool = MHATokenToKVPool(400, torch.float32, KVH, D, num_layers, DEV)
        runner = SimpleNamespace(req_to_token_pool=self.req_pool, token_to_kv_pool=self.kv_pool,
                                 device=DEV)
        self.backend = TritonAttnBackend(runner, **backend_kwargs)
        self.layer = RadixAttention(H, D, 1.0 / math.sqrt(D), KVH, layer_id=1)
        self.next_slot = 1  # slot 0 is the dummy slot
        self.lens = {}  # row -> tokens written

    def alloc(self, row, n):
        slots = torch.arange(self.next_slot, self.next_slot + n)
        self.next_slot += n
        self.req_pool.write(row, self.lens.get(row, 0), slots)
        self.lens[row] = self.lens.get(row, 0) + n
        return slots

    def cache_prefix(self, row, n):
        slots = self.alloc(row, n)
        kv = torch.randn(2, n, self.KVH, self.D)
        self.kv_pool.set_kv_buffer(self.layer.layer_id, slots, kv[0], kv[1])

    def extend_batch(self, rows, extend_lens):
        prefix = [self.lens.get(r, 0) for r in rows]
        locs = torch.cat([self.alloc(r, e) for r, e in zip(rows, extend_lens)])
        seq = [p + e for p, e in zip(prefix, extend_lens)]
        t = sum(extend_lens)
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=len(rows),
            input_ids=torch.zeros(t, dtype=torch.int64), positions=torch.zeros(t, dtype=torch.int64),
            out_cache_loc=locs, req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(seq),
            seq_lens_cpu=torch.tensor(seq), extend_seq_lens=torch.tensor(extend_lens),
            extend_prefix_lens=torch.tensor(prefix),
            extend_start_loc=torch.tensor([sum(extend_lens[:i]) for i in range(len(rows))]),
            extend_seq_lens_cpu=list(extend_lens), extend_prefix_lens_cpu=prefix,
            extend_num_tokens=t, req_to_token_pool=self.req_pool, token_to_kv_pool=self.kv_pool,
            attn_backend=self.backend,
        )

    def decode_batch(self, rows):
        locs = torch.cat([self.alloc(r, 1) for r in rows])
        seq = torch.tensor([self.lens[r] for r in rows])
        b = len(rows)
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=b,
            input_ids=torch.zeros(b, dtype=torch.int64), positions=seq - 1, out_cache_loc=locs,
            req_pool_indices=torch.tensor(rows), seq_lens=seq, seq_lens_cpu=seq.clone(),
            req_to_token_pool=self.req_pool, token_to_kv_pool=self.kv_pool,
            attn_backend=self.backend,
        )

    def qkv(self, t):
        return (torch.randn(t, self.H * self.D), torch.randn(t, self.KVH * self.D),
                torch.randn(t, self.KVH * self.D))

    def pool_views(self):
        lid = self.layer.layer_id
        return (self.kv_pool.get_key_buffer(lid), self.kv_pool.get_value_buffer(lid),
                self.req_pool.req_to_token)


def test_backend_extend_then_decode_through_radix_attention():
    s = Setup(H=4, KVH=2, D=64)
    s.cache_prefix(row=3, n=21)  # a cached prefix (e.g. a radix-cache hit or an earlier chunk)
    fb = s.extend_batch(rows=[3, 5], extend_lens=[12, 30])
    q, k, v = s.qkv(42)
    s.backend.init_forward_metadata(fb)
    out = s.layer(q, k, v, fb)
    assert out.shape == (42, 4 * 64)
    k_buf, v_buf, r2t = s.pool_views()
    ref = ref_extend(q.view(42, 4, 64), k_buf, v_buf, r2t, fb.req_pool_indices, [21, 0], [12, 30],
                     [0, 12], s.layer.scaling)
    assert (out.view(42, 4, 64).double() - ref).abs().max().item() < 1e-5

    fb = s.decode_batch(rows=[5, 3])
    q, k, v = s.qkv(2)
    s.backend.init_forward_metadata(fb)
    out = s.layer(q, k, v, fb)
    ref = ref_decode(q.view(2, 4, 64), k_buf, v_buf, r2t, fb.req_pool_indices, [31, 34],
                     s.layer.scaling)
    assert (out.view(2, 4, 64).double() - ref).abs().max().item() < 1e-5


def test_backend_extend_pool_path_equals_input_path():
    outs = []
    for from_input in (True, False):
        s = Setup(seed=5, extend_kv_from_input=from_input)
        s.cache_prefix(row=0, n=9)
        fb = s.extend_batch(rows=[0, 1], extend_lens=[17, 4])
        q, k, v = s.qkv(21)
        s.backend.init_forward_metadata(fb)
        outs.append(s.layer(q, k, v, fb))
    assert (outs[0] - outs[1]).abs().max().item() < 1e-6


def test_decode_with_more_rows_than_live_requests():
    """A breakable decode replay gives attention the bucket's q rows but only the live requests'
    metadata: the live rows are computed as eagerly, the padding rows are left alone."""
    s = Setup(H=4, KVH=2, D=64)
    for row, n in ((1, 9), (2, 30)):
        s.cache_prefix(row, n)
    live = s.decode_batch(rows=[2, 1])
    q, k, v = s.qkv(4)  # bucket of 4, 2 live requests
    s.backend.init_forward_metadata(live)
    padded = s.backend.forward_decode(q, k, v, s.layer, live)
    assert padded.shape == (4, 4 * 64)
    exact = s.backend.forward_decode(q[:2], k[:2], v[:2], s.layer, live)
    assert torch.equal(padded[:2], exact)


def test_decode_layers_share_one_scratch_and_write_the_given_output():
    """The split-KV partials are allocated once per forward (by the first layer), not per layer,
    and an output buffer handed in (RadixAttention's) is written in place and returned."""
    s = Setup(H=4, KVH=2, D=64)
    s.cache_prefix(1, 20)
    live = s.decode_batch(rows=[1])
    q, k, v = s.qkv(1)
    s.backend.init_forward_metadata(live)
    first = s.backend.forward_decode(q, k, v, s.layer, live)
    scratch = s.backend.forward_metadata.decode_scratch
    out = torch.full_like(first, float("nan"))
    second = s.backend.forward_decode(q, k, v, s.layer, live, out=out)
    assert s.backend.forward_metadata.decode_scratch is scratch
    assert second.data_ptr() == out.data_ptr() and torch.equal(out, first)
    s.backend.init_forward_metadata(live)  # a new forward starts without one
    assert s.backend.forward_metadata.decode_scratch is None


class _RecordingBreaker(GraphBreaker):
    """The breakable graph's seam without CUDA: records each break like a capture does."""

    def __init__(self) -> None:
        self.breaks = []

    def eager(self, fn, *tensors):
        out = fn(self.ctx, *tensors)
        self.breaks.append((fn, tensors, out))
        return out


@pytest.mark.parametrize("mode", ["extend", "decode"])
def test_attention_break_writes_the_tensor_the_next_segment_reads(mode):
    """Under a breakable graph the attention output comes from the breaker (`output_buffer`) and is
    handed to the eager break, which writes it in place and returns that very tensor: a replay then
    needs no copy into the static output (BreakableCUDAGraph copies only when `result is not brk.out`)."""
    s = Setup(H=4, KVH=2, D=64)
    s.cache_prefix(row=1, n=12)
    fb = s.extend_batch(rows=[1, 2], extend_lens=[5, 3]) if mode == "extend" else s.decode_batch(rows=[1])
    t = fb.num_tokens
    q, k, v = s.qkv(t)
    s.backend.init_forward_metadata(fb)
    breaker = _RecordingBreaker()
    breaker.ctx = fb
    fb.graph_breaker = breaker
    captured = s.layer(q, k, v, fb)
    fb.graph_breaker = None
    (fn, args, out), = breaker.breaks
    assert captured is out and args[-1] is out
    replayed = fn(fb, *args)  # what BreakableCUDAGraph.replay calls with the live batch
    assert replayed is out
    assert torch.equal(out, s.layer(q, k, v, fb))  # and it is the eager result


# ---------------------------------------------------------------------------------- graph hooks
def test_decode_static_buffers_replay_matches_eager():
    """Capture hook at bs=4, then replays with 2 and 3 live requests: what a graph replay reads."""
    s = Setup(H=4, KVH=1, D=64)
    for row, n in ((0, 5), (1, 40), (2, 17), (4, 66)):
        s.cache_prefix(row, n)
    s.backend.init_cuda_graph_state(max_bs=6, max_num_tokens=6)
    bs = 4
    cap = s.decode_batch(rows=[0, 1, 2, 4])
    s.backend.init_forward_metadata_capture_cuda_graph(
        bs, bs, cap.req_pool_indices, cap.seq_lens, ForwardMode.DECODE, cap)
    static_meta = s.backend.forward_metadata
    for live_rows in ([4, 1], [2, 0, 1]):
        live = s.decode_batch(rows=live_rows)
        n = len(live_rows)
        q, k, v = s.qkv(bs)  # the graph's static q: live rows first, padded rows after
        s.backend.init_forward_metadata_replay_cuda_graph(
            bs, live.req_pool_indices, live.seq_lens, live.seq_lens_cpu, ForwardMode.DECODE, live)
        # The captured kernels read exactly the tensors the capture hook handed out.
        assert s.backend.forward_metadata.seq_lens.data_ptr() == static_meta.seq_lens.data_ptr()
        assert s.backend.forward_metadata.seq_lens[n:bs].tolist() == [1] * (bs - n)
        graph_out = s.backend.forward_decode(q, k, v, s.layer, live)
        s.backend.init_forward_metadata(live)
        eager_out = s.backend.forward_decode(q[:n], k[:n], v[:n], s.layer, live)
        assert torch.isfinite(graph_out).all(), "padded rows must compute harmlessly"
        assert torch.equal(graph_out[:n], eager_out), (graph_out[:n] - eager_out).abs().max()


def test_extend_static_buffers_replay_matches_eager():
    """Full prefill graph: 4 request slots, a 48-token bucket; live batches of 3 then 1 requests."""
    s = Setup(H=4, KVH=2, D=64, pool_rows=8)
    s.cache_prefix(row=2, n=13)
    s.cache_prefix(row=6, n=30)
    s.backend.init_cuda_graph_state(max_bs=4, max_num_tokens=48)
    slots, bucket = 4, 48
    # Capture batch as a runner builds it: request 0 holds the whole bucket, the rest are empty.
    cap = s.extend_batch(rows=[7, 0, 0, 0], extend_lens=[bucket, 0, 0, 0])
    s.backend.init_forward_metadata_capture_cuda_graph(
        slots, bucket, cap.req_pool_indices, cap.seq_lens, ForwardMode.EXTEND, cap)
    static_ptr = s.backend.forward_metadata.extend_seq_lens.data_ptr()
    for rows, lens in (([2, 3, 6], [10, 25, 7]), ([6], [40])):
        live = s.extend_batch(rows=rows, extend_lens=lens)
        t = sum(lens)
        q, k, v = s.qkv(bucket)  # static q/k/v: live tokens first, padding after
        s.kv_pool.set_kv_buffer(s.layer.layer_id, live.out_cache_loc, k[:t], v[:t])
        s.backend.init_forward_metadata_replay_cuda_graph(
            len(rows), live.req_pool_indices, live.seq_lens, live.seq_lens_cpu,
            ForwardMode.EXTEND, live)
        meta = s.backend.forward_metadata
        assert meta.extend_seq_lens.data_ptr() == static_ptr
        assert meta.extend_seq_lens.tolist() == lens + [0] * (slots - len(rows))
        assert meta.seq_lens.tolist()[len(rows):] == [0] * (slots - len(rows))
        graph_out = s.backend.forward_extend(q, k, v, s.layer, live)
        s.backend.init_forward_metadata(live)
        eager_out = s.backend.forward_extend(q[:t], k[:t], v[:t], s.layer, live)
        assert torch.equal(graph_out[:t], eager_out), (graph_out[:t] - eager_out).abs().max()

    too_many = s.extend_batch(rows=[0, 1, 3, 4, 5], extend_lens=[1] * 5)
    with pytest.raises(ValueError, match="request slots"):
        s.backend.init_forward_metadata_replay_cuda_graph(
            5, too_many.req_pool_indices, too_many.seq_lens, too_many.seq_lens_cpu,
            ForwardMode.EXTEND, too_many)


def test_graph_hooks_need_state_and_validate_splits():
    s = Setup()
    fb = s.decode_batch(rows=[0])
    with pytest.raises(RuntimeError):
        s.backend.init_forward_metadata_capture_cuda_graph(
            1, 1, fb.req_pool_indices, fb.seq_lens, ForwardMode.DECODE, fb)
    runner = SimpleNamespace(req_to_token_pool=s.req_pool, token_to_kv_pool=s.kv_pool, device=DEV)
    with pytest.raises(ValueError):
        TritonAttnBackend(runner, num_kv_splits=6)


def test_static_buffers_load_packed_requests_in_one_copy(monkeypatch):
    """Rows and lengths that lie back to back (a builder's packed batch) fill the static buffers
    with one copy, separate ones with two; the values are the same either way."""
    from sglang.srt.layers.attention.triton_backend import _StaticBuffers

    packed = torch.tensor([3, 1, 2, 17, 9, 30])
    rows, lens = packed.split([3, 3])
    calls = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, **kw: (calls.append(1), real_copy(self, src, **kw))[1])
    got = []
    for r, s in ((rows, lens), (rows.clone(), lens.clone())):
        bufs = _StaticBuffers.allocate(8, torch.device("cpu"))
        calls.clear()
        assert bufs.load_requests(r, s) == 3
        got.append((len(calls), bufs.req_pool_indices[:3].tolist(), bufs.seq_lens[:3].tolist()))
    assert got[0] == (1, [3, 1, 2], [17, 9, 30]) and got[1] == (2, [3, 1, 2], [17, 9, 30])
