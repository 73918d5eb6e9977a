"""The prefix cache inside the scheduler (managers/prefix_cache.py), turn by turn on a tiny Qwen3
checkpoint (real ModelRunner, real pipes; float32 on the CPU).

Outputs with a cache hit equal the outputs without the cache (greedy tokens exactly, logprobs to
float32 noise), a prompt-logprob request matches at most up to its first wanted position, requests
arriving together with the same prefix compute it once, and the KV accounting (free + cached +
owned by requests == total, checked by the integrity report after every turn) holds through
eviction under pressure, chunked prefill, an abort in mid-prefill, retraction, a failed forward
and the unload of an adapter with cached entries. Each case runs with the request slots read from
the KV table and from its host twin (memory_pool.ReqToTokenPool), as on a GPU.
"""

from __future__ import annotations


import pytest

from server_helpers import tiny_checkpoint
from test_scheduler import Harness, prompt
from sglang.srt.managers.io_struct import AbortReq, FaultInjectionReq, LoadLoRAAdapterReq, UnloadLoRAAdapterReq

TOL = 1e-5  # float32: the same numbers up to summation order


@pytest.fixture(scope="module")
def ckpt() -> str:
    return tiny_checkpoint("qwen3", seed=0)


@pytest.fixture(autouse=True, params=["table", "twin"])
def slot_reads(request, monkeypatch):
    """Every case twice: the scheduler reading KV slots from the CPU table itself, and from a
    separate host twin, as on a GPU (the integrity check after every turn compares the twin with
    the table for every request holding KV, and the outputs must not change)."""
    from sglang.srt.mem_cache import memory_pool

    monkeypatch.setattr(memory_pool, "SEPARATE_HOST_TWIN", request.param == "twin")
    return request.param


def step_checked(h: Harness) -> bool:
    ran = h.step()
    report = h.sched.check_integrity()
    assert report["ok"], report["problems"]
    return ran


def run_checked(h: Harness, max_steps: int = 2000) -> None:
    for _ in range(max_steps):
        if not step_checked(h) and not h.sched.waiting:
            return
    raise AssertionError("the scheduler did not finish in time")


def assert_same(a: dict, b: dict) -> None:
    assert a["ids"] == b["ids"]
    for key in ("in_lp", "out_lp"):
        x, y = a[key] or [], b[key] or []
        assert [t for _, t in x] == [t for _, t in y], key
        diffs = [abs(p - q) for (p, _), (q, _) in zip(x, y) if p is not None]
        assert max(diffs, default=0.0) <= TOL, (key, max(diffs))


def idle_accounting(h: Harness) -> dict:
    report = h.sched.check_integrity()
    assert report["ok"] and report["idle"], report
    assert report["kv_used"] == 0 and report["kv_protected"] == 0, report
    assert report["kv_free"] + report["kv_evictable"] == report["kv_total"], report
    return report


SYSTEM = prompt(40, 1)


def test_a_hit_gives_the_outputs_of_no_cache(ckpt):
    q1, q2 = prompt(9, 2), prompt(7, 3)
    cases = [  # (rid, prompt, logprob_start_len, expected cached tokens)
        ("first", SYSTEM + q1, -1, 0),
        ("shared", SYSTEM + q2, -1, 40),  # the system prompt; the question diverges
        ("again", SYSTEM + q2, -1, 46),  # all but the last prompt token
        ("lp-from-20", SYSTEM + q2, 20, 19),  # the logprob of token 20 is read at position 19
        ("lp-from-0", SYSTEM + q2, 0, 0),
    ]
    on, off = Harness(ckpt), Harness(ckpt, disable_radix_cache=True)
    for h in (on, off):
        for rid, ids, start, _ in cases:
            h.submit(rid, ids, max_new_tokens=6, return_logprob=True, logprob_start_len=start)
            run_checked(h)
    for rid, ids, start, cached in cases:
        assert on.out[rid]["cached"] == cached, rid
        assert off.out[rid]["cached"] == 0
        assert_same(on.out[rid], off.out[rid])
        if start >= 0:
            assert [t for _, t in on.out[rid]["in_lp"]] == ids[start:]
    info = on.sched.live_info()["prefix_cache"]
    assert info["cached_tokens"] == 40 + 46 + 19 and info["hits"] == 3 and info["lookups"] == 5
    assert off.sched.live_info()["prefix_cache"] == {"enabled": False}
    idle_accounting(on)


def test_requests_arriving_together_compute_a_shared_prefix_once(ckpt, caplog):
    caplog.set_level("INFO", logger="sglang.srt.managers.scheduler")
    h, ref = Harness(ckpt), Harness(ckpt, disable_radix_cache=True)
    prompts = {f"g{i}": SYSTEM + prompt(5, 10 + i) for i in range(4)}
    for hh in (h, ref):
        for rid, ids in prompts.items():
            hh.submit(rid, ids, max_new_tokens=4)
    run_checked(h)
    lines = [r.getMessage() for r in caplog.records if "Prefill batch" in r.getMessage()]
    ref.run()
    computed = sum(int(ln.split("#new-token: ")[1].split(",")[0]) for ln in lines)
    # The first request computes the system prompt; the others wait one turn and reuse it.
    assert computed == 45 + 3 * 5, lines
    assert sorted(h.out[r]["cached"] for r in prompts) == [0, 40, 40, 40]
    assert any("#cached-token: 120" in ln for ln in lines), lines
    for rid in prompts:
        assert h.out[rid]["ids"] == ref.out[rid]["ids"], rid


def test_eviction_under_pressure_keeps_the_accounting(ckpt):
    h = Harness(ckpt, max_total_tokens=160)
    for i in range(12):  # ~60 tokens each, 720 in all: the cache must keep evicting
        h.submit(f"e{i}", prompt(50, 20 + i), max_new_tokens=10)
        if i % 3 == 2:
            run_checked(h)
    run_checked(h)
    info = h.sched.live_info()["prefix_cache"]
    assert info["evicted_tokens"] > 0 and info["size"] > 0
    assert h.sched.stats["num_retractions"] == 0  # eviction came first; nobody had to be retracted
    assert all(len(h.out[f"e{i}"]["ids"]) == 10 for i in range(12))
    idle_accounting(h)


def test_chunked_prefill_caches_each_chunk(ckpt):
    ids = prompt(45, 4)
    h, ref = Harness(ckpt, chunked_prefill_size=16), Harness(ckpt, disable_radix_cache=True)
    h.submit("c", ids, max_new_tokens=5, return_logprob=True, logprob_start_len=3)
    step_checked(h)
    tree = h.sched.prefix_cache.tree
    assert (tree.total_size, tree.protected_size) == (16, 16)  # the first chunk, locked by its request
    step_checked(h)
    assert (tree.total_size, tree.protected_size) == (32, 32)
    run_checked(h)
    h.submit("again", ids, max_new_tokens=5)
    run_checked(h)
    assert h.out["again"]["cached"] == 44
    for rid, kw in (("c", dict(return_logprob=True, logprob_start_len=3)), ("again", {})):
        ref.submit(rid, ids, max_new_tokens=5, **kw)
        ref.run()
        assert_same(h.out[rid], ref.out[rid])
    idle_accounting(h)


def test_abort_in_mid_prefill_releases_the_lock(ckpt):
    h = Harness(ckpt, chunked_prefill_size=16)
    total = h.kv_free()
    h.submit("long", prompt(60, 5), max_new_tokens=5)
    step_checked(h)
    step_checked(h)
    assert h.sched.chunked_req is not None and h.sched.prefix_cache.tree.protected_size == 32
    h.to_w.send(AbortReq(rid="long"))
    step_checked(h)
    assert h.finish_of("long")["type"] == "abort"
    report = idle_accounting(h)
    assert report["kv_cached"] == 32 and h.kv_free() == total  # its chunks stay cached, unlocked


def test_failed_forward_caches_nothing_it_computed(ckpt):
    h = Harness(ckpt, enable_test_hooks=True)
    ids = prompt(30, 6)
    h.to_w.send(FaultInjectionReq(rid_substring="boom"))
    h.submit("boom", ids, max_new_tokens=5)
    run_checked(h)
    assert h.finish_of("boom")["status_code"] == 500
    assert h.sched.prefix_cache.tree.total_size == 0  # its KV slots may never have been written
    h.submit("after", ids, max_new_tokens=5)
    run_checked(h)
    assert h.out["after"]["cached"] == 0 and len(h.out["after"]["ids"]) == 5
    idle_accounting(h)


def test_retraction_with_shared_prefixes(ckpt):
    prompts = {f"r{i}": SYSTEM[:12] + prompt(8 + i, 30 + i) for i in range(6)}
    ref = Harness(ckpt, disable_radix_cache=True)
    for rid, ids in prompts.items():
        ref.submit(rid, ids, max_new_tokens=14)
        ref.run()
    h = Harness(ckpt, max_total_tokens=80)  # far less than the ~180 tokens all six need at once
    for rid, ids in prompts.items():
        h.submit(rid, ids, max_new_tokens=14)
    run_checked(h)
    assert h.sched.stats["num_retractions"] > 0
    for rid in prompts:
        assert h.out[rid]["ids"] == ref.out[rid]["ids"], rid
    idle_accounting(h)


def test_flush_is_refused_while_requests_run(ckpt):
    h = Harness(ckpt)
    h.submit("a", prompt(20, 7), max_new_tokens=6)
    step_checked(h)
    refused = h.sched.flush_cache()
    assert not refused.success and "running or waiting" in refused.message
    run_checked(h)
    assert h.sched.prefix_cache.tree.total_size > 0
    done = h.sched.flush_cache()
    assert done.success and h.sched.prefix_cache.tree.total_size == 0
    assert h.kv_free() == h.sched.allocator.available_size() == h.sched.max_total_num_tokens
    off = Harness(ckpt, disable_radix_cache=True)
    assert off.sched.flush_cache().success


def test_unloaded_adapter_entries_are_dropped(ckpt, tmp_path):
    from lora_server_testlib import tiny_lora_checkpoint, write_adapter
    from sglang.srt.lora.lora_registry import make_dynamic_lora_ref

    base = tiny_lora_checkpoint("llama")
    path = write_adapter(base, str(tmp_path / "a"), r=4, seed=5)
    h = Harness(base, dtype="float32", enable_lora=True, max_lora_rank=8, lora_target_modules=["all"],
                lora_backend="torch_native", max_loras_per_batch=3)
    ids = prompt(20, 8)

    def load(name: str) -> str:
        ref = make_dynamic_lora_ref(name, path)
        assert h.sched.update_lora(LoadLoRAAdapterReq(ref)).success
        return ref

    first = load("a")
    for rid, lora in (("base", None), ("lora", first.lora_id), ("lora-hit", first.lora_id)):
        h.submit(rid, ids, max_new_tokens=4, lora_id=lora)
        run_checked(h)
    assert h.out["lora-hit"]["cached"] == 19 and len(h.sched.prefix_cache.tree.roots) == 2
    assert h.sched.update_lora(UnloadLoRAAdapterReq(first)).success
    assert len(h.sched.prefix_cache.tree.roots) == 1  # the base model's entries only
    second = load("a")  # the same name and files again: a new id, so nothing stale matches
    h.submit("reloaded", ids, max_new_tokens=4, lora_id=second.lora_id)
    run_checked(h)
    assert h.out["reloaded"]["cached"] == 0
    assert h.out["reloaded"]["ids"] == h.out["lora"]["ids"]
    idle_accounting(h)
