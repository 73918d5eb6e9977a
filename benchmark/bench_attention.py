"""Micro-benchmark of the triton attention kernels against torch SDPA (GPU only).

    python benchmark/bench_attention.py            # the table
    python benchmark/bench_attention.py --sweep    # also time alternative tile configs

Extend: one request, causal, T new tokens (no prefix, and once over a 4096-token cached prefix).
Decode: bs requests of `ctx` tokens each, one query token.

Timing: each op is captured `n` times into a CUDA graph over `n` independent input sets (enough to
exceed the 60 MB L2, so K/V come from HBM as they do in a real forward), replays are timed with
CUDA events, and the median per op is reported in microseconds. Graph replay removes the Python
launch overhead, which would otherwise dominate these 10-100 us kernels; it is also how the engine
runs them. SDPA gets contiguous, already gathered K/V with the GQA heads expanded outside the
timing: the easy-case baseline (our kernels read the paged pool through req_to_token).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Callable

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from sglang.srt.layers.attention.triton_ops.decode_attention import (  # noqa: E402
    DecodeConfig,
    decode_attention_fwd,
    default_num_kv_splits,
)
from sglang.srt.layers.attention.triton_ops.extend_attention import (  # noqa: E402
    ExtendConfig,
    extend_attention_fwd,
)

MODELS = {"Qwen3-4B": (32, 8, 128), "Llama-3.1-8B": (32, 8, 128), "Qwen2.5-0.5B": (14, 2, 64)}
DT = torch.bfloat16
ROTATE_BYTES = 160 << 20  # > 2x the H200's L2


def graph_time_us(fns: list[Callable[[], None]], reps: int = 30) -> float:
    """Median time of one call, running each of `fns` once per graph replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns[:2]:
            fn()  # compile / autotune outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fns))
    return statistics.median(times)


def _copies(nbytes: int) -> int:
    return max(1, min(32, -(-ROTATE_BYTES // max(nbytes, 1))))


def _paged_pool(num_reqs, ctx, kvh, d):
    slots = num_reqs * ctx + 1
    k_buf = torch.randn(slots, kvh, d, device="cuda", dtype=DT)
    v_buf = torch.randn(slots, kvh, d, device="cuda", dtype=DT)
    # Shuffled slots: a long-running server's pool is fragmented.
    perm = (torch.randperm(slots - 1, device="cuda") + 1).to(torch.int32)
    return k_buf, v_buf, perm.view(num_reqs, ctx).contiguous()


def _expand(buf, slots, group):
    """Gathered, GQA-expanded, contiguous K or V for SDPA: [..., H, L, D]."""
    return buf[slots].repeat_interleave(group, -2).transpose(-3, -2).contiguous()


def bench_extend(h, kvh, d, tokens, prefix=0, config=None, with_sdpa=True):
    scale, group = d ** -0.5, h // kvh
    meta = [torch.zeros(1, dtype=torch.int64, device="cuda"),
            torch.tensor([prefix + tokens], device="cuda"),
            torch.tensor([tokens], device="cuda"), torch.zeros(1, dtype=torch.int64, device="cuda")]
    n = _copies(2 * (prefix + tokens) * kvh * d * 2 + 2 * tokens * h * d * 2)
    ours, sdpa = [], []
    for _ in range(n):
        k_buf, v_buf, r2t = _paged_pool(1, prefix + tokens, kvh, d)
        q = torch.randn(tokens, h, d, device="cuda", dtype=DT)
        o = torch.empty_like(q)
        new = r2t[0, prefix:].long()
        k_ext, v_ext = k_buf[new], v_buf[new]
        ours.append(lambda q=q, o=o, k_buf=k_buf, v_buf=v_buf, r2t=r2t, k_ext=k_ext, v_ext=v_ext:
                    extend_attention_fwd(q, o, k_buf, v_buf, r2t, *meta, max_extend_len=tokens,
                                         sm_scale=scale, k_extend=k_ext, v_extend=v_ext,
                                         config=config))
        if with_sdpa:
            qs = q.transpose(0, 1)[None]
            ks, vs = _expand(k_buf, r2t[0].long(), group)[None], _expand(v_buf, r2t[0].long(), group)[None]
            if prefix:
                mask = torch.arange(prefix + tokens, device="cuda")[None] <= (
                    prefix + torch.arange(tokens, device="cuda"))[:, None]
                sdpa.append(lambda qs=qs, ks=ks, vs=vs, mask=mask: F.scaled_dot_product_attention(
                    qs, ks, vs, attn_mask=mask, scale=scale))
            else:
                sdpa.append(lambda qs=qs, ks=ks, vs=vs: F.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=True, scale=scale))
    t_ours = graph_time_us(ours)
    t_sdpa = graph_time_us(sdpa) if with_sdpa else float("nan")
    # Causal FLOPs: QK^T and PV over the visible keys (all the prefix + half the new block).
    flops = 4 * h * d * tokens * (prefix + (tokens + 1) / 2)
    return t_ours, t_sdpa, f"{flops / t_ours / 1e6:.0f} TFLOP/s"


def bench_decode(h, kvh, d, bs, ctx, splits, config=None, with_sdpa=True):
    scale, group = d ** -0.5, h // kvh
    kv_bytes = 2 * bs * ctx * kvh * d * 2  # what our kernel must read (SDPA reads group x more)
    rows = torch.arange(bs, device="cuda")
    seq = torch.full((bs,), ctx, device="cuda")
    part_o = torch.empty(bs, h, splits, d, device="cuda", dtype=torch.float32)
    part_lse = torch.empty(bs, h, splits, device="cuda", dtype=torch.float32)
    ours, sdpa = [], []
    for _ in range(_copies(kv_bytes * (1 + group * with_sdpa))):
        k_buf, v_buf, r2t = _paged_pool(bs, ctx, kvh, d)
        q = torch.randn(bs, h, d, device="cuda", dtype=DT)
        o = torch.empty_like(q)
        ours.append(lambda q=q, o=o, k_buf=k_buf, v_buf=v_buf, r2t=r2t: decode_attention_fwd(
            q, o, k_buf, v_buf, r2t, rows, seq, scale, splits, part_o, part_lse, config=config))
        if with_sdpa:
            ks, vs = _expand(k_buf, r2t.long(), group), _expand(v_buf, r2t.long(), group)
            qs = q[:, :, None, :]
            sdpa.append(lambda qs=qs, ks=ks, vs=vs: F.scaled_dot_product_attention(
                qs, ks, vs, scale=scale))
        del k_buf, v_buf
    t_ours = graph_time_us(ours)
    t_sdpa = graph_time_us(sdpa) if with_sdpa else float("nan")
    return t_ours, t_sdpa, f"{kv_bytes / t_ours / 1e3:.0f} GB/s"


def sweep() -> None:
    print("\nsweep (us per call, triton only)")
    for d, (h, kvh) in ((128, (32, 8)), (64, (14, 2))):
        for cfg in (ExtendConfig(64, 64, 4, 3), ExtendConfig(64, 128, 4, 3),
                    ExtendConfig(64, 128, 8, 3), ExtendConfig(64, 32, 4, 3),
                    ExtendConfig(128, 64, 8, 3), ExtendConfig(128, 128, 8, 3)):
            t = [bench_extend(h, kvh, d, n, p, cfg, with_sdpa=False)[0]
                 for n, p in ((128, 0), (2048, 0), (512, 4096))]
            print(f"extend D={d} {cfg}: T128 {t[0]:.1f}  T2048 {t[1]:.1f}  T512+4096 {t[2]:.1f}")
        for cfg in (DecodeConfig(128, 4, 2), DecodeConfig(128, 8, 2), DecodeConfig(64, 4, 2)):
            for sp in (16, 32):
                t = [bench_decode(h, kvh, d, bs, ctx, sp, cfg, with_sdpa=False)[0]
                     for bs, ctx in ((1, 1024), (1, 8192), (32, 1024), (32, 8192))]
                print(f"decode D={d} {cfg} splits={sp}: bs1/1k {t[0]:.1f}  bs1/8k {t[1]:.1f}  "
                      f"bs32/1k {t[2]:.1f}  bs32/8k {t[3]:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time alternative tile configs")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention.py needs a CUDA device")
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}, bf16, CUDA-graph timing")
    rows = []
    for name in ("Qwen3-4B", "Qwen2.5-0.5B"):  # Llama-3.1-8B has Qwen3-4B's attention shape
        h, kvh, d = MODELS[name]
        splits = default_num_kv_splits(torch.device("cuda"), kvh)
        for tokens, prefix in ((128, 0), (2048, 0), (512, 4096)):
            rows.append((name, f"extend T={tokens} prefix={prefix}",
                         *bench_extend(h, kvh, d, tokens, prefix)))
        for bs in (1, 32):
            for ctx in (1024, 8192):
                rows.append((name, f"decode bs={bs} ctx={ctx} S={splits}",
                             *bench_decode(h, kvh, d, bs, ctx, splits)))
        torch.cuda.empty_cache()
    print(f"{'model':<14}{'case':<28}{'triton us':>11}{'sdpa us':>10}{'sdpa/triton':>13}  achieved")
    for name, case, t, s, ach in rows:
        print(f"{name:<14}{case:<28}{t:>11.1f}{s:>10.1f}{s / t:>13.2f}  {ach}")
    if args.sweep:
        sweep()


if __name__ == "__main__":
    main()
