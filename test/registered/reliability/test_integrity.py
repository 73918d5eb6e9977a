"""The integrity checks catch corrupted state (managers/integrity.py).

In process, on the real objects: a Scheduler with a real ModelRunner and LoRA pool (tiny llama,
torch_native LoRA, real pipes), and a TokenizerManager with a real LoRARegistry. Each corruption is
done by hand the way a bug would do it (a KV slot allocated and dropped, a slot freed twice, a
cached slot freed, a cached prefix left locked, a row leaked, a finished request still holding KV, a request tracked but neither queued nor running, the
LoRA pool's slot maps disagreeing, the base model's slot with a rank), must be reported with its
kind, logged at ERROR once while it persists, and the check must be clean again once undone.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
from typing import Any, Callable

import pytest

from lora_server_testlib import PROMPTS, tiny_lora_checkpoint, write_adapter
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.managers.req import Req
from sglang.srt.managers.req_state import ReqState
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.scheduler_client import SchedulerClient
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.server_configs import build_run_configs


@pytest.fixture(scope="module")
def args(tmp_path_factory) -> ServerArgs:
    ckpt = tiny_lora_checkpoint("llama")
    root = tmp_path_factory.mktemp("integrity")
    paths = [f"{name}={write_adapter(ckpt, str(root / name), r=4, seed=60 + i)}" for i, name in enumerate("ab")]
    return ServerArgs(model_path=ckpt, device="cpu", dtype="float32", lora_backend="torch_native",
                      lora_paths=paths, max_loras_per_batch=3, max_total_tokens=512)


@pytest.fixture(scope="module")
def sched(args) -> Scheduler:
    to_r, to_w = mp.Pipe(duplex=False)
    from_r, from_w = mp.Pipe(duplex=False)
    s = Scheduler(build_run_configs(args).scheduler, to_r, from_w)
    s._test_pipes = (to_w, from_r)  # keep both ends alive
    return s


def submit(sched: Scheduler, rid: str, lora_id: Any, n: int = 6) -> None:
    sp = SamplingParams.from_dict({"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True})
    sched.add_request(TokenizedGenerateReqInput(rid=rid, input_ids=PROMPTS[0], sampling_params=sp,
                                                lora_id=lora_id))


def turn(sched: Scheduler) -> None:
    batch = sched.get_next_batch()
    if batch is not None:
        sched.run_batch(*batch)


def run_all(sched: Scheduler) -> None:
    for _ in range(500):
        if not (sched.waiting or sched.running or sched.chunked_req):
            return
        turn(sched)
    raise AssertionError("the scheduler did not finish")


def kinds(result: dict) -> set[str]:
    return {p.split("]")[0].lstrip("[") for p in result["problems"]}


def integrity_errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR and "integrity" in r.getMessage()]


def test_scheduler_check_detects_each_corruption(sched, caplog) -> None:
    lora = sched.model_runner.lora_manager
    ids = sorted(lora.refs)
    for i, lora_id in enumerate([ids[0], None, ids[1]]):  # every slot in use: two adapters and the base model
        submit(sched, f"warm{i}", lora_id)
    run_all(sched)
    clean = sched.check_integrity()
    assert clean["ok"] and clean["idle"] and clean["problems"] == [] and clean["lora_ok"], clean
    assert clean["kv_free"] + clean["kv_cached"] == clean["kv_total"] == 512 and clean["kv_cached"] > 0
    assert clean["rows_used"] == 0 and clean["num_requests"] == 0
    runs = clean["runs"]
    pool, alloc, rows = lora.pool, sched.allocator, sched.req_to_token_pool
    base_slot = pool.lora_id_to_slot[None]
    other_slot = pool.lora_id_to_slot[ids[0]]
    ghost = Req(TokenizedGenerateReqInput(rid="ghost", input_ids=[1, 2], sampling_params=SamplingParams()), 99)
    state: dict[str, Any] = {}

    def leak_kv() -> None:
        state["kv"] = alloc.alloc(5)

    def double_free() -> None:
        alloc.free(alloc.free_slots[:1].clone())

    def swap_map() -> None:
        pool.lora_id_to_slot[ids[1]], state["slot"] = other_slot, pool.lora_id_to_slot[ids[1]]

    def set_base_rank() -> None:
        pool.slot_ranks[base_slot] = 4

    tree = sched.prefix_cache.tree
    cached_node = next(iter(next(iter(tree.roots.values())).children.values()))

    def free_a_cached_slot() -> None:
        alloc.free(cached_node.value[:1].clone())

    corruptions: list[tuple[str, Callable[[], None], Callable[[], None], str]] = [
        ("kv_accounting", leak_kv, lambda: alloc.free(state["kv"]), "5 unaccounted"),
        ("kv_free_list", double_free, lambda: setattr(alloc, "free_slots", alloc.free_slots[:-1]), "duplicate"),
        ("row_accounting", lambda: state.update(row=rows.alloc(1)), lambda: rows.free(state["row"][0]), "request rows"),
        ("orphaned_requests", lambda: sched.rid_to_req.update(ghost=ghost), lambda: sched.rid_to_req.pop("ghost"),
         "'ghost'"),
        ("lora_pool", swap_map, lambda: pool.lora_id_to_slot.update({ids[1]: state["slot"]}), "maps to slot"),
        ("lora_pool", set_base_rank, lambda: pool.slot_ranks.__setitem__(base_slot, 0), "base-model slot"),
        ("kv_free_list", free_a_cached_slot, lambda: setattr(alloc, "free_slots", alloc.free_slots[:-1]),
         "free and cached"),
        ("prefix_cache", lambda: tree.inc_lock_ref(cached_node), lambda: tree.dec_lock_ref(cached_node),
         "still locked"),
    ]
    for kind, corrupt, undo, needle in corruptions:
        caplog.clear()
        with caplog.at_level(logging.ERROR):
            corrupt()
            first, second = sched.check_integrity(), sched.check_integrity()
            undo()
            fixed = sched.check_integrity()
        assert not first["ok"] and kind in kinds(first), (kind, first)
        assert any(needle in p for p in first["problems"]), (needle, first["problems"])
        assert second["problems"] == first["problems"]
        logged = integrity_errors(caplog)
        # Loudly, but once per distinct problem while it persists (not once per check).
        assert len(logged) == len(first["problems"]) and all("integrity check failed" in m for m in logged), logged
        assert fixed["ok"], (kind, fixed)
    assert sched.check_integrity()["runs"] == runs + 3 * len(corruptions) + 1


def test_a_finished_request_holding_kv_is_found(sched) -> None:
    submit(sched, "held", None, n=20)
    for _ in range(4):
        turn(sched)
    req = sched.rid_to_req["held"]
    assert req in sched.running and req.req_pool_idx is not None
    req.finished_reason = {"type": "stop", "matched": 0}  # finished, but never released: the bug
    result = sched.check_integrity()
    assert not result["ok"] and "finished_holds_kv" in kinds(result) and result["kv_used"] > 0, result
    req.finished_reason = None
    run_all(sched)
    assert sched.check_integrity()["ok"]


def test_tokenizer_manager_check_detects_leaks(args, caplog) -> None:
    configs = build_run_configs(args)
    client = SchedulerClient(configs.scheduler, configs.tp)  # never started: the check only reads the manager's own state
    tm = TokenizerManager(configs.tokenizer_manager, client, {"context_len": 2048, "max_total_num_tokens": 512, "vocab_size": 512})
    clean = tm.check_integrity()
    assert clean["ok"] and clean["idle"] and clean["lora_in_flight_refs"] == 0 and clean["request_states"] == 0

    async def scenario() -> list[dict]:
        results = []
        ids = await tm.lora_registry.acquire(["a", None, "a"])  # taken, then never released: the bug
        with caplog.at_level(logging.ERROR):
            results.append(tm.check_integrity())
            results.append(tm.check_integrity())
        assert len(integrity_errors(caplog)) == 1  # once, not once per check
        await tm.lora_registry.release(ids)
        results.append(tm.check_integrity())
        tm.rid_to_state["lost"] = ReqState(req=None, input_ids=[1], params=SamplingParams(), lora_id=None,
                                           detok=None, event=asyncio.Event())
        results.append(tm.check_integrity())
        tm.num_active_requests = 1  # while a request is in progress, its state is expected
        results.append(tm.check_integrity())
        tm.num_active_requests = 0
        del tm.rid_to_state["lost"]
        results.append(tm.check_integrity())
        return results

    leaked, again, released, orphan, busy, fixed = asyncio.run(scenario())
    assert not leaked["ok"] and kinds(leaked) == {"registry_refs"} and leaked["lora_in_flight_refs"] == 2, leaked
    assert "'a': 2" in leaked["problems"][0] and again["problems"] == leaked["problems"]
    assert released["ok"]
    assert not orphan["ok"] and kinds(orphan) == {"orphaned_states"} and "'lost'" in orphan["problems"][0]
    assert busy["now"]["active_requests"] == 1 and busy["runs"] == orphan["runs"]  # the last idle result stands
    assert fixed["ok"]
    client.shutdown()


def test_server_info_reports_both_checks_and_graph_stats(sched) -> None:
    info = sched.live_info()
    check = info["last_integrity_check"]
    assert check["ok"] and check["time"] > 0 and check["runs"] >= 1 and check["kv_total"] == 512
    assert set(info["graph_stats"]) == {"prefill_graph_replays", "decode_graph_replays", "eager_prefills",
                                        "eager_decodes", "base_prefill_graph_replays",
                                        "base_decode_graph_replays", "num_graphs", "capture_seconds",
                                        "forward_paths", "lora_metadata_refreshes", "lora_metadata_writes"}
    assert info["graph_stats"]["eager_prefills"] > 0  # CPU: every forward is eager
    paths = {(mode, path, reason): n for mode, path, reason, n in info["graph_stats"]["forward_paths"]}
    assert paths[("prefill", "eager", "graphs_disabled")] == info["graph_stats"]["eager_prefills"]
    assert info["graph_stats"]["prefill_graph_replays"] == info["graph_stats"]["decode_graph_replays"] == 0
    assert info["lora"]["num_adapter_loads"] >= 2
