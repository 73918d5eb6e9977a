"""Micro-benchmark of the LoRA kernels: shrink + expand of one decoder layer, triton vs csgmv.

    python benchmark/lora/bench_lora_kernels.py [--rank 16] [--tokens 16 128 2048] [--adapters 1 4]

Shapes are Qwen3-4B's (hidden 2560, q 4096, kv 1024, intermediate 9728), bf16. For each token
count and adapter count the batch is split into requests (16 tokens: 16 decode requests; more:
4 prefill requests) assigned round-robin to the adapters. Every row times the four LoRA calls of
a layer (qkv, o, gate_up, down) with `triton.testing.do_bench` over a CUDA-graph replay of
them (GPU time, without Python launch overhead); "eager" prepares the metadata for
this batch alone, "graph" runs the same kernels with the static info a CUDA graph reads, captured
on a bucket of exactly this batch's size with its launch dimensions frozen (decode: the decode
info sized for 64 requests; prefill: the prefill info sized for an 8192-token largest bucket). The base-model GEMMs of the same four projections are timed
for scale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

from sglang.srt.lora.backend.chunked_backend import ChunkedSgmvLoRABackend  # noqa: E402
from sglang.srt.lora.backend.triton_backend import TritonLoRABackend  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402

HIDDEN, Q, KV, INTER = 2560, 4096, 1024, 9728
MLPB = 8
PREFILL_MAX_BUCKET = 8192
DECODE_MAX_BS = 64
DEV = "cuda"
DTYPE = torch.bfloat16


def make_batch(seq_lens: list[int], mode: ForwardMode) -> ForwardBatch:
    bs = len(seq_lens)
    extend = mode.is_extend()
    num_tokens = sum(seq_lens) if extend else bs
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    return ForwardBatch(
        forward_mode=mode,
        batch_size=bs,
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=DEV),
        positions=torch.zeros(num_tokens, dtype=torch.int64, device=DEV),
        out_cache_loc=torch.zeros(num_tokens, dtype=torch.int64, device=DEV),
        req_pool_indices=torch.arange(bs, device=DEV),
        seq_lens=lens.to(DEV),
        seq_lens_cpu=lens,
        extend_seq_lens=lens.to(DEV) if extend else None,
        extend_seq_lens_cpu=list(seq_lens) if extend else None,
        extend_num_tokens=num_tokens if extend else None,
    )


def make_pool(rank: int) -> dict[str, torch.Tensor]:
    def pool(c: int, out_dim: int, in_dim: int):
        a = torch.randn(MLPB, c * rank, in_dim, device=DEV, dtype=DTYPE) / in_dim**0.5
        b = torch.randn(MLPB, out_dim, rank, device=DEV, dtype=DTYPE) / rank**0.5
        return a, b

    w = {}
    w["qkv_a"], w["qkv_b"] = pool(3, Q + 2 * KV, HIDDEN)
    w["gate_up_a"], w["gate_up_b"] = pool(2, 2 * INTER, HIDDEN)
    w["o_a"], w["o_b"] = pool(1, HIDDEN, Q)
    w["down_a"], w["down_b"] = pool(1, HIDDEN, INTER)
    return w


def layer_fn(backend, io: dict[str, torch.Tensor], w: dict[str, torch.Tensor]):
    def run():
        backend.run_qkv_lora(io["x"], w["qkv_a"], w["qkv_b"], io["offsets"], max(Q, KV), io["qkv"])
        backend.run_gate_up_lora(io["x"], w["gate_up_a"], w["gate_up_b"], io["gate_up"])
        backend.run_lora_b_sgemm(backend.run_lora_a_sgemm(io["attn"], w["o_a"]), w["o_b"], io["o"])
        backend.run_lora_b_sgemm(backend.run_lora_a_sgemm(io["act"], w["down_a"]), w["down_b"], io["down"])

    return run


def base_fn(io: dict[str, torch.Tensor], base_w: dict[str, torch.Tensor]):
    def run():
        torch.matmul(io["x"], base_w["qkv"].T)
        torch.matmul(io["x"], base_w["gate_up"].T)
        torch.matmul(io["attn"], base_w["o"].T)
        torch.matmul(io["act"], base_w["down"].T)

    return run


def make_io(rows: int) -> dict[str, torch.Tensor]:
    def rnd(width):
        return torch.randn(rows, width, device=DEV, dtype=DTYPE)

    return {
        "x": rnd(HIDDEN),
        "attn": rnd(Q),
        "act": rnd(INTER),
        "qkv": rnd(Q + 2 * KV),
        "gate_up": rnd(2 * INTER),
        "o": rnd(HIDDEN),
        "down": rnd(HIDDEN),
        "offsets": torch.tensor([0, Q, Q + KV, Q + 2 * KV], dtype=torch.int32, device=DEV),
    }


def split(num_tokens: int) -> tuple[list[int], ForwardMode]:
    if num_tokens <= 16:
        return [1] * num_tokens, ForwardMode.DECODE
    return [num_tokens // 4] * 4, ForwardMode.EXTEND


def prepare(backend, lens, mode, slots, ranks, scalings, graph: bool) -> int:
    """Prepare metadata; returns the number of rows the kernels run over."""
    fb = make_batch(lens, mode)
    if not graph:
        backend.prepare_lora_batch(fb, slots, ranks, scalings, use_cuda_graph=False)
        return fb.num_tokens
    # Captured on the bucket of this batch's size (as the graph runners do), statics sized for
    # the largest bucket; then refreshed in place with the live batch.
    rows = fb.num_tokens
    if mode.is_decode():
        backend.init_cuda_graph_batch_info(DECODE_MAX_BS, 1)
        capture = make_batch([1] * rows, mode)
        backend.prepare_lora_batch(capture, [0] * rows, [0] * MLPB, [0.0] * MLPB, True)
        frozen = (backend.batch_info.bs, backend.batch_info.max_len)
        backend.prepare_lora_batch(fb, slots, ranks, scalings, True)
    else:
        backend.init_prefill_cuda_graph_batch_info(PREFILL_MAX_BUCKET)
        capture = make_batch([rows], mode)
        backend.prepare_lora_batch(capture, [0], [0] * MLPB, [0.0] * MLPB, False, True)
        frozen = (backend.batch_info.bs, backend.batch_info.max_len)
        backend.prepare_lora_batch(fb, slots, ranks, scalings, False, True)
    backend.batch_info.bs, backend.batch_info.max_len = frozen  # the grid a replay would use
    return rows


REPS_PER_GRAPH = 10


def gpu_time_us(fn) -> float:
    """GPU time of one `fn`, from replays of a CUDA graph holding REPS_PER_GRAPH calls of it
    (no Python launch overhead; the graph launch itself is amortised over the repetitions)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile / warm up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS_PER_GRAPH):
            fn()
    return triton.testing.do_bench(graph.replay) * 1e3 / REPS_PER_GRAPH


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 128, 2048])
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_lora_kernels needs a CUDA device")

    torch.manual_seed(0)
    w = make_pool(args.rank)
    base_w = {
        "qkv": torch.randn(Q + 2 * KV, HIDDEN, device=DEV, dtype=DTYPE),
        "gate_up": torch.randn(2 * INTER, HIDDEN, device=DEV, dtype=DTYPE),
        "o": torch.randn(HIDDEN, Q, device=DEV, dtype=DTYPE),
        "down": torch.randn(HIDDEN, INTER, device=DEV, dtype=DTYPE),
    }
    backends = {
        "triton": lambda: TritonLoRABackend(MLPB, DEV),
        "csgmv": lambda: ChunkedSgmvLoRABackend(MLPB, DEV),
        "csgmv/128": lambda: ChunkedSgmvLoRABackend(MLPB, DEV, max_lora_chunk_size=128),
    }
    print(f"# {torch.cuda.get_device_name()}  rank {args.rank}  Qwen3-4B shapes  bf16  "
          f"torch {torch.__version__}  triton {triton.__version__}")
    print("# GPU microseconds for the 4 LoRA calls of one layer (qkv, o, gate_up, down), graph replay")
    header = f"{'tokens':>6} {'adapters':>8} {'base gemm':>10} " + " ".join(
        f"{name + ' ' + kind:>17}" for name in backends for kind in ("eager", "graph")
    )
    print(header)
    for num_tokens in args.tokens:
        lens, mode = split(num_tokens)
        for n_adapters in args.adapters:
            slots = [1 + i % n_adapters for i in range(len(lens))]
            ranks = [0] + [args.rank] * n_adapters + [0] * (MLPB - 1 - n_adapters)
            scalings = [0.0] + [1.0] * n_adapters + [0.0] * (MLPB - 1 - n_adapters)
            io = make_io(num_tokens)
            cells = [f"{gpu_time_us(base_fn(io, base_w)):10.1f}"]
            for make in backends.values():
                for graph in (False, True):
                    backend = make()
                    rows = prepare(backend, lens, mode, slots, ranks, scalings, graph)
                    assert rows == num_tokens
                    cells.append(f"{gpu_time_us(layer_fn(backend, io, w)):17.1f}")
            print(f"{num_tokens:>6} {n_adapters:>8} " + " ".join(cells))


if __name__ == "__main__":
    main()
