"""LoRAMemoryPool: eviction policies, protection of current/pinned adapters, the base model's own slot,
zeroing, prefetch, fixed addresses."""

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


def make_adapter(lora_id: str, r: int = 4, modules=MODULES, seed: int = 0) -> LoRAAdapter:
    """A real LoRAAdapter whose fused weights are filled directly (no files needed)."""
    cfg = LoRAConfig(
        path=f"<{lora_id}>", r=r, lora_alpha=2 * r, target_modules=[p for m in modules for p in PROJ[m]]
    )
    ad = LoRAAdapter(lora_id, cfg, SHAPES)
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
    return {u for u in pool.slot_to_lora_id if u is not EMPTY}


@pytest.mark.parametrize("policy,victim", [("lru", "b"), ("fifo", "a")])
def test_eviction_policy_picks_victim(adapters, policy, victim):
    pool = make_pool(slots=3, policy=policy)
    for lora_id in "abcac":  # a: loaded first but used recently; b: used least recently
        pool.make_resident({lora_id}, adapters)
    pool.make_resident({"d"}, adapters)
    assert victim not in resident(pool) and "d" in resident(pool)
    assert resident(pool) == {None, "a", "b", "c", "d"} - {victim}
    assert pool.integrity_problems() == []


def test_pinned_adapter_never_evicted(adapters):
    pool = make_pool(slots=3)
    pool.make_resident({"a", "b", "c"}, adapters, pinned_ids={"a"})
    for lora_id in "defde":  # a is least recently used throughout
        pool.make_resident({lora_id}, adapters, pinned_ids={"a"})
        assert "a" in resident(pool)
    with pytest.raises(ValueError, match="No LoRA pool slot can be freed"):
        pool.make_resident({"b", "c"}, adapters, pinned_ids={"a", "d", "e"})


def test_current_batch_never_evicted(adapters):
    pool = make_pool(slots=2)
    pool.make_resident({None, "a", "b"}, adapters)  # the base model needs no adapter slot
    assert resident(pool) == {None, "a", "b"}
    pool.make_resident({"c"}, adapters)  # evicts the LRU of {a, b}
    pool.make_resident({None, "a", "c"}, adapters)
    assert resident(pool) == {None, "a", "c"}
    pool.make_resident({"b", "c"}, adapters)  # a is the only candidate
    assert resident(pool) == {None, "b", "c"}
    with pytest.raises(ValueError, match="distinct adapters"):
        pool.make_resident({None, "a", "b", "c"}, adapters)
    with pytest.raises(ValueError, match="not loaded"):
        pool.make_resident({"zzz"}, adapters)


def test_slot_contents_compact_prefix_and_no_residue(adapters):
    pool = make_pool(slots=1, rank=8)
    big = make_adapter("big", r=8, seed=10)
    small = make_adapter("small", r=4, modules=["qkv_proj"], seed=11)
    ads = {"big": big, "small": small}
    pool.make_resident({"big"}, ads)
    slot = pool.get_slot("big")
    pool.make_resident({"small", None}, ads)  # evicts big; small reuses its slot
    assert pool.get_slot("small") == slot
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
    # The base model's slot: its own, rank 0, all zero.
    none_slot = pool.get_slot(None)
    assert none_slot == pool.base_slot == 1 and pool.slot_ranks[none_slot] == 0
    for m in MODULES:
        for layer in range(SHAPES.num_layers):
            assert torch.count_nonzero(pool.A_buffer[m][layer][none_slot]) == 0
            assert torch.count_nonzero(pool.B_buffer[m][layer][none_slot]) == 0
    # Back to a rank-8 adapter on every module: all of it is written again.
    pool.make_resident({"big"}, ads)
    for layer in range(SHAPES.num_layers):
        for m in MODULES:
            a, b = big.layers[layer][m]
            torch.testing.assert_close(pool.A_buffer[m][layer][slot], a, rtol=0, atol=0)
            torch.testing.assert_close(pool.B_buffer[m][layer][slot], b, rtol=0, atol=0)


def test_buffers_never_reallocated(adapters):
    pool = make_pool(slots=3)
    ptrs = pool.data_ptrs()
    tensors = [t for m in MODULES for t in pool.A_buffer[m] + pool.B_buffer[m]]
    before = [t.data_ptr() for t in tensors]
    for batch in ({"a", None}, {"b", "c"}, {"d", "e", None}, {"f"}, {"a", "b"}):
        pool.make_resident(batch, adapters)
    pool.free("a")
    pool.make_resident({"c", "d"}, adapters)
    assert pool.data_ptrs() == ptrs
    after = [t for m in MODULES for t in pool.A_buffer[m] + pool.B_buffer[m]]
    assert all(x is y for x, y in zip(tensors, after)) and [t.data_ptr() for t in after] == before
    assert pool.integrity_problems() == []


def test_free_and_integrity(adapters):
    pool = make_pool(slots=3)
    pool.make_resident({"a", "b", None}, adapters)
    slot = pool.get_slot("a")
    pool.free("a")
    assert pool.slot_to_lora_id[slot] is EMPTY and pool.slot_ranks[slot] == 0 and not pool.is_resident("a")
    pool.make_resident({"c"}, adapters)  # takes the free slot, evicts nothing
    assert pool.get_slot("c") == slot and resident(pool) == {"b", None, "c"}
    assert pool.integrity_problems() == []
    pool.slot_ranks[pool.get_slot(None)] = 4  # corrupt on purpose
    pool.lora_id_to_slot["b"] = pool.get_slot("c")
    problems = pool.integrity_problems()
    assert any("base-model slot" in p for p in problems) and any("'b'" in p for p in problems)


def test_base_model_has_its_own_slot(adapters):
    pool = make_pool(slots=2)
    assert pool.num_adapter_slots == 2 and pool.num_slots == 3 and pool.is_resident(None)
    for m in MODULES:  # the buffers hold the base model's slot too
        assert pool.A_buffer[m][0].shape[0] == 3
    pool.make_resident({None, "a", "b"}, adapters)
    pool.free(None)  # never freed
    assert pool.get_slot(None) == pool.base_slot and pool.slot_to_lora_id[: 2] != [None, None]
    pool.make_resident({"c", "d"}, adapters)
    assert resident(pool) == {None, "c", "d"} and pool.integrity_problems() == []


def test_prefetch_fills_free_slots_and_replaces_only_unwanted(adapters):
    pool = make_pool(slots=2)
    pool.make_resident({"a"}, adapters)
    # a runs (protected); c is the most wanted, then d. One free slot: c gets it; d finds none
    # (c is wanted, a is protected).
    assert pool.prefetch(["c", "d"], adapters, protected={"a", None}) == ["c"]
    assert resident(pool) == {None, "a", "c"} and pool.num_prefetches == 1
    slot = pool.get_slot("c")
    a_c, b_c = adapters["c"].layers[0]["qkv_proj"]
    torch.testing.assert_close(pool.A_buffer["qkv_proj"][0][slot][: a_c.shape[0]], a_c, rtol=0, atol=0)
    # Now d is wanted and c is not: c gives way. a stays, protected.
    assert pool.prefetch(["d"], adapters, protected={"a"}) == ["d"]
    assert resident(pool) == {None, "a", "d"} and pool.num_evictions == 1
    # Pinned adapters never give way, nor do wanted ones.
    assert pool.prefetch(["e", "d"], adapters, protected=set(), pinned_ids={"a"}) == []
    assert pool.prefetch(["e"], adapters, protected=set(), pinned_ids={"a"}) == ["e"]
    assert resident(pool) == {None, "a", "e"} and pool.integrity_problems() == []
    assert pool.loader.pending_slots() == []  # CPU: copies are done at once
