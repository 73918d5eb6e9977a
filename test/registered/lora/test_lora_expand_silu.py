"""The unfolded gate_up_proj's expand and the SiLU-and-mul in one kernel (lora/triton_ops/expand_silu.py)
against the two kernels it replaces, the segmented expand into gate_up's output then
silu_and_mul_fwd (CPU, TRITON_INTERPRET=1, tiny shapes): the same bits, float32 and bf16."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.triton_ops.silu_and_mul import silu_and_mul_fwd
from sglang.srt.lora.segments import build_segments
from sglang.srt.lora.triton_ops.expand_silu import segmented_expand_silu
from sglang.srt.lora.triton_ops.sgemm_lora_b import segmented_expand
from sglang.srt.lora.utils import LoRABatchInfo

MAX_RANK = 16
# Slot 0 holds the base model (rank 0); slot 3 a rank that is not a multiple of 16
# (test_rank_blocks_and_a_strided_output takes ranks past one 16-deep block).
RANKS = [0, 8, 16, 5]
SCALINGS = [0.0, 0.5, 2.0, 1.25]


def _info(req_slots, req_lens, num_rows: int, ranks, chunk: int = 16, graph_rows: int = 0) -> LoRABatchInfo:
    """A batch's segments as the backends build them: every row (padding too) in one segment; with
    `graph_rows`, as a graph's static segments, whose inactive run goes on to that many rows."""
    segs = build_segments(req_slots, req_lens, ranks, chunk, max(num_rows, graph_rows), idle_slot=0)
    return LoRABatchInfo(
        num_rows=num_rows, bs=segs.num_segments, num_segments=segs.num_segments, max_len=chunk,
        seg_indptr=torch.tensor(segs.seg_indptr, dtype=torch.int32),
        weight_indices=torch.tensor(segs.weight_indices, dtype=torch.int32),
        lora_ranks=torch.tensor(ranks, dtype=torch.int32),
        scalings=torch.tensor(SCALINGS + [0.75] * (len(ranks) - len(SCALINGS)), dtype=torch.float32),
        permutation=segs.permutation.to(torch.int32),
    )


def _case(d: int, ranks, dtype, seed: int, max_rank: int = MAX_RANK, graph_rows: int = 0):
    gen = torch.Generator().manual_seed(seed)
    # Requests on slots 1, none, 2, 1, 3 (one of 0 tokens) and a rank-0 slot; 3 padding rows.
    req_slots, req_lens = [1, -1, 2, 1, 3, 0, 2], [5, 3, 20, 1, 0, 4, 9]
    num_rows = sum(req_lens) + 3
    info = _info(req_slots, req_lens, num_rows, ranks, graph_rows=graph_rows)
    gate_up = (torch.randn(num_rows, 2 * d, generator=gen) * 2).to(dtype)
    xa = torch.randn(num_rows, 2 * max_rank, generator=gen).to(dtype)
    b = (torch.randn(len(ranks), 2 * d, max_rank, generator=gen) * 0.3).to(dtype)
    for slot, r in enumerate(ranks):
        b[slot, :, r:] = float("nan")  # past the adapter's rank: must never be read
    return info, gate_up, xa, b


def _unfused(info, gate_up, xa, b):
    base = gate_up.clone()
    segmented_expand(xa, b, info, base, 2)
    return silu_and_mul_fwd(base)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [24, 40])
def test_expand_and_silu_in_one_kernel_give_the_unfused_bits(dtype, d):
    info, gate_up, xa, b = _case(d, RANKS, dtype, seed=d)
    expected = _unfused(info, gate_up, xa, b)
    before = gate_up.clone()
    out = torch.full((gate_up.shape[0], d), -777.0, dtype=dtype)
    got = segmented_expand_silu(xa, b, info, gate_up, out)
    assert got is out and torch.equal(got, expected)
    assert torch.equal(gate_up, before), "gate_up's output must be read only"
    assert not torch.isnan(got).any()
    # The base rows' (rank 0, no adapter, padding) activation is the plain one.
    plain = silu_and_mul_fwd(gate_up)
    lora_rows = [r for seg, slot in enumerate(info.weight_indices.tolist()) if RANKS[slot] > 0
                 for r in info.permutation[info.seg_indptr[seg]:info.seg_indptr[seg + 1]].tolist()]
    base_rows = sorted(set(range(gate_up.shape[0])) - set(lora_rows))
    assert base_rows and torch.equal(got[base_rows], plain[base_rows])
    assert not torch.equal(got[lora_rows], plain[lora_rows])


def test_rank_blocks_and_a_strided_output():
    """Ranks past one 16-deep block (two dot rounds), into the first d columns of a wider buffer
    (down_proj's x_aug)."""
    ranks = [0, 24, 32, 5]
    info, gate_up, xa, b = _case(24, ranks, torch.float32, seed=3, max_rank=32)
    expected = _unfused(info, gate_up, xa, b)
    x_aug = torch.full((gate_up.shape[0], 24 + 16), -777.0)
    segmented_expand_silu(xa, b, info, gate_up, x_aug[:, :24])
    assert torch.equal(x_aug[:, :24], expected)
    assert torch.equal(x_aug[:, 24:], torch.full_like(x_aug[:, 24:], -777.0))


# Decode steps that defer (row-wise off) with down_proj folded (the activation into its x_aug at
# prefill, its A-fold at decode); row-wise decode (no deferral there) with down_proj unfolded.
@pytest.mark.parametrize("rowwise,down_folded", [("0", True), ("small", False)])
def test_engine_leaves_gate_up_expand_to_the_activation(rowwise, down_folded, tmp_path, monkeypatch):
    """SGLANG_LORA_EXPAND_SILU=1 (csgmv, gate_up_proj unfolded): the prefill and the decode steps
    (row-wise ones excepted: their activation takes down_proj's shrink) run the one kernel in
    place of the expand and the SiLU-and-mul; with down_proj folded its output goes straight into
    down_proj's x_aug at prefill. Prompt logprobs and greedy tokens equal the engine's without it,
    bit for bit, and match HF + PEFT."""
    from helpers import EngineDriver, hf_model, hf_prompt_logprobs, make_runner, tiny_checkpoint
    from lora_testlib import write_peft_adapter
    from peft import PeftModel

    import sglang.srt.lora.backend.chunked_backend as chunked
    from sglang.srt.layers.triton_ops.dispatch import fused_kernels
    import sglang.srt.lora.mem_pool as mem_pool

    ckpt = tiny_checkpoint("qwen3", hidden_size=64, intermediate_size=128)
    paths = {n: write_peft_adapter(str(tmp_path / n), r=r, base_model=hf_model(ckpt), seed=s)
             for n, r, s in (("a", 8, 7), ("b", 16, 8))}
    # gate_up_proj unfolded (out_dim 2 x 128) as many slots make it; the others as --lora-fold says.
    fold_rule = mem_pool.should_fold
    monkeypatch.setattr(mem_pool, "should_fold", lambda out_dim, extra, elem: out_dim != 256 and fold_rule(out_dim, extra, elem))
    calls = []
    fused = chunked.segmented_expand_silu
    monkeypatch.setattr(chunked, "segmented_expand_silu", lambda *a, **kw: calls.append(1) or fused(*a, **kw))
    monkeypatch.setenv("SGLANG_LORA_ROWWISE_DECODE", rowwise)
    prompts = [[5, 9, 13, 200, 7, 3, 99], [11, 4, 250], [8, 8, 31, 2]]
    layers = 2  # tiny_checkpoint's

    def run(expand_silu: str):
        monkeypatch.setenv("SGLANG_LORA_EXPAND_SILU", expand_silu)  # read when the backend is built
        runner = make_runner(ckpt, lora_paths=[f"{n}={p}" for n, p in paths.items()], lora_backend="csgmv",
                             lora_fold="auto" if down_folded else "off", max_lora_rank=16)
        backend = runner.lora_manager.lora_backend
        assert {s.name: s.folded for s in backend.specs.values()}["gate_up_proj"] is False
        assert {s.name: s.folded for s in backend.specs.values()}["down_proj"] is down_folded
        ids = {ref.lora_name: i for i, ref in runner.lora_manager.refs.items()}
        driver = EngineDriver(runner)
        seqs = [driver.add(p, lora_id=i) for p, i in zip(prompts, [ids["a"], None, ids["b"]])]
        calls.clear()
        out = driver.extend(seqs, logprob_start=0)
        at_prefill = len(calls)
        calls.clear()
        tokens = driver.continue_greedy(seqs, out, 3)
        return out.input_token_logprobs, tokens, at_prefill, len(calls)

    # Every layer on its Triton kernel, as on a GPU: the plain path's SiLU-and-mul is then the
    # kernel whose code the fused one shares (torch's F.silu rounds otherwise).
    with fused_kernels("triton"):
        logprobs, tokens, at_prefill, at_decode = run("1")
        ref_logprobs, ref_tokens, none_prefill, none_decode = run("0")
    assert at_prefill == layers and at_decode == (3 * layers if rowwise == "0" else 0)
    assert none_prefill == none_decode == 0
    assert logprobs == ref_logprobs and tokens == ref_tokens
    if rowwise == "0":
        # tokens:T: prefills whose bucket holds at least T tokens (the batch's 14 here), no decode.
        with fused_kernels("triton"):
            small_logprobs, small_tokens, small_prefill, small_decode = run("tokens:1")
            _, _, big_prefill, big_decode = run("tokens:4096")
        assert (small_prefill, small_decode, big_prefill, big_decode) == (layers, 0, 0, 0)
        assert small_logprobs == ref_logprobs and small_tokens == ref_tokens
    for got, prompt, name in zip(logprobs, prompts, ["a", None, "b"]):
        model = hf_model(ckpt) if name is None else PeftModel.from_pretrained(hf_model(ckpt), paths[name]).eval()
        torch.testing.assert_close(torch.tensor(got), hf_prompt_logprobs(model, prompt), rtol=0, atol=1e-4)


def test_rows_past_the_batch_are_not_touched():
    """A graph's static segments list rows past its bucket (the inactive run covers the largest
    bucket's rows): the kernel reads and writes only the batch's rows (the tensors end there; views
    of larger buffers here, whose rows past the batch must keep their sentinels)."""
    rows = 45  # _case's batch
    info, gate_up_big, xa_big, b = _case(24, RANKS, torch.float32, seed=5, graph_rows=rows + 40)
    gate_up_big = torch.cat([gate_up_big[:rows], torch.full((40, 48), float("nan"))])
    expected = _unfused(info_exact := _info([1, -1, 2, 1, 3, 0, 2], [5, 3, 20, 1, 0, 4, 9], rows, RANKS),
                        gate_up_big[:rows], xa_big[:rows], b)
    out_big = torch.full((rows + 40, 24), -777.0)
    segmented_expand_silu(xa_big[:rows], b, info, gate_up_big[:rows], out_big[:rows])
    assert info.seg_indptr[-1] > rows and info_exact.seg_indptr[-1] == rows
    assert torch.equal(out_big[:rows], expected)
    assert torch.equal(out_big[rows:], torch.full((40, 24), -777.0))


def test_expand_silu_setting_is_checked():
    from sglang.srt.lora.backend.chunked_backend import expand_silu_bound

    assert expand_silu_bound("0") is None and expand_silu_bound("1") == 0
    assert expand_silu_bound("tokens:2048") == 2048
    for bad in ("yes", "tokens:", "tokens:0", "rows:4", "2", "tokens:-3"):
        with pytest.raises(ValueError, match="SGLANG_LORA_EXPAND_SILU"):
            expand_silu_bound(bad)
