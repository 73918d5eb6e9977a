"""Triton attention on the GPU: bf16 kernels vs a float32 reference, and real CUDA-graph replays.

Tolerances (bf16). The reference runs in float32 on the *same* bf16-rounded q/K/V, so the only
errors left are the kernel's: P rounded to bf16 before the P@V product (relative 2^-9 per weight,
averaging out over the keys) and O rounded to bf16 on store (relative 2^-9 = 0.2%). With |O| <= ~3
(a convex combination of N(0,1) values) that bounds the max abs error near 0.01; we allow 2e-2 abs
+ 2e-2 rel per element and 1e-2 on the relative Frobenius norm (METHOD: bf16 lands in 1e-3..1e-2).

The graph tests capture RadixAttention (K/V write + attention) through the backend's hooks, replay
with different live batches, and require the replay to equal the eager path bit for bit: both run
the same kernels on the same per-row inputs, only the grid's idle tail differs.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from sglang.srt.layers.attention.triton_ops.decode_attention import decode_attention_fwd
from sglang.srt.layers.attention.triton_ops.extend_attention import extend_attention_fwd
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.configs.forward_batch_info import ForwardBatch, ForwardMode

pytestmark = pytest.mark.gpu

DT = torch.bfloat16
ATOL, RTOL, REL_NORM = 2e-2, 2e-2, 1e-2


def _cuda():
    return torch.device("cuda")


# ---------------------------------------------------------------------------------- helpers
def _check(name, got, ref, owner=None, atol=ATOL, rtol=RTOL, rel_norm=REL_NORM):
    """Compare [T, H, D] outputs; on failure say where the worst element is and whose it is."""
    got, ref = got.float(), ref.float()
    finite = torch.isfinite(got)
    assert finite.all(), f"{name}: non-finite outputs at {torch.nonzero(~finite)[:5].tolist()}"
    diff = (got - ref).abs()
    rel = (diff.norm() / ref.norm().clamp_min(1e-12)).item()
    bad = diff > atol + rtol * ref.abs()
    if bad.any() or rel > rel_norm:
        idx = torch.nonzero(diff == diff.max())[0].tolist()
        who = f" (request {owner(idx[0])})" if owner else ""
        raise AssertionError(
            f"{name}: max abs err {diff.max().item():.4g} at {idx}{who}: got "
            f"{got[tuple(idx)].item():.5f} ref {ref[tuple(idx)].item():.5f}; rel norm {rel:.3g}; "
            f"{int(bad.sum())} of {bad.numel()} elements out of tolerance; per-row max err "
            f"{diff.amax(dim=(1, 2))[:16].tolist()}"
        )


def _paged(seq_lens, kvh, d, gen, rows=None, ctx=8192, dtype=DT):
    total = sum(seq_lens)
    slots = total + 64
    k_buf = torch.randn(slots, kvh, d, generator=gen, device="cuda").to(dtype)
    v_buf = torch.randn(slots, kvh, d, generator=gen, device="cuda").to(dtype)
    rows = rows if rows is not None else list(range(1, len(seq_lens) + 1))
    r2t = torch.zeros(max(rows) + 1, ctx, dtype=torch.int32, device="cuda")
    perm = torch.randperm(slots - 1, generator=gen, device="cuda") + 1
    off = 0
    for row, n in zip(rows, seq_lens):
        r2t[row, :n] = perm[off : off + n].to(torch.int32)
        off += n
    return k_buf, v_buf, r2t, torch.tensor(rows, device="cuda")


def _ref_attention(q, k, v, scale, prefix):
    """float32 attention of q [t, H, D] over k/v [n, KVH, D]; query i sees keys < prefix + i + 1."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, 1)
    v = v.float().repeat_interleave(group, 1)
    s = torch.einsum("thd,nhd->htn", q.float(), k) * scale
    allowed = torch.arange(k.shape[0], device=q.device)[None, :] <= (
        prefix + torch.arange(q.shape[0], device=q.device)
    )[:, None]
    s = s.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("htn,nhd->thd", s.softmax(-1), v)


def _ref_extend(q, k_buf, v_buf, r2t, rows, prefix, ext, scale):
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    s = 0
    for row, p, e in zip(rows.tolist(), prefix, ext):
        slots = r2t[row, : p + e].long()
        out[s : s + e] = _ref_attention(q[s : s + e], k_buf[slots], v_buf[slots], scale, p)
        s += e
    return out


def _owner(ext):
    starts = [sum(ext[:i]) for i in range(len(ext) + 1)]
    return lambda t: next(i for i in range(len(ext)) if starts[i] <= t < starts[i + 1])


# ---------------------------------------------------------------------------------- kernels
EXTEND_CASES = [
    # (H, KVH, D, prefix_lens, extend_lens, kv_from_input)
    (32, 8, 128, [0, 300], [200, 77], True),  # Qwen3-4B / Llama-8B heads, GQA 4
    (32, 8, 128, [0, 300], [200, 77], False),  # same through the pool only
    (14, 2, 64, [0, 129, 5], [513, 64, 1], True),  # Qwen2.5-0.5B heads, GQA 7
    (8, 8, 128, [64], [130], True),  # MHA
    (16, 8, 64, [1000], [257], True),  # GQA 2, long prefix
    (8, 2, 80, [10], [100], True),  # head dim 80 (padded to 128)
]


@pytest.mark.parametrize("H,KVH,D,prefix,ext,kv_from_input", EXTEND_CASES)
def test_extend_bf16_vs_fp32_reference(H, KVH, D, prefix, ext, kv_from_input):
    gen = torch.Generator(device="cuda").manual_seed(H * 1000 + D + sum(ext))
    seq = [p + e for p, e in zip(prefix, ext)]
    k_buf, v_buf, r2t, rows = _paged(seq, KVH, D, gen)
    t = sum(ext)
    q = torch.randn(t, H, D, generator=gen, device="cuda").to(DT)
    starts = [sum(ext[:i]) for i in range(len(ext))]
    k_ext = torch.empty(t, KVH, D, dtype=DT, device="cuda")
    v_ext = torch.empty_like(k_ext)
    for row, p, e, s in zip(rows.tolist(), prefix, ext, starts):
        slots = r2t[row, p : p + e].long()
        k_ext[s : s + e], v_ext[s : s + e] = k_buf[slots], v_buf[slots]
    o = torch.full_like(q, float("nan"))
    scale = 1.0 / math.sqrt(D)
    extend_attention_fwd(
        q, o, k_buf, v_buf, r2t, rows, torch.tensor(seq, device="cuda"),
        torch.tensor(ext, device="cuda"), torch.tensor(starts, device="cuda"),
        max_extend_len=max(ext), sm_scale=scale,
        k_extend=k_ext if kv_from_input else None, v_extend=v_ext if kv_from_input else None,
    )
    ref = _ref_extend(q, k_buf, v_buf, r2t, rows, prefix, ext, scale)
    _check(f"extend H={H} KVH={KVH} D={D} prefix={prefix} ext={ext}", o, ref, _owner(ext))


DECODE_CASES = [
    (32, 8, 128, [1, 17, 64, 65, 1000, 4097], 16),
    (32, 8, 128, [3, 700], 8),
    (14, 2, 64, [1, 63, 129, 2048], 16),
    (8, 8, 128, [5, 300], 16),  # MHA: a single query row per program (padded to 16)
]


@pytest.mark.parametrize("H,KVH,D,seq,splits", DECODE_CASES)
def test_decode_bf16_vs_fp32_reference(H, KVH, D, seq, splits):
    gen = torch.Generator(device="cuda").manual_seed(H * 100 + D + len(seq))
    k_buf, v_buf, r2t, rows = _paged(seq, KVH, D, gen)
    q = torch.randn(len(seq), H, D, generator=gen, device="cuda").to(DT)
    o = torch.full_like(q, float("nan"))
    scale = 1.0 / math.sqrt(D)
    decode_attention_fwd(q, o, k_buf, v_buf, r2t, rows, torch.tensor(seq, device="cuda"), scale,
                         splits)
    ref = torch.stack([
        _ref_attention(q[b : b + 1], k_buf[r2t[r, :n].long()], v_buf[r2t[r, :n].long()], scale,
                       n - 1)[0]
        for b, (r, n) in enumerate(zip(rows.tolist(), seq))
    ])
    _check(f"decode H={H} KVH={KVH} D={D} seq={seq} splits={splits}", o, ref,
           lambda b: f"{b}, seq_len {seq[b]}")


@pytest.mark.parametrize("dtype,tol", [
    (torch.float16, 5e-3),  # fp16 keeps 3 more mantissa bits than bf16
    (torch.float32, 1e-4),  # ieee dots (no tf32): only summation order differs
])
def test_kernels_fp16_fp32(dtype, tol):
    gen = torch.Generator(device="cuda").manual_seed(17)
    H, KVH, D, prefix, ext = 16, 4, 128, [0, 90], [150, 40]
    seq = [p + e for p, e in zip(prefix, ext)]
    k_buf, v_buf, r2t, rows = _paged(seq, KVH, D, gen, dtype=dtype)
    q = torch.randn(sum(ext), H, D, generator=gen, device="cuda").to(dtype)
    o = torch.full_like(q, float("nan"))
    scale = 1.0 / math.sqrt(D)
    extend_attention_fwd(q, o, k_buf, v_buf, r2t, rows, torch.tensor(seq, device="cuda"),
                         torch.tensor(ext, device="cuda"), torch.tensor([0, ext[0]], device="cuda"),
                         max_extend_len=max(ext), sm_scale=scale)
    assert o.dtype == dtype
    ref = _ref_extend(q, k_buf, v_buf, r2t, rows, prefix, ext, scale)
    _check(f"extend {dtype}", o, ref, _owner(ext), atol=tol, rtol=tol, rel_norm=tol)
    qd = torch.randn(len(seq), H, D, generator=gen, device="cuda").to(dtype)
    od = torch.full_like(qd, float("nan"))
    decode_attention_fwd(qd, od, k_buf, v_buf, r2t, rows, torch.tensor(seq, device="cuda"), scale, 16)
    refd = torch.stack([
        _ref_attention(qd[b : b + 1], k_buf[r2t[r, :n].long()], v_buf[r2t[r, :n].long()], scale,
                       n - 1)[0]
        for b, (r, n) in enumerate(zip(rows.tolist(), seq))
    ])
    _check(f"decode {dtype}", od, refd, atol=tol, rtol=tol, rel_norm=tol)


# ---------------------------------------------------------------------------------- graphs
class _World:
    """Pools, backend and one layer on the GPU; row 0 is the padding row (all slots 0)."""

    def __init__(self, H=32, KVH=8, D=128, rows=16, seed=0):
        torch.manual_seed(seed)
        self.H, self.KVH, self.D = H, KVH, D
        self.req_pool = ReqToTokenPool(rows, 8192, "cuda")
        (self.pad_row,) = self.req_pool.alloc(1)
        self.kv_pool = MHATokenToKVPool(30000, DT, KVH, D, 1, "cuda")
        runner = SimpleNamespace(req_to_token_pool=self.req_pool, token_to_kv_pool=self.kv_pool,
                                 device=_cuda(), padding_req_pool_index=self.pad_row)
        self.backend = TritonAttnBackend(runner)
        self.layer = RadixAttention(H, D, 1.0 / math.sqrt(D), KVH, layer_id=0)
        self.next_slot = 1
        self.lens: dict[int, int] = {}

    def alloc(self, row, n):
        slots = torch.arange(self.next_slot, self.next_slot + n, device="cuda")
        self.next_slot += n
        self.req_pool.write(row, self.lens.get(row, 0), slots)
        self.lens[row] = self.lens.get(row, 0) + n
        return slots

    def cache_prefix(self, row, n):
        slots = self.alloc(row, n)
        kv = torch.randn(2, n, self.KVH, self.D, device="cuda").to(DT)
        self.kv_pool.set_kv_buffer(0, slots, kv[0], kv[1])

    def rand(self, t, heads):
        return torch.randn(t, heads * self.D, device="cuda").to(DT)

    def batch(self, mode, rows, ext=None, locs=None, tensors=None):
        """ForwardBatch over `rows` whose tokens of this pass are already allocated (so
        `self.lens` includes them); `tensors` overrides fields with a graph's static buffers."""
        b = len(rows)
        seq = [self.lens.get(r, 0) for r in rows]
        f = dict(req_pool_indices=torch.tensor(rows, device="cuda"),
                 seq_lens=torch.tensor(seq, device="cuda"), seq_lens_cpu=torch.tensor(seq))
        t = b
        if mode == ForwardMode.EXTEND:
            t = sum(ext)
            f.update(
                extend_seq_lens=torch.tensor(ext, device="cuda"),
                extend_prefix_lens=torch.tensor([s - e for s, e in zip(seq, ext)], device="cuda"),
                extend_start_loc=torch.tensor([sum(ext[:i]) for i in range(b)], device="cuda"),
                extend_seq_lens_cpu=list(ext), extend_num_tokens=t,
            )
        f.update(tensors or {})
        if locs is None:
            locs = torch.zeros(t, dtype=torch.int64, device="cuda")
        return ForwardBatch(
            forward_mode=mode, batch_size=b,
            input_ids=torch.zeros(t, dtype=torch.int64, device="cuda"),
            positions=torch.zeros(t, dtype=torch.int64, device="cuda"), out_cache_loc=locs,
            req_to_token_pool=self.req_pool, token_to_kv_pool=self.kv_pool,
            attn_backend=self.backend, **f,
        )

    def capture(self, static_q, static_k, static_v, fb):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: Triton compiles outside the capture
            self.layer(static_q, static_k, static_v, fb)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.layer(static_q, static_k, static_v, fb)
        return graph, out


def _equal_or_explain(name, graph_out, eager_out):
    if torch.equal(graph_out, eager_out):
        return
    diff = (graph_out.float() - eager_out.float()).abs()
    rows = torch.nonzero(diff.amax(dim=1) > 0).flatten().tolist()
    raise AssertionError(
        f"{name}: graph replay differs from eager on {len(rows)} rows (first {rows[:10]}), max "
        f"abs diff {diff.max().item():.4g}"
    )


def test_decode_cuda_graph_replay_matches_eager():
    w = _World()
    for row, n in ((1, 5), (2, 700), (3, 64), (4, 4100), (5, 1), (6, 129)):
        w.cache_prefix(row, n)
    max_bs, bs = 16, 8
    w.backend.init_cuda_graph_state(max_bs, max_bs)
    st = dict(
        q=w.rand(bs, w.H), k=w.rand(bs, w.KVH), v=w.rand(bs, w.KVH),
        loc=torch.zeros(bs, dtype=torch.int64, device="cuda"),
        req=torch.full((bs,), w.pad_row, device="cuda"),
        seq=torch.ones(bs, dtype=torch.int64, device="cuda"),
    )
    # The capture batch as a runner builds it: every row is the padding row with seq_len 1.
    cap = w.batch(ForwardMode.DECODE, [w.pad_row] * bs, locs=st["loc"],
                  tensors=dict(req_pool_indices=st["req"], seq_lens=st["seq"]))
    w.backend.init_forward_metadata_capture_cuda_graph(bs, bs, st["req"], st["seq"],
                                                       ForwardMode.DECODE, cap)
    graph, static_out = w.capture(st["q"], st["k"], st["v"], cap)

    for rows in ([3, 1, 5], [1, 2, 3, 4, 5, 6], [4]):
        n = len(rows)
        locs = torch.cat([w.alloc(r, 1) for r in rows])
        live = w.batch(ForwardMode.DECODE, rows, locs=locs)
        q, k, v = w.rand(n, w.H), w.rand(n, w.KVH), w.rand(n, w.KVH)
        st["q"][:n], st["k"][:n], st["v"][:n] = q, k, v
        st["q"][n:].normal_()  # padded rows hold anything
        st["loc"][:n] = locs
        st["loc"][n:] = 0
        w.backend.init_forward_metadata_replay_cuda_graph(
            bs, live.req_pool_indices, live.seq_lens, live.seq_lens_cpu, ForwardMode.DECODE, live)
        graph.replay()
        graph_out = static_out[:n].clone()
        w.backend.init_forward_metadata(live)
        eager_out = w.layer(q, k, v, live)
        _equal_or_explain(f"decode rows {rows}", graph_out, eager_out)
        k_buf, v_buf = w.kv_pool.get_key_buffer(0), w.kv_pool.get_value_buffer(0)
        slots = [w.req_pool.req_to_token[r, : w.lens[r]].long() for r in rows]
        ref = torch.stack([
            _ref_attention(q.view(n, w.H, w.D)[i : i + 1], k_buf[sl], v_buf[sl], w.layer.scaling,
                           w.lens[r] - 1)[0]
            for i, (r, sl) in enumerate(zip(rows, slots))
        ])
        _check(f"decode graph rows {rows}", graph_out.view(n, w.H, w.D), ref)


def test_full_prefill_cuda_graph_replay_matches_eager():
    w = _World()
    w.cache_prefix(2, 100)
    w.cache_prefix(5, 1000)
    w.cache_prefix(3, 57)
    slots, bucket = 4, 256  # two 128-row tiles on sm90
    w.backend.init_cuda_graph_state(slots, bucket)
    st = dict(
        q=w.rand(bucket, w.H), k=w.rand(bucket, w.KVH), v=w.rand(bucket, w.KVH),
        loc=torch.zeros(bucket, dtype=torch.int64, device="cuda"),
        req=torch.full((slots,), w.pad_row, device="cuda"),
        seq=torch.tensor([bucket, 0, 0, 0], device="cuda"),
        ext=torch.tensor([bucket, 0, 0, 0], device="cuda"),
        start=torch.zeros(slots, dtype=torch.int64, device="cuda"),
    )
    # The capture batch as a runner builds it: request 0 (the padding row) holds the bucket.
    cap = w.batch(ForwardMode.EXTEND, [w.pad_row] * slots, ext=[bucket, 0, 0, 0], locs=st["loc"],
                  tensors=dict(req_pool_indices=st["req"], seq_lens=st["seq"],
                               extend_seq_lens=st["ext"], extend_start_loc=st["start"]))
    w.backend.init_forward_metadata_capture_cuda_graph(slots, bucket, st["req"], st["seq"],
                                                       ForwardMode.EXTEND, cap)
    graph, static_out = w.capture(st["q"], st["k"], st["v"], cap)

    # Three requests (two over cached prefixes), then one: stale slots must be neutralised.
    for rows, ext in (([2, 4, 5], [90, 130, 30]), ([3], [199]), ([6, 7], [1, 255])):
        t = sum(ext)
        locs = torch.cat([w.alloc(r, e) for r, e in zip(rows, ext)])
        live = w.batch(ForwardMode.EXTEND, rows, ext=ext, locs=locs)
        q, k, v = w.rand(t, w.H), w.rand(t, w.KVH), w.rand(t, w.KVH)
        st["q"][:t], st["k"][:t], st["v"][:t] = q, k, v
        st["q"][t:].normal_()
        st["loc"][:t] = locs
        st["loc"][t:] = 0
        w.backend.init_forward_metadata_replay_cuda_graph(
            len(rows), live.req_pool_indices, live.seq_lens, live.seq_lens_cpu,
            ForwardMode.EXTEND, live)
        graph.replay()
        graph_out = static_out[:t].clone()
        w.backend.init_forward_metadata(live)
        eager_out = w.layer(q, k, v, live)
        _equal_or_explain(f"prefill rows {rows} ext {ext}", graph_out, eager_out)
        prefix = [w.lens[r] - e for r, e in zip(rows, ext)]
        ref = _ref_extend(q.view(t, w.H, w.D), w.kv_pool.get_key_buffer(0),
                          w.kv_pool.get_value_buffer(0), w.req_pool.req_to_token,
                          live.req_pool_indices, prefix, ext, w.layer.scaling)
        _check(f"prefill graph rows {rows} ext {ext}", graph_out.view(t, w.H, w.D), ref, _owner(ext))
