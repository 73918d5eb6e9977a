"""The tc_piecewise body on the CPU (what the GPU runner then captures per bucket): torch.compile
with inductor, attention an opaque op, so Dynamo traces the body as one graph with no break; the
compiled body equals the eager one (float32) at several token counts, attention runs eagerly
inside it, and the fused layers take their torch paths while Dynamo traces."""

from __future__ import annotations

import pytest
import torch

from helpers import make_runner, tiny_checkpoint
from sglang.srt.configs.forward_batch_info import ForwardBatch, GraphBreaker
from sglang.srt.layers.radix_attention import RadixAttention, attention_context
from sglang.srt.layers.triton_ops.dispatch import fused_kernels, use_triton
from sglang.srt.model_executor.batch_builder import ExtendRequest, build_extend_batch
from sglang.srt.model_executor.runner.piecewise_compile import compile_body


def extend_batch(runner, lengths: list[int], seed: int):
    gen = torch.Generator().manual_seed(seed)
    reqs = []
    for n in lengths:
        row = runner.req_to_token_pool.alloc(1)[0]
        ids = torch.randint(3, 400, (n,), generator=gen).tolist()
        reqs.append(ExtendRequest(row, ids, 0, runner.token_to_kv_pool_allocator.alloc(n)))
    fb = build_extend_batch(reqs, runner.req_to_token_pool, runner.device)
    runner.attach_pools(fb)
    runner.attn_backend.init_forward_metadata(fb)
    return fb


@pytest.fixture(scope="module")
def runner():
    return make_runner(tiny_checkpoint("qwen3", seed=4), max_running_requests=32)


def test_the_body_is_one_graph_with_attention_as_an_opaque_op(runner) -> None:
    layers = {m.layer_id: m for m in runner.model.modules() if isinstance(m, RadixAttention)}
    fb = extend_batch(runner, [7, 5], seed=1)
    with torch.no_grad(), attention_context(fb, layers):
        explained = torch._dynamo.explain(runner.model.model)(fb.input_ids, fb.positions, fb)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    ops = [str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert ops.count("sglang.radix_attention") == len(layers) == len(runner.model.model.layers), ops


def test_attention_runs_eagerly_inside_the_compiled_body(runner) -> None:
    calls = []
    layer = next(m for m in runner.model.modules() if isinstance(m, RadixAttention))
    original = layer.attend_eagerly

    def spy(*args, **kwargs):
        calls.append(torch.compiler.is_compiling())
        return original(*args, **kwargs)

    layer.attend_eagerly = spy
    try:
        body = compile_body(runner.model)
        with torch.no_grad():
            fb = extend_batch(runner, [6], seed=7)
            body(fb.input_ids, fb.positions, fb)
            body(fb.input_ids, fb.positions, fb)
    finally:
        del layer.attend_eagerly
    assert calls == [False, False]  # once per run, never traced, never compiled


def test_compiled_body_equals_eager_at_every_token_count(runner) -> None:
    body = compile_body(runner.model)
    torch._dynamo.reset()
    with torch.no_grad():
        for lengths, seed in (([7, 5], 2), ([13], 3), ([4, 9, 2], 4), ([1], 5)):
            fb = extend_batch(runner, lengths, seed)
            eager = runner.model.model(fb.input_ids, fb.positions, fb).clone()
            fb = extend_batch(runner, lengths, seed)  # the same tokens again, fresh KV slots
            compiled = body(fb.input_ids, fb.positions, fb)
            torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


class SharedBufferBreaker(GraphBreaker):
    """What the breakable graph does at capture, on the CPU: every break of the eager path writes
    into one shared buffer; the compiled path's breaks write into the buffer the caller passes."""

    def __init__(self, fb: ForwardBatch) -> None:
        self.fb, self.shared, self.into = fb, None, 0

    def eager(self, fn, *tensors):
        return fn(self.fb, *tensors)

    def eager_into(self, fn, out, *tensors):
        self.into += 1
        fn(self.fb, *tensors, out)

    def output_buffer(self, shape, dtype, device):
        if self.shared is None:
            self.shared = torch.empty(shape, dtype=dtype, device=device)
        return self.shared[: shape[0]]


def test_compiled_breaks_write_into_the_compiled_bodys_own_buffers(runner) -> None:
    """Inductor reuses dead buffers: an attention op that handed back a buffer of its own (the
    breakable graph's shared break output) found it again as the next layer's q. The op writes into
    a buffer inductor allocated instead, through the breaker's `eager_into`, once per layer."""
    body = compile_body(runner.model)
    with torch.no_grad():
        for lengths, seed in (([9, 4], 11), ([1], 12)):
            fb = extend_batch(runner, lengths, seed)
            eager = runner.model.model(fb.input_ids, fb.positions, fb).clone()
            fb = extend_batch(runner, lengths, seed)
            fb.graph_breaker = breaker = SharedBufferBreaker(fb)
            compiled = body(fb.input_ids, fb.positions, fb)
            assert breaker.into == len(runner.model.model.layers) and breaker.shared is None
            torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


def test_fused_layers_take_their_torch_paths_under_compile() -> None:
    seen = []

    def probe(x: torch.Tensor) -> torch.Tensor:
        seen.append(use_triton(x))
        return x + 1

    x = torch.ones(2, device="cpu")
    with fused_kernels("triton"):  # Triton everywhere (interpreted on this CPU)...
        probe(x)
        torch.compile(probe, backend="eager")(x)  # ...except in what Dynamo traces
    assert seen == [True, False]
