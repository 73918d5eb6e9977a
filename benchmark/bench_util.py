"""What the kernel benchmarks share: GPU time under CUDA-graph replay, and writing their table."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from sglang.srt.tools.make_checkpoint import PRESETS

# The dry runs' shape: (hidden, q, kv, intermediate, vocab, layers), small enough for the interpreter.
TINY_DIMS = (64, 64, 32, 96, 160, 2)


def model_dims(name: str) -> tuple[int, int, int, int, int, int]:
    """(hidden, q, kv, intermediate, vocab, layers) of a make_checkpoint preset ("tiny": TINY_DIMS)."""
    if name == "tiny":
        return TINY_DIMS
    s = PRESETS[name]["shape"]
    head_dim = s.get("head_dim", s["hidden_size"] // s["num_attention_heads"])
    return (s["hidden_size"], s["num_attention_heads"] * head_dim, s["num_key_value_heads"] * head_dim,
            s["intermediate_size"], s["vocab_size"], s["num_hidden_layers"])


@contextlib.contextmanager
def module_knobs(settings: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Each (module, name, value): the module constant set while the block runs, restored after
    (also when it raises). Kernels read such knobs at launch, runners when they capture."""
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in settings]
    try:
        for mod, name, value in settings:
            setattr(mod, name, value)
        yield
    finally:
        for mod, name, value in reversed(saved):
            setattr(mod, name, value)


def graph_us(fn: Callable[[int], None], calls: int = 1, warmup: int = 10, rep: int = 100) -> float:
    """GPU µs per call of `fn(i)`, i = 0..calls-1 captured in one graph and replayed (no Python
    launch cost); the calls run once on the capture stream first (compilation, warm-up)."""
    import triton

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    return triton.testing.do_bench(graph.replay, warmup=warmup, rep=rep) * 1e3 / calls


def emit_table(lines: list[str], out: Optional[str]) -> None:
    """Print the markdown, and write it to `out` when given."""
    text = "\n".join(lines)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


def add_output_args(parser) -> None:
    parser.add_argument("--out", default=None, help="also write the markdown here")
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")


def target(args) -> tuple[bool, str, torch.dtype, list[str]]:
    """(dry run, device, dtype, model shapes): the tiny shape in float32 on the CPU for a dry run."""
    dry = args.cpu_dry_run
    device, dtype = ("cpu", torch.float32) if dry else ("cuda", torch.bfloat16)
    return dry, device, dtype, ["tiny"] if dry else args.models
