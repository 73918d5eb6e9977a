"""LoRAMemoryPool: eviction policies, protection of current/pinned adapters, zeroing, fixed addresses."""

import pytest
import torch
from lora_testlib import tiny_hf_config

from sglang.srt.lora.lora import LoRAAdapter, LoRAModelShapes
from sglang.srt.lora.lora_config import LoRAConfig, get_stacked_multiply
from sglang.srt.lora.mem_pool import EMPTY, LoRAMemoryPool

SHAPES = LoRAModelShapes.from_hf_config(tiny_hf_config())
MODULES = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
PROJ = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "o_proj": ["o_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
    "down_proj": ["down_proj"],
}


def make_adapter(uid: str, r: int = 4, modules=MODULES, seed: int = 0) -> LoRAAdapter:
    """A real LoRAAdapter whose fused weights are filled directly (no files needed)."""
    cfg = LoRAConfig(
        path=f"<{uid}>", r=r, lora_alpha=2 * r, target_modules=[p for m in modules for p in PROJ[m]]
    )
    ad = LoRAAdapter(uid, cfg, SHAPES)
    gen = torch.Generator().manual_seed(seed)
    for layer in range(SHAPES.num_layers):
        for m in modules:
            shape = SHAPES.modules[m]
            c = get_stacked_multiply(m)
            ad.layers[layer][m] = (
                torch.randn(c * r, shape.in_dim, generator=gen) + 1.0,  # never zero
                torch.randn(shape.out_dim, r, generator=gen) + 1.0,
            )
    return ad


def make_pool(slots=3, rank=8, policy="lru") -> LoRAMemoryPool:
    return LoRAMemoryPool(SHAPES, MODULES, slots, rank, torch.float32, "cpu", policy)


@pytest.fixture
def adapters():
    return {u: make_adapter(u, seed=i) for i, u in enumerate("abcdef")}


def resident(pool):
    return {u for u in pool.slot_to_uid if u is not EMPTY}


@pytest.mark.parametrize("policy,victim", [("lru", "b"), ("fifo", "a")])
def test_eviction_policy_picks_victim(adapters, policy, victim):
    pool = make_pool(slots=3, policy=policy)
    for uid in "abcac":  # a: loaded first but used recently; b: used least recently
        pool.prepare_lora_batch({uid}, adapters)
    pool.prepare_lora_batch({"d"}, adapters)
    assert victim not in resident(pool) and "d" in resident(pool)
    assert resident(pool) == {"a", "b", "c", "d"} - {victim}
    assert pool.integrity_problems() == []


def test_pinned_adapter_never_evicted(adapters):
    pool = make_pool(slots=3)
    pool.prepare_lora_batch({"a", "b", "c"}, adapters, pinned_uids={"a"})
    for uid in "defde":  # a is least recently used throughout
        pool.prepare_lora_batch({uid}, adapters, pinned_uids={"a"})
        assert "a" in resident(pool)
    with pytest.raises(ValueError, match="No LoRA pool slot can be freed"):
        pool.prepare_lora_batch({"b", "c"}, adapters, pinned_uids={"a", "d", "e"})


def test_current_batch_never_evicted(adapters):
    pool = make_pool(slots=3)
    pool.prepare_lora_batch({None, "a", "b"}, adapters)
    pool.prepare_lora_batch({"c"}, adapters)  # evicts the LRU of {None, a, b}
    pool.prepare_lora_batch({None, "a", "c"}, adapters)
    assert resident(pool) == {None, "a", "c"}
    pool.prepare_lora_batch({"a", "b", "c"}, adapters)  # None is the only candidate
    assert resident(pool) == {"a", "b", "c"}
    with pytest.raises(ValueError, match="distinct adapters"):
        pool.prepare_lora_batch({None, "a", "b", "c"}, adapters)
    with pytest.raises(ValueError, match="not loaded"):
        pool.prepare_lora_batch({"zzz"}, adapters)


def test_slot_contents_compact_prefix_and_no_residue(adapters):
    pool = make_pool(slots=2, rank=8)
    big = make_adapter("big", r=8, seed=10)
    small = make_adapter("small", r=4, modules=["qkv_proj"], seed=11)
    ads = {"big": big, "small": small}
    pool.prepare_lora_batch({"big"}, ads)
    slot = pool.get_slot("big")
    pool.prepare_lora_batch({"small", None}, ads)  # evicts big; small may reuse its slot
    slot = pool.get_slot("small")
    assert pool.slot_ranks[slot] == 4 and pool.slot_scalings[slot] == pytest.approx(2.0)
    for layer in range(SHAPES.num_layers):
        a, b = small.layers[layer]["qkv_proj"]
        A, B = pool.A_buffer["qkv_proj"][layer][slot], pool.B_buffer["qkv_proj"][layer][slot]
        torch.testing.assert_close(A[:12], a, rtol=0, atol=0)  # slices at rows [0,4), [4,8), [8,12)
        torch.testing.assert_close(B[:, :4], b, rtol=0, atol=0)
        assert torch.count_nonzero(A[12:]) == 0 and torch.count_nonzero(B[:, 4:]) == 0
        for m in ("o_proj", "gate_up_proj", "down_proj"):  # modules small lacks: zero, not big's
            assert torch.count_nonzero(pool.A_buffer[m][layer][slot]) == 0
            assert torch.count_nonzero(pool.B_buffer[m][layer][slot]) == 0
    # The base model's slot: rank 0, zero A, even where an adapter lived before.
    none_slot = pool.get_slot(None)
    assert pool.slot_ranks[none_slot] == 0
    for m in MODULES:
        for layer in range(SHAPES.num_layers):
            assert torch.count_nonzero(pool.A_buffer[m][layer][none_slot]) == 0


def test_buffers_never_reallocated(adapters):
    pool = make_pool(slots=3)
    ptrs = pool.data_ptrs()
    tensors = [t for m in MODULES for t in pool.A_buffer[m] + pool.B_buffer[m]]
    before = [t.data_ptr() for t in tensors]
    for batch in ({"a", None}, {"b", "c"}, {"d", "e", None}, {"f"}, {"a", "b"}):
        pool.prepare_lora_batch(batch, adapters)
    pool.free("a")
    pool.prepare_lora_batch({"c", "d"}, adapters)
    assert pool.data_ptrs() == ptrs
    after = [t for m in MODULES for t in pool.A_buffer[m] + pool.B_buffer[m]]
    assert all(x is y for x, y in zip(tensors, after)) and [t.data_ptr() for t in after] == before
    assert pool.integrity_problems() == []


def test_free_and_integrity(adapters):
    pool = make_pool(slots=3)
    pool.prepare_lora_batch({"a", "b", None}, adapters)
    slot = pool.get_slot("a")
    pool.free("a")
    assert pool.slot_to_uid[slot] is EMPTY and pool.slot_ranks[slot] == 0 and not pool.is_resident("a")
    pool.prepare_lora_batch({"c"}, adapters)  # takes the free slot, evicts nothing
    assert pool.get_slot("c") == slot and resident(pool) == {"b", None, "c"}
    assert pool.integrity_problems() == []
    pool.slot_ranks[pool.get_slot(None)] = 4  # corrupt on purpose
    pool.uid_to_slot["b"] = pool.get_slot("c")
    problems = pool.integrity_problems()
    assert any("base-model slot" in p for p in problems) and any("'b'" in p for p in problems)
