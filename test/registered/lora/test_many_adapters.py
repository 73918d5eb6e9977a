"""Many adapters at once, through the real Scheduler in this process (CPU, float32, torch_native).

Twelve adapters of two ranks, on a tiny Llama:
  * with 12 slots, one prefill batch holds all twelve (more than the old default of 8) and every
    request's tokens and logprobs equal the same request served alone;
  * with 4 slots and skewed demand (a steady stream for the most popular adapter, one request for
    each of the others), adapters swap in and out during running batches, yet no adapter starves
    (every request finishes within a bound of turns) and every request's tokens and logprobs
    equal its output alone;
  * with --max-loras-per-batch unset, the pool has a slot per startup adapter (at least 8),
    within its memory budget.
"""

from __future__ import annotations

from typing import Optional

import pytest

from lora_server_testlib import tiny_lora_checkpoint, write_adapters
from test_scheduler import Harness, prompt

NUM_ADAPTERS = 12
NEW_TOKENS = 6
WAIT_TURNS = 4
SPECS = {f"a{i}": dict(r=4 if i % 2 else 8, seed=300 + i) for i in range(NUM_ADAPTERS)}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    return write_adapters(tiny_lora_checkpoint("llama"), str(tmp_path_factory.mktemp("many-adapters")), SPECS)


def harness(adapters: dict[str, str], slots: Optional[int], overlap: bool = False) -> tuple[Harness, dict[str, str]]:
    h = Harness(tiny_lora_checkpoint("llama"), dtype="float32", lora_backend="torch_native",
                max_loras_per_batch=slots, lora_max_wait_turns=WAIT_TURNS, max_total_tokens=4096,
                max_running_requests=32, lora_paths=[f"{n}={p}" for n, p in adapters.items()],
                enable_overlap_schedule=overlap)
    ids = {ref.lora_name: lora_id for lora_id, ref in h.sched.model_runner.lora_manager.refs.items()}
    return h, ids


def submit(h: Harness, ids: dict[str, str], rid: str, lora: Optional[str], seed: int) -> None:
    h.submit(rid, prompt(9 + seed % 5, seed), max_new_tokens=NEW_TOKENS, return_logprob=True,
             lora_id=None if lora is None else ids[lora], ignore_eos=True)


def alone(adapters: dict[str, str], jobs: list[tuple[str, Optional[str], int]]) -> dict[str, dict]:
    """Each job served by itself, one after the other, on a server with room for every adapter."""
    h, ids = harness(adapters, NUM_ADAPTERS)
    for rid, lora, seed in jobs:
        submit(h, ids, rid, lora, seed)
        h.run()
    return h.out


def assert_same(got: dict, want: dict, rid: str) -> None:
    assert got["ids"] == want["ids"] and len(got["ids"]) == NEW_TOKENS, rid
    assert len(got["out_lp"]) == len(want["out_lp"]) == NEW_TOKENS, rid
    for (a, ta), (b, tb) in zip(got["out_lp"], want["out_lp"]):
        assert ta == tb and abs(a - b) < 1e-4, (rid, a, b)
    for (a, _), (b, _) in zip(got["in_lp"], want["in_lp"]):
        assert abs(a - b) < 1e-4, (rid, a, b)


def test_twelve_adapters_in_one_batch_equal_each_alone(adapters) -> None:
    jobs = [(f"r{i}", f"a{i}", i) for i in range(NUM_ADAPTERS)] + [("base", None, 99)]
    ref = alone(adapters, jobs)
    h, ids = harness(adapters, NUM_ADAPTERS)
    for job in jobs:
        submit(h, ids, *job)
    h.sched.process_messages(block=False)
    mode, reqs = h.sched.get_next_batch()
    assert mode.is_extend() and len({r.lora_id for r in reqs} - {None}) == NUM_ADAPTERS
    h.sched.run_batch(mode, reqs)
    h.run()
    for rid, _, _ in jobs:
        assert_same(h.out[rid], ref[rid], rid)
    assert h.sched.check_integrity()["ok"]


@pytest.mark.parametrize("overlap", [False, True], ids=["ordinary", "overlap"])
def test_slot_pressure_starves_no_adapter_and_swaps_change_no_output(adapters, overlap) -> None:
    """With the overlap schedule too: requests waiting for a slot do not stop the steps from
    chaining, and the wait-turn rule keeps its bound (its turns are counted in every step)."""
    stream = [(f"hot{t}", "a0", 100 + t) for t in range(60)]  # one more request for a0 every turn
    rest = [(f"cold{i}", f"a{i}", i) for i in range(1, NUM_ADAPTERS)] + [("base", None, 99)]
    ref = alone(adapters, stream + rest)

    h, ids = harness(adapters, 4, overlap)
    for job in rest:
        submit(h, ids, *job)
    finished_at: dict[str, int] = {}
    turn = 0
    while turn < 2000 and (turn < len(stream) or h.sched.waiting or h.sched.running or h.sched.chunked_req):
        if turn < len(stream):
            submit(h, ids, *stream[turn])
        h.step()
        for rid, rec in h.out.items():
            if rec["finish"] is not None and rid not in finished_at:
                finished_at[rid] = turn
        turn += 1
    assert set(finished_at) == {rid for rid, _, _ in stream + rest}, "requests left unfinished"
    pool = h.sched.model_runner.lora_manager.pool
    assert pool.num_evictions >= NUM_ADAPTERS - 4  # 12 adapters went through 4 slots
    # Nobody starves: the 11 cold adapters go through the 3 slots a0 leaves in groups, each group
    # within a wait bound plus its requests' decode, all while a0's stream still arrives (a
    # starved adapter would wait for the stream to end).
    groups = -(-(NUM_ADAPTERS - 1) // 3)
    bound = groups * (WAIT_TURNS + NEW_TOKENS + 2)
    assert bound < len(stream)
    assert max(finished_at[rid] for rid, _, _ in rest) < bound, finished_at
    for rid, _, _ in stream + rest:
        assert_same(h.out[rid], ref[rid], rid)
    assert h.sched.check_integrity()["ok"]
    stats = h.sched.stats
    # Most steps chain although requests wait for slots all along (the rule before measured 4 of
    # 25 here, this one 20).
    assert (stats["overlapped_decode_steps"] >= stats["decode_steps"] // 2) == overlap, stats


def test_an_unset_slot_count_makes_room_for_every_startup_adapter(adapters) -> None:
    from sglang.srt.lora.pool_sizing import DEFAULT_SLOTS

    h, _ = harness(adapters, None)
    assert h.sched.model_runner.lora_manager.max_loras_per_batch == NUM_ADAPTERS
    assert h.sched.model_runner.lora_manager.pool.num_adapter_slots == NUM_ADAPTERS
    few = {n: adapters[n] for n in ("a0", "a1", "a2")}
    h, _ = harness(few, None)
    assert h.sched.model_runner.lora_manager.max_loras_per_batch == DEFAULT_SLOTS


def test_the_slot_budget_follows_device_memory(monkeypatch) -> None:
    """The sizing rule alone: per-slot bytes from the pool's layout, the budget a share of the
    device's memory (what torch reports there is stubbed: this machine has no GPU)."""
    import torch

    from sglang.srt.lora import pool_sizing
    from sglang.srt.lora.fold import A_FOLD_MAX_EXTRA_BYTES
    from sglang.srt.lora.lora import LoRAModelShapes, LoRAModuleShape

    shapes = LoRAModelShapes(num_layers=2, modules={
        "qkv_proj": LoRAModuleShape(in_dim=64, out_sizes=(64, 32, 32)),
        "down_proj": LoRAModuleShape(in_dim=128, out_sizes=(64,)),
    })
    per_slot = pool_sizing.slot_bytes(shapes, ["qkv_proj", "down_proj"], 8, torch.bfloat16)
    assert per_slot == 2 * 2 * ((3 * 8 * 64 + 128 * 8) + (8 * 128 + 64 * 8))
    # The A-fold keeps down_proj's B transposed too while S*R*(K-N) fits its bound: 8*64*2 bytes a
    # slot at 30 slots here; never at a count past the bound.
    assert pool_sizing.slot_bytes(shapes, ["qkv_proj", "down_proj"], 8, torch.bfloat16, a_fold_slots=30) == (
        per_slot + 2 * 2 * 64 * 8)
    past_bound = A_FOLD_MAX_EXTRA_BYTES // (8 * 64 * 2) + 1
    assert pool_sizing.slot_bytes(shapes, ["qkv_proj", "down_proj"], 8, torch.bfloat16,
                                  a_fold_slots=past_bound) == per_slot
    cpu = torch.device("cpu")
    count = pool_sizing.auto_slot_count
    assert count(shapes, ["qkv_proj"], 8, torch.bfloat16, cpu, 3) == pool_sizing.DEFAULT_SLOTS
    assert count(shapes, ["qkv_proj"], 8, torch.bfloat16, cpu, 40) == 40
    assert count(shapes, ["qkv_proj"], 8, torch.bfloat16, cpu, 40, max_loaded_loras=20) == 20
    # All startup adapters pinned: one more slot, the one pinning must leave free.
    assert count(shapes, ["qkv_proj"], 8, torch.bfloat16, cpu, 8, num_startup_pinned=8) == 9
    assert count(shapes, ["qkv_proj"], 8, torch.bfloat16, cpu, 40, num_startup_pinned=3) == 40
    assert count(shapes, ["qkv_proj"], 8, torch.bfloat16, cpu, 1000) == pool_sizing.AUTO_MAX_SLOTS
    assert count(shapes, ["qkv_proj"], 8, torch.bfloat16, cpu, 40, agree=lambda n: n - 1) == 39  # TP: the min
    total = 30 * per_slot / pool_sizing.AUTO_POOL_MEMORY_FRACTION  # room for 30 slots
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (total / 2, total))
    gpu = torch.device("cuda", 0)
    shapes_all = ["qkv_proj", "down_proj"]
    assert count(shapes, shapes_all, 8, torch.bfloat16, gpu, 12) == 12
    # Room for 30 slots of A and B: 26 with the A-fold's copy of down_proj's B (per slot 16,384 ->
    # 18,432 bytes: 491,520 // 18,432 = 26).
    assert count(shapes, shapes_all, 8, torch.bfloat16, gpu, 64) == 26
