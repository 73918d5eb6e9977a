"""What each rank runs in test_tp_layers.py (module-level functions: spawned ranks import them).

Every check builds the unsharded layer (size-1 group) and the sharded one (the rank's real group)
from the same full tensors, runs both in float32, and returns the largest difference, or data the
test compares across ranks.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed import SINGLE_RANK, TensorParallelGroup
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from sglang.srt.model_executor.model_loading import init_dummy_weights
from sglang.srt.model_loader.weight_utils import (
    CheckpointTensor,
    default_weight_loader,
    safetensors_weights_iterator,
)

HIDDEN, HEAD, HEADS, INTER, VOCAB, TOKENS = 16, 4, 4, 24, 11, 5  # VOCAB 11: padded at tp 2


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().numpy().tobytes()).hexdigest()


def _act(x: torch.Tensor) -> torch.Tensor:  # SiluAndMul, written out: the oracle stays independent
    n = x.shape[-1] // 2
    return F.silu(x[..., :n]) * x[..., n:]


def collectives(group: TensorParallelGroup) -> dict[str, Any]:
    r = group.rank
    x = torch.full((2, 3), float(r + 1))
    reduced = group.all_reduce(x)
    base = torch.arange(6.0).view(2, 3) + 10 * r
    return {
        "all_reduce": reduced.tolist(), "in_place": reduced is x,
        "gather_last": group.all_gather(base, dim=-1).tolist(),
        "gather_first": group.all_gather(base, dim=0).tolist(),
        "broadcast": group.broadcast(torch.full((4,), float(r)), src=1).tolist(),
        "broadcast_object": group.broadcast_object({"from": r, "msgs": [1, "a"]} if r == 0 else None),
        "all_gather_object": group.all_gather_object(("rank", r)),
        "min": group.min_over_ranks(100 - r),
    }


class FullWeights:
    """The same random full tensors on every rank."""

    def __init__(self, kv_heads: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)

        def rnd(*shape: int) -> torch.Tensor:  # scaled by fan-in: outputs of order 1, like a real model
            return torch.randn(*shape, generator=g) * shape[-1] ** -0.5

        self.kv_heads = kv_heads
        self.x = rnd(TOKENS, HIDDEN) * HIDDEN**0.5
        self.q, self.k, self.v = rnd(HEADS * HEAD, HIDDEN), rnd(kv_heads * HEAD, HIDDEN), rnd(kv_heads * HEAD, HIDDEN)
        self.qkv_bias = rnd((HEADS + 2 * kv_heads) * HEAD)
        self.o, self.o_bias = rnd(HIDDEN, HEADS * HEAD), rnd(HIDDEN)
        self.gate, self.up, self.down = rnd(INTER, HIDDEN), rnd(INTER, HIDDEN), rnd(HIDDEN, INTER)
        self.embed = rnd(VOCAB, HIDDEN)
        self.lora_a, self.lora_b = rnd(3, HEADS * HEAD), rnd(HIDDEN, 3)


def _qkv(w: FullWeights, group: TensorParallelGroup, fused: bool) -> QKVParallelLinear:
    layer = QKVParallelLinear(HIDDEN, HEAD, HEADS, w.kv_heads, bias=True, tp_group=group)
    if fused:  # the whole [q; k; v] tensor at once (shard_id None), as the dummy initialiser gives it
        layer.weight.weight_loader(layer.weight, torch.cat([w.q, w.k, w.v]))
    else:
        for sid, t in (("q", w.q), ("k", w.k), ("v", w.v)):
            layer.weight.weight_loader(layer.weight, t, sid)
    layer.bias.weight_loader(layer.bias, w.qkv_bias)
    return layer


def _row(weight: torch.Tensor, bias: torch.Tensor | None, group: TensorParallelGroup) -> RowParallelLinear:
    layer = RowParallelLinear(weight.shape[1], weight.shape[0], bias=bias is not None, tp_group=group)
    layer.weight.weight_loader(layer.weight, weight)
    if bias is not None:
        layer.bias.weight_loader(layer.bias, bias)
    return layer


def _gate_up(w: FullWeights, group: TensorParallelGroup, fused: bool) -> MergedColumnParallelLinear:
    layer = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], tp_group=group)
    if fused:
        layer.weight.weight_loader(layer.weight, torch.cat([w.gate, w.up]))
    else:
        layer.weight.weight_loader(layer.weight, w.gate, 0)
        layer.weight.weight_loader(layer.weight, w.up, 1)
    return layer


@torch.no_grad()
def sharded_layers(group: TensorParallelGroup, kv_heads: int) -> dict[str, Any]:
    """Each sharded layer against the unsharded one; chains that cross the column/row boundary."""
    w = FullWeights(kv_heads)
    r, tp, x = group.rank, group.size, w.x
    out: dict[str, Any] = {}

    ref_qkv, sh_qkv = _qkv(w, SINGLE_RANK, fused=False), _qkv(w, group, fused=False)
    out["qkv_fused_load_equal"] = torch.equal(_qkv(w, group, fused=True).weight, sh_qkv.weight)
    q_full, k_full, v_full = ref_qkv(x).split([HEADS * HEAD, kv_heads * HEAD, kv_heads * HEAD], dim=-1)
    q_loc, k_loc, v_loc = sh_qkv(x).split(sh_qkv.output_sizes, dim=-1)
    nq, nkv = HEADS // tp, max(1, kv_heads // tp)
    kv_head = r // max(1, tp // kv_heads)  # the KV head (group) this rank keeps
    out["qkv"] = max(
        _max_diff(q_loc, q_full[:, r * nq * HEAD:(r + 1) * nq * HEAD]),
        _max_diff(k_loc, k_full[:, kv_head * nkv * HEAD:(kv_head + 1) * nkv * HEAD]),
        _max_diff(v_loc, v_full[:, kv_head * nkv * HEAD:(kv_head + 1) * nkv * HEAD]),
    )
    out["qkv_sizes"] = (sh_qkv.num_heads, sh_qkv.num_kv_heads, sh_qkv.num_kv_head_replicas)
    # The partition seams LoRA shards with: B (stacked like the full output) by output_partition,
    # A of a row-parallel layer by input_partition.
    fused = torch.cat([w.q, w.k, w.v])
    out["qkv_partition"] = torch.equal(
        torch.cat([fused.narrow(0, s, n) for s, n in sh_qkv.output_partition()]), sh_qkv.weight)

    # o_proj after attention: each rank holds its heads' slice of the input.
    ref_o, sh_o = _row(w.o, w.o_bias, SINGLE_RANK), _row(w.o, w.o_bias, group)
    out["o_proj"] = _max_diff(sh_o(q_loc), ref_o(q_full))
    # The LoRA seam: a partial delta (A sharded by input, B whole) added before the all-reduce.
    a_loc = w.lora_a[:, r * nq * HEAD:(r + 1) * nq * HEAD]
    partial = sh_o.forward_partial(q_loc)
    partial += (q_loc @ a_loc.T) @ w.lora_b.T
    out["row_lora_seam"] = _max_diff(sh_o.reduce(partial), ref_o(q_full) + (q_full @ w.lora_a.T) @ w.lora_b.T)
    unreduced = RowParallelLinear(HEADS * HEAD, HIDDEN, tp_group=group, reduce_results=False)
    unreduced.weight.weight_loader(unreduced.weight, w.o)
    out["row_partial_sum"] = _max_diff(group.all_reduce(unreduced(q_loc)), q_full @ w.o.T)

    # The MLP: column (gate_up) -> activation -> row (down) with its all-reduce.
    ref_gu, sh_gu = _gate_up(w, SINGLE_RANK, fused=False), _gate_up(w, group, fused=False)
    out["gate_up_fused_load_equal"] = torch.equal(_gate_up(w, group, fused=True).weight, sh_gu.weight)
    stacked = torch.cat([w.gate, w.up])
    out["gate_up_partition"] = torch.equal(
        torch.cat([stacked.narrow(0, s, n) for s, n in sh_gu.output_partition()]), sh_gu.weight)
    out["down_partition"] = torch.equal(w.down.narrow(1, *_row(w.down, None, group).input_partition()),
                                        _row(w.down, None, group).weight)
    ref_down, sh_down = _row(w.down, None, SINGLE_RANK), _row(w.down, None, group)
    out["mlp"] = _max_diff(sh_down(_act(sh_gu(x))), ref_down(_act(ref_gu(x))))

    col = ColumnParallelLinear(HIDDEN, INTER, tp_group=group)
    col.weight.weight_loader(col.weight, w.gate)
    out["column"] = _max_diff(col(x), (x @ w.gate.T)[:, r * INTER // tp:(r + 1) * INTER // tp])

    # Vocab-parallel embedding and LM head, vocabulary padded up to a multiple of tp.
    ids = torch.tensor([0, 5, 6, VOCAB - 1, 3, VOCAB - 1])
    emb = VocabParallelEmbedding(VOCAB, HIDDEN, tp_group=group)
    emb.weight.weight_loader(emb.weight, w.embed)
    out["embedding"] = _max_diff(emb(ids), F.embedding(ids, w.embed))
    head = ParallelLMHead(VOCAB, HIDDEN, tp_group=group)
    head.weight.weight_loader(head.weight, w.embed)
    logits = LogitsProcessor(VOCAB).compute_logits(x, head)
    out["lm_head"] = _max_diff(logits, x @ w.embed.T)
    out["lm_head_digest"] = _digest(logits)  # the same bytes on every rank
    out["vocab_padded"] = (emb.num_embeddings_padded, emb.num_embeddings_per_partition,
                           bool((emb.weight[emb.vocab_end_index - emb.vocab_start_index:] == 0).all()))
    return out


class TinyBlock(nn.Module):
    """Every sharded layer type in one module, chained so that the output depends on every weight."""

    def __init__(self, group: TensorParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(VOCAB, HIDDEN, tp_group=group)
        self.qkv_proj = QKVParallelLinear(HIDDEN, HEAD, HEADS, 2, bias=True, tp_group=group)
        self.o_proj = RowParallelLinear(HEADS * HEAD, HIDDEN, bias=True, tp_group=group)
        self.norm = RMSNorm(HIDDEN, eps=1e-6)
        self.gate_up_proj = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], tp_group=group)
        self.down_proj = RowParallelLinear(INTER, HIDDEN, tp_group=group)
        self.lm_head = ParallelLMHead(VOCAB, HIDDEN, tp_group=group)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(ids)
        q, k, v = self.qkv_proj(h).split(self.qkv_proj.output_sizes, dim=-1)
        h = self.norm(h + self.o_proj(q))
        h = h + self.down_proj(_act(self.gate_up_proj(h)))
        return self.lm_head.compute_logits(h)


@torch.no_grad()
def dummy_weights(group: TensorParallelGroup, seed: int) -> dict[str, Any]:
    """A model with dummy weights at tp N computes what the tp-1 dummy model computes."""
    sharded = TinyBlock(group)
    full = TinyBlock()  # a single-rank model
    assert full.qkv_proj.tp_size == 1 and sharded.qkv_proj.tp_size == group.size
    init_dummy_weights(sharded, seed=seed, std=0.5)
    init_dummy_weights(full, seed=seed, std=0.5)
    ids = torch.tensor([1, 4, 7, 10, 2])
    other = TinyBlock()
    init_dummy_weights(other, seed=seed + 1, std=0.5)
    return {"diff": _max_diff(sharded(ids), full(ids)), "seed_matters": _max_diff(other(ids), full(ids))}


def write_checkpoint(path: str, kv_heads: int) -> None:
    from safetensors.torch import save_file

    w = FullWeights(kv_heads, seed=3)
    save_file({"q": w.q, "k": w.k, "v": w.v, "o": w.o, "gate": w.gate, "up": w.up, "down": w.down,
               "embed": w.embed, "norm": torch.ones(HIDDEN)}, path)


@torch.no_grad()
def lazy_loading(group: TensorParallelGroup, path: str, kv_heads: int) -> dict[str, Any]:
    """Loading through lazy CheckpointTensors reads only this rank's slices and loads what the
    full tensors load."""
    read: list[int] = []
    materialize = CheckpointTensor.materialize

    def counting(self: CheckpointTensor) -> torch.Tensor:
        t = materialize(self)
        read.append(t.numel())
        return t

    CheckpointTensor.materialize = counting  # this process only
    w = FullWeights(kv_heads, seed=3)
    qkv = QKVParallelLinear(HIDDEN, HEAD, HEADS, kv_heads, tp_group=group)
    o = RowParallelLinear(HEADS * HEAD, HIDDEN, tp_group=group)
    gate_up = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], tp_group=group)
    down = RowParallelLinear(INTER, HIDDEN, tp_group=group)
    emb = VocabParallelEmbedding(VOCAB, HIDDEN, tp_group=group)
    norm = torch.empty(HIDDEN)
    targets = {"q": (qkv.weight, "q"), "k": (qkv.weight, "k"), "v": (qkv.weight, "v"), "o": (o.weight, None),
               "gate": (gate_up.weight, 0), "up": (gate_up.weight, 1), "down": (down.weight, None),
               "embed": (emb.weight, None)}
    for name, tensor in safetensors_weights_iterator([path], progress=False):
        assert isinstance(tensor, CheckpointTensor)
        if name == "norm":
            default_weight_loader(norm, tensor)
            continue
        param, shard = targets[name]
        param.weight_loader(param, tensor, shard)
    ref_qkv = _qkv(w, group, fused=False)
    expected = {
        "qkv": torch.equal(qkv.weight, ref_qkv.weight),
        "o": torch.equal(o.weight, _row(w.o, None, group).weight),
        "gate_up": torch.equal(gate_up.weight, _gate_up(w, group, fused=False).weight),
        "down": torch.equal(down.weight, _row(w.down, None, group).weight),
        "norm": torch.equal(norm, torch.ones(HIDDEN)),
    }
    shard_numel = sum(p.numel() for p in (qkv.weight, o.weight, gate_up.weight, down.weight)) + \
        (emb.vocab_end_index - emb.vocab_start_index) * HIDDEN + HIDDEN
    full_numel = sum(t.numel() for t in (w.q, w.k, w.v, w.o, w.gate, w.up, w.down, w.embed)) + HIDDEN
    return {"equal": expected, "read": sum(read), "shard_numel": shard_numel, "full_numel": full_numel}


def all_checks(group: TensorParallelGroup, checkpoints: dict[int, str]) -> dict[str, Any]:
    """Everything in one spawn of the ranks (process start-up dominates a check's cost)."""
    return {
        "collectives": collectives(group),
        "layers_kv2": sharded_layers(group, kv_heads=2),
        "layers_kv1": sharded_layers(group, kv_heads=1),  # fewer KV heads than ranks: replicated
        "dummy": dummy_weights(group, seed=11),
        **{f"lazy_kv{kv}": lazy_loading(group, path, kv) for kv, path in checkpoints.items()},
    }
