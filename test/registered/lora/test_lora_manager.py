"""LoRAManager on a real ModelRunner: start-up inference, load/unload validation, batch admission,
the graph-path contract (flags passed through, the prefill-graph predicate) and the wrappers."""

import pytest
import torch
from helpers import EngineDriver, hf_model, make_runner, tiny_checkpoint
from lora_testlib import write_peft_adapter

from sglang.srt.lora.layers import (
    MergedColumnParallelLinearWithLoRA,
    QKVParallelLinearWithLoRA,
    RowParallelLinearWithLoRA,
)
from sglang.srt.lora.lora_registry import make_dynamic_lora_ref
from sglang.srt.model_executor.batch_builder import (
    DecodeRequest,
    ExtendRequest,
    build_decode_batch,
    build_extend_batch,
)
from sglang.srt.configs.forward_path import ForwardPath, ForwardPlan


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-manager")
    ckpt = tiny_checkpoint("llama", hidden_size=64, intermediate_size=128)
    base = hf_model(ckpt)
    paths = {
        "a": write_peft_adapter(
            str(root / "a"), r=4, target_modules=["q_proj", "v_proj"], base_model=hf_model(ckpt)
        ),
        "b": write_peft_adapter(
            str(root / "b"), r=8, target_modules=["q_proj", "v_proj", "o_proj"], base_model=hf_model(ckpt)
        ),
        "mlp": write_peft_adapter(
            str(root / "mlp"), r=4, target_modules=["down_proj"], base_model=hf_model(ckpt)
        ),
        "r32": write_peft_adapter(
            str(root / "r32"), r=32, target_modules=["q_proj"], base_model=hf_model(ckpt)
        ),
        "dora": write_peft_adapter(
            str(root / "dora"), r=4, target_modules=["q_proj"], use_dora=True, base_model=hf_model(ckpt)
        ),
        "c": write_peft_adapter(str(root / "c"), r=4, target_modules=["q_proj"], seed=3, base_model=base),
    }
    return ckpt, paths


def runner_for(setup, names=("a", "b"), **kw):
    ckpt, paths = setup
    kw.setdefault("max_running_requests", 128)  # the batch-building tests do not free their rows
    return make_runner(ckpt, lora_paths=[f"{n}={paths[n]}" for n in names], **kw)


def ref(setup, name, new_name=None, pinned=False):
    return make_dynamic_lora_ref(new_name or name, setup[1][name], pinned)


# ---------------------------------------------------------------------- start-up
def test_startup_adapters_are_read_while_the_graphs_are_set_up(setup, monkeypatch):
    """SGLANG_LORA_STARTUP_OVERLAP=1: the startup reads run in threads while the model runner sizes
    the KV cache and sets up the graphs, unpinned (no cudaHostAlloc beside a capture), and are
    pinned and committed after: each read waits until the graph set-up has begun, which a read
    inside LoRAManager's constructor could never see."""
    import threading

    from sglang.srt.lora.lora import LoRAAdapter
    from sglang.srt.model_executor.model_runner import ModelRunner

    graphs_begun, reads, pins = threading.Event(), [], []
    init_cuda_graphs, load, pin = ModelRunner.init_cuda_graphs, LoRAAdapter.load, LoRAAdapter.pin_host_copy

    def graphs(self):
        assert self.lora_manager.loaded_adapters() == {}  # nothing committed before the graphs
        graphs_begun.set()
        return init_cuda_graphs(self)

    def read(cls, *args, **kwargs):
        assert graphs_begun.wait(120), "the adapter was read before the graph set-up began"
        reads.append((threading.current_thread().name, kwargs.get("pin"), torch.get_num_threads()))
        return load(*args, **kwargs)

    monkeypatch.setenv("SGLANG_LORA_STARTUP_OVERLAP", "1")
    monkeypatch.setattr(ModelRunner, "init_cuda_graphs", graphs)
    monkeypatch.setattr(LoRAAdapter, "load", classmethod(read))
    monkeypatch.setattr(LoRAAdapter, "pin_host_copy", lambda self: pins.append(self.lora_id) or pin(self))
    main_threads = torch.get_num_threads()
    runner = runner_for(setup)
    names = {ref.lora_name for ref in runner.lora_manager.refs.values()}
    assert names == {"a", "b"} and sorted(runner.lora_manager.loaded_adapters()) == ["a", "b"]
    assert len(reads) == 2 and all(t.startswith("sglang-lora-read") and p is False for t, p, _ in reads)
    # A reader's tensor ops stay on one core (they run beside the capture); the main thread's
    # intra-op threads are untouched.
    assert [n for _, _, n in reads] == [1, 1] and torch.get_num_threads() == main_threads
    assert sorted(pins) == sorted(runner.lora_manager.refs)


def test_startup_reads_begin_after_the_work_the_runner_waits_for(setup, monkeypatch):
    """ModelRunner(wait_for=...) (the scheduler passes its tokenizer load): the startup adapter
    reads begin only once that work has ended, in either start-up order."""
    import threading
    import time
    from concurrent.futures import Future

    from sglang.srt.lora.lora import LoRAAdapter

    ckpt, paths = setup[0], {n: setup[1][n] for n in ("a", "b")}
    load, read_began = LoRAAdapter.load, []

    def read(cls, *args, **kwargs):
        read_began.append(time.perf_counter())
        return load(*args, **kwargs)

    monkeypatch.setattr(LoRAAdapter, "load", classmethod(read))
    for overlap in ("0", "1"):
        monkeypatch.setenv("SGLANG_LORA_STARTUP_OVERLAP", overlap)
        read_began.clear()
        work, ended = Future(), []

        def finish():
            time.sleep(0.5)
            ended.append(time.perf_counter())
            work.set_result(None)

        threading.Thread(target=finish).start()
        runner = make_runner(ckpt, wait_for=work, lora_paths=[f"{n}={p}" for n, p in paths.items()])
        assert sorted(runner.lora_manager.loaded_adapters()) == sorted(paths)
        assert len(read_began) == len(paths) and min(read_began) >= ended[0], (overlap, read_began, ended)


def test_startup_threads_env_sets_the_reader_count(setup, monkeypatch):
    """SGLANG_LORA_STARTUP_THREADS=1: both startup adapters are read by the one reader thread; a
    value that is not a positive integer is refused by name."""
    import threading

    from sglang.srt.lora import lora_manager
    from sglang.srt.lora.lora import LoRAAdapter

    load, names = LoRAAdapter.load, []

    def read(cls, *args, **kwargs):
        names.append(threading.current_thread().name)
        return load(*args, **kwargs)

    monkeypatch.setattr(LoRAAdapter, "load", classmethod(read))
    monkeypatch.setenv("SGLANG_LORA_STARTUP_THREADS", "1")
    runner = runner_for(setup)
    assert sorted(runner.lora_manager.loaded_adapters()) == ["a", "b"]
    assert len(names) == 2 and len(set(names)) == 1, names
    for bad in ("0", "-2", "two"):
        monkeypatch.setenv("SGLANG_LORA_STARTUP_THREADS", bad)
        with pytest.raises(ValueError, match="SGLANG_LORA_STARTUP_THREADS"):
            lora_manager.startup_load_threads()
    monkeypatch.delenv("SGLANG_LORA_STARTUP_THREADS")
    assert lora_manager.startup_load_threads() == lora_manager.STARTUP_LOAD_THREADS


def test_startup_reads_come_before_the_kv_cache_by_default(setup, monkeypatch, caplog):
    """By default (SGLANG_LORA_STARTUP_OVERLAP unset, or 0) the adapters are committed before the KV
    cache is sized, read pinned where CUDA is (unpinned here, on the CPU), and the log says so; a
    value other than 0 or 1 is refused by name."""
    import logging

    from sglang.srt.lora import lora_manager
    from sglang.srt.lora.lora import LoRAAdapter
    from sglang.srt.model_executor.model_runner import ModelRunner

    committed_before_kv, pins = [], []
    init_memory_pool, load = ModelRunner.init_memory_pool, LoRAAdapter.load

    def memory_pool(self):
        committed_before_kv.append(sorted(self.lora_manager.loaded_adapters()))
        return init_memory_pool(self)

    def read(cls, *args, **kwargs):
        pins.append(kwargs["pin"])
        return load(*args, **kwargs)

    monkeypatch.setattr(ModelRunner, "init_memory_pool", memory_pool)
    monkeypatch.setattr(LoRAAdapter, "load", classmethod(read))
    for value in (None, "0"):
        if value is None:
            monkeypatch.delenv("SGLANG_LORA_STARTUP_OVERLAP", raising=False)
        else:
            monkeypatch.setenv("SGLANG_LORA_STARTUP_OVERLAP", value)
        committed_before_kv.clear(), pins.clear(), caplog.clear()
        with caplog.at_level(logging.INFO, logger="sglang.srt.lora"):
            runner = runner_for(setup)
        assert committed_before_kv == [["a", "b"]] and sorted(runner.lora_manager.loaded_adapters()) == ["a", "b"]
        assert not runner.lora_manager.startup_overlap
        said = [r.getMessage() for r in caplog.records if "startup adapter(s) read" in r.getMessage()]
        assert len(said) == 1 and "read before the KV cache and graphs" in said[0], said
        assert pins == [torch.cuda.is_available()] * 2
    monkeypatch.setenv("SGLANG_LORA_STARTUP_OVERLAP", "yes")
    with pytest.raises(ValueError, match="SGLANG_LORA_STARTUP_OVERLAP"):
        lora_manager.startup_overlap()


def test_startup_infers_rank_and_targets_and_wraps_modules(setup):
    runner = runner_for(setup, lora_backend="triton")
    mgr = runner.lora_manager
    assert mgr.loaded_adapters() == {"a": setup[1]["a"], "b": setup[1]["b"]}
    assert mgr.pool.max_lora_rank == 8 and mgr.pool.target_modules == ["o_proj", "qkv_proj"]
    layer = runner.model.model.layers[1]
    assert isinstance(layer.self_attn.qkv_proj, QKVParallelLinearWithLoRA)
    assert isinstance(layer.self_attn.o_proj, RowParallelLinearWithLoRA)
    assert not hasattr(layer.mlp.gate_up_proj, "lora_backend")  # not a pool target: left alone
    qkv = layer.self_attn.qkv_proj
    assert qkv.lora.spec.slice_sizes == (64, 32, 32) and qkv.lora.spec.max_rank == 8
    assert qkv.A_buffer.data_ptr() == mgr.pool.A_buffer["qkv_proj"][1].data_ptr()
    # Folded (the tiny model's W_aug is far under the byte bound): the base weight is a view of
    # W_aug, whose extra columns hold the pool's B.
    w_aug = mgr.pool.folded_weight["qkv_proj"][1]
    assert qkv.lora.folded is w_aug and w_aug.shape == (128, 64 + mgr.pool.fold_extra_columns("qkv_proj"))
    assert qkv.weight.data_ptr() == w_aug.data_ptr() and qkv.weight.shape == (128, 64)
    assert qkv.B_buffer is mgr.pool.B_buffer["qkv_proj"][1]

    runner = runner_for(setup, lora_backend="triton", max_lora_rank=32, lora_target_modules=["all"])
    mgr = runner.lora_manager
    assert mgr.pool.max_lora_rank == 32
    assert mgr.pool.target_modules == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    assert isinstance(runner.model.model.layers[0].mlp.gate_up_proj, MergedColumnParallelLinearWithLoRA)


def test_startup_failure_names_the_adapter(setup):
    with pytest.raises(ValueError, match="'dora'.*DoRA"):
        runner_for(setup, names=("a", "dora"))
    with pytest.raises(ValueError, match="'mlp'.*--lora-target-modules"):
        runner_for(setup, names=("a", "mlp"), lora_target_modules=["q_proj", "v_proj"])
    with pytest.raises(ValueError, match="'b'.*--max-lora-rank"):
        runner_for(setup, names=("a", "b"), max_lora_rank=4)


def test_startup_adapters_read_in_parallel_equal_one_by_one(setup, tmp_path):
    """Many startup adapters are read by threads, then committed in their order: each one's host
    tensors equal a load of that adapter alone, and the first bad adapter (in order) is named."""
    from sglang.srt.lora.lora import LoRAAdapter
    from sglang.srt.lora.lora_config import LoRAConfig

    ckpt, paths = setup[0], dict(setup[1])
    names = [f"n{i}" for i in range(12)]
    for i, name in enumerate(names):  # 12 adapters, three files each used four times
        paths[name] = paths[("a", "b", "c")[i % 3]]
    mgr = runner_for((ckpt, paths), names=names, lora_backend="torch_native", max_loras_per_batch=4).lora_manager
    assert list(mgr.loaded_adapters()) == names
    for lora_id, adapter in mgr.adapters.items():
        alone = LoRAAdapter.load(lora_id, LoRAConfig.from_path(mgr.refs[lora_id].lora_path), mgr.shapes)
        assert [sorted(layer) for layer in adapter.layers] == [sorted(layer) for layer in alone.layers]
        for layer, ref_layer in zip(adapter.layers, alone.layers):
            for module, (a, b) in layer.items():
                assert torch.equal(a, ref_layer[module][0]) and torch.equal(b, ref_layer[module][1])
    with pytest.raises(ValueError, match="'bad'.*DoRA"):
        paths["bad"], paths["worse"] = paths["dora"], paths["r32"]
        runner_for((ckpt, paths), names=("a", "bad", "b", "worse"), max_lora_rank=8)


def test_host_copies_are_one_buffer_per_dtype():
    """An adapter's host tensors share (pinned on CUDA) buffers per dtype, in order, unchanged."""
    from sglang.srt.lora.lora import pack_tensors

    tensors = [torch.randn(3, 4), torch.randn(2, 5, dtype=torch.float64), torch.randn(6, 1)[::2],
               torch.randn(7)]
    packed, buffers = pack_tensors(tensors, pin=False)
    assert all(torch.equal(p, t) and p.shape == t.shape and p.is_contiguous() for p, t in zip(packed, tensors))
    float32 = [p for p in packed if p.dtype == torch.float32]
    assert len({p.untyped_storage().data_ptr() for p in float32}) == 1
    assert float32[1].data_ptr() == float32[0].data_ptr() + 12 * 4  # back to back, in order
    assert sorted(b.numel() for b in buffers) == [10, 12 + 3 + 7]
    # With a dtype: one buffer, every tensor converted.
    packed, buffers = pack_tensors(tensors, pin=False, dtype=torch.bfloat16)
    assert len(buffers) == 1 and buffers[0].numel() == 32
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, t.to(torch.bfloat16)) for p, t in zip(packed, tensors))
    # With a buffer size (16 floats): a new buffer before one would pass it.
    packed, buffers = pack_tensors(tensors, pin=False, dtype=torch.float32, buffer_bytes=16 * 4)
    assert [b.numel() for b in buffers] == [12, 10 + 3, 7]
    assert all(torch.equal(p, t.float()) for p, t in zip(packed, tensors))


def test_row_blocks_pack_as_their_concatenation():
    """A fused module's A and B stay row blocks (views into the file's tensors) until the host
    copy: packed, a list of blocks is their torch.cat, converted; row_range cuts the blocks'
    concatenation by rows (the column-parallel shard of B) without a copy."""
    from sglang.srt.lora.lora import pack_tensors, row_range

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(n, 3, generator=gen) for n in (4, 2, 2))
    wide = torch.randn(5, 9, generator=gen)
    narrowed = [wide.narrow(1, 2, 3), wide.narrow(1, 2, 3)[1:]]  # a row-parallel A's columns: strided
    packed, buffers = pack_tensors([[q, k, v], torch.randn(2, 2), narrowed], pin=False, dtype=torch.bfloat16)
    assert len(buffers) == 1
    assert torch.equal(packed[0], torch.cat([q, k, v]).to(torch.bfloat16)) and packed[0].shape == (8, 3)
    assert torch.equal(packed[2], torch.cat(narrowed).to(torch.bfloat16)) and packed[2].is_contiguous()
    full = torch.cat([q, k, v])
    for start, length in [(0, 8), (1, 2), (3, 3), (4, 2), (6, 2), (5, 1)]:
        cut = row_range([q, k, v], start, length)
        assert torch.equal(torch.cat(cut), full[start : start + length])
        assert all(c.untyped_storage().data_ptr() in {t.untyped_storage().data_ptr() for t in (q, k, v)} for c in cut)


def test_adapters_sharing_files_warn_once_at_start_and_per_dynamic_load(setup, caplog):
    """Startup adapters that load the files of an earlier one get one warning line in all; a
    dynamic load of such files warns, naming the adapter it shares them with."""
    import logging

    ckpt, paths = setup
    with caplog.at_level(logging.WARNING, logger="sglang.srt.lora"):
        runner = make_runner(ckpt, lora_paths=[f"a={paths['a']}", f"a2={paths['a']}", f"a3={paths['a']}",
                                               f"b={paths['b']}"])
    shared = [r.getMessage() for r in caplog.records if "same files" in r.getMessage()]
    assert shared == ["LoRA: 2 adapter(s) load the same files as an earlier one (e.g. 'a2' as 'a')"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sglang.srt.lora"):
        out = runner.lora_manager.load_lora_adapter(make_dynamic_lora_ref("b2", paths["b"], False))
    assert out.success
    assert [r.getMessage() for r in caplog.records] == ["LoRA adapter 'b2' loads the same files as 'b'"]


# ---------------------------------------------------------------------- dynamic load / unload
def test_load_validation_leaves_no_trace(setup):
    mgr = runner_for(setup, lora_backend="torch_native").lora_manager
    before = mgr.loaded_adapters()
    cases = [
        (ref(setup, "c", new_name="a"), ["'a'", "already loaded"]),
        (ref(setup, "r32"), ["rank 32", "--max-lora-rank 32"]),
        (ref(setup, "mlp"), ["down_proj", "--lora-target-modules"]),
        (ref(setup, "dora"), ["DoRA"]),
        (make_dynamic_lora_ref("ghost", "/nonexistent/adapter"), ["'ghost'", "/nonexistent/adapter"]),
    ]
    for lora_ref, needles in cases:
        out = mgr.load_lora_adapter(lora_ref)
        assert not out.success, lora_ref
        for n in needles:
            assert n in out.error_message, out.error_message
        assert out.loaded_adapters == before and mgr.loaded_adapters() == before
        assert set(mgr.adapters) == set(mgr.refs) and len(mgr.adapters) == 2
        assert mgr.integrity_report().ok


def test_load_use_unload_reload(setup):
    runner = runner_for(setup, lora_backend="torch_native")
    mgr = runner.lora_manager
    driver = EngineDriver(runner)
    prompt = [5, 17, 42, 99, 7, 3]

    def logprobs(lora_id):
        s = driver.add(prompt, lora_id=lora_id)
        out = driver.extend([s], logprob_start=0)
        driver.release(s)
        return torch.tensor(out.input_token_logprobs[0])

    c = ref(setup, "c")
    out = mgr.load_lora_adapter(c)
    assert out.success and out.error_message == "" and out.loaded_adapters["c"] == setup[1]["c"]
    with_c = logprobs(c.lora_id)
    assert (with_c - logprobs(None)).abs().max() > 1e-2
    assert mgr.pool.is_resident(c.lora_id)

    out = mgr.unload_lora_adapter(c)
    assert out.success and "c" not in out.loaded_adapters
    assert not mgr.pool.is_resident(c.lora_id) and mgr.integrity_report().ok
    assert not mgr.unload_lora_adapter(c).success  # already gone
    with pytest.raises(ValueError, match="not loaded"):
        logprobs(c.lora_id)

    c2 = ref(setup, "c")  # same name, new id
    assert mgr.load_lora_adapter(c2).success
    torch.testing.assert_close(logprobs(c2.lora_id), with_c, rtol=0, atol=1e-6)


def test_pinning_limits_and_admission(setup):
    mgr = runner_for(setup, lora_backend="torch_native", max_loras_per_batch=3).lora_manager
    a, b = (next(i for i, r in mgr.refs.items() if r.lora_name == n) for n in ("a", "b"))
    # The base model needs no adapter slot.
    assert mgr.validate_lora_batch({None, a, b, "x"}) and not mgr.validate_lora_batch({None, a, b, "x", "y"})
    p1, p2 = ref(setup, "c", "p1", pinned=True), ref(setup, "c", "p2", pinned=True)
    assert mgr.load_lora_adapter(p1).success and mgr.load_lora_adapter(p2).success
    out = mgr.load_lora_adapter(ref(setup, "c", "p3", pinned=True))
    assert not out.success and "pinned" in out.error_message and "--max-loras-per-batch" in out.error_message
    # Pinned adapters hold their slots: only one slot is left for the unpinned adapters.
    assert mgr.validate_lora_batch({None}) and mgr.validate_lora_batch({p1.lora_id, a, None})
    assert not mgr.validate_lora_batch({a, b})
    mgr.make_resident({p1.lora_id, p2.lora_id, None})
    for other in (a, b, None, a):
        mgr.make_resident({other})
        assert mgr.pool.is_resident(p1.lora_id) and mgr.pool.is_resident(p2.lora_id)
    assert mgr.integrity_report().ok


def test_max_loaded_loras(setup):
    mgr = runner_for(
        setup, lora_backend="torch_native", max_loras_per_batch=2, max_loaded_loras=3
    ).lora_manager
    assert mgr.load_lora_adapter(ref(setup, "c")).success
    out = mgr.load_lora_adapter(ref(setup, "c", "c2"))
    assert not out.success and "--max-loaded-loras" in out.error_message


# ---------------------------------------------------------------------- graph-path contract
def _extend_batch(runner, lens, lora_ids):
    reqs = []
    for n, lid in zip(lens, lora_ids):
        row = runner.req_to_token_pool.alloc(1)[0]
        reqs.append(
            ExtendRequest(
                row, list(range(3, 3 + n)), 0, runner.token_to_kv_pool_allocator.alloc(n), lora_id=lid
            )
        )
    return build_extend_batch(reqs, runner.req_to_token_pool, runner.device, enable_lora=True)


def test_supports_prefill_cuda_graph_by_backend(setup):
    for backend, expected in (("torch_native", False), ("triton", True), ("csgmv", True)):
        mgr = runner_for(setup, lora_backend=backend).lora_manager
        assert mgr.supports_prefill_cuda_graph is expected


def test_can_use_prefill_cuda_graph_predicate(setup):
    runner = runner_for(setup, lora_backend="triton")
    mgr = runner.lora_manager
    a = next(iter(mgr.refs))
    fb = _extend_batch(runner, [5, 7], [a, None])
    assert not mgr.can_use_prefill_cuda_graph(fb)  # not initialised
    assert mgr.prefill_cuda_graph_max_bs is None
    mgr.init_prefill_cuda_graph_batch_info(16)
    assert mgr.prefill_cuda_graph_max_bs == 16  # token-major metadata: the token count caps requests
    assert mgr.can_use_prefill_cuda_graph(fb)
    assert not mgr.can_use_prefill_cuda_graph(_extend_batch(runner, [9, 8], [a, a]))  # 17 > 16 tokens
    assert mgr.can_use_prefill_cuda_graph(_extend_batch(runner, [1] * 16, [None] * 16))
    # The static metadata never grows once made (captured graphs hold its addresses).
    with pytest.raises(ValueError, match="cannot grow"):
        mgr.init_prefill_cuda_graph_batch_info(64)
    mgr.init_prefill_cuda_graph_batch_info(8)  # smaller: the existing buffers serve it
    assert mgr.lora_backend.prefill_cuda_graph_max_tokens == 16
    runner = runner_for(setup, lora_backend="triton")
    mgr = runner.lora_manager
    mgr.init_prefill_cuda_graph_batch_info(64)
    # No request cap below the tokens (the old triton backend had 32 segment slots).
    assert mgr.can_use_prefill_cuda_graph(_extend_batch(runner, [1] * 48, [a, None] * 24))
    fb.extend_num_tokens = None
    assert not mgr.can_use_prefill_cuda_graph(fb)
    row = runner.req_to_token_pool.alloc(1)[0]
    dec = build_decode_batch(
        [DecodeRequest(row, 5, 3, int(runner.token_to_kv_pool_allocator.alloc(1)[0]), lora_id=a)],
        runner.req_to_token_pool,
        runner.device,
        enable_lora=True,
    )
    assert not mgr.can_use_prefill_cuda_graph(dec)


@pytest.mark.parametrize("backend", ["triton", "csgmv"])
def test_flags_pick_the_metadata_and_static_prefill_info_matches_eager(setup, backend):
    """The manager passes the caller's path through; the static prefill info, refreshed in place,
    drives the kernels to the same result as the eager info (run eagerly here, on the CPU)."""
    runner = runner_for(setup, lora_backend=backend)
    mgr = runner.lora_manager
    backend_obj = mgr.lora_backend
    a, b = (next(i for i, r in mgr.refs.items() if r.lora_name == n) for n in ("a", "b"))
    mgr.init_prefill_cuda_graph_batch_info(32)
    mgr.init_cuda_graph_batch_info(8)
    static = backend_obj.prefill_cuda_graph_batch_info
    addresses = (static.permutation.data_ptr(), static.lora_ranks.data_ptr(), static.scalings.data_ptr())

    def body(lora_ids, lens, prefill_graph):
        fb = _extend_batch(runner, lens, lora_ids)
        runner.attach_pools(fb)
        mgr.prepare_forward(fb, ForwardPlan(ForwardPath.PREFILL_GRAPH if prefill_graph else ForwardPath.EAGER, lora=True))
        assert (backend_obj.batch_info is static) is prefill_graph
        return runner.run_body(fb, ForwardPlan(ForwardPath.EAGER, lora=True))

    for lora_ids, lens in (([a, None, b, a], [5, 3, 6, 4]), ([None, None], [4, 4]), ([b], [9])):
        eager = body(lora_ids, lens, False)
        graph_meta = body(lora_ids, lens, True)
        assert torch.equal(graph_meta, eager)  # the same kernels and plans: the same bits
    assert addresses == (static.permutation.data_ptr(), static.lora_ranks.data_ptr(), static.scalings.data_ptr())

    row = runner.req_to_token_pool.alloc(1)[0]
    dec = build_decode_batch(
        [DecodeRequest(row, 5, 1, int(runner.token_to_kv_pool_allocator.alloc(1)[0]), lora_id=a)],
        runner.req_to_token_pool,
        runner.device,
        enable_lora=True,
    )
    mgr.prepare_forward(dec, ForwardPlan(ForwardPath.DECODE_GRAPH, lora=True))
    assert backend_obj.batch_info is backend_obj.cuda_graph_batch_info


def test_all_base_batch_still_runs_lora_kernels(setup):
    """Capture batches are all-base: the wrappers must still take the LoRA path (rank-0 no-op)."""
    runner = runner_for(setup, lora_backend="triton")
    fb = _extend_batch(runner, [4, 2], [None, None])
    runner.attach_pools(fb)
    runner.lora_manager.prepare_forward(fb, ForwardPlan(ForwardPath.EAGER, lora=True))
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.lora_active
    x = torch.randn(6, 64)
    out = qkv(x)
    w_aug = qkv.lora.folded
    if w_aug is not None:  # folded: x_aug = [x | zeros] through W_aug, exactly (no value for any row)
        x_aug = torch.cat([x, x.new_zeros(6, w_aug.shape[1] - 64)], dim=1)
        torch.testing.assert_close(out, torch.nn.functional.linear(x_aug, w_aug), rtol=0, atol=0)
    # Against the base GEMM over K alone: the same sums, only blocked differently by the BLAS.
    torch.testing.assert_close(out, qkv.base_layer(x), rtol=1e-6, atol=1e-6)


def test_integrity_report_detects_corruption(setup):
    mgr = runner_for(setup, lora_backend="torch_native").lora_manager
    mgr.make_resident({None, *mgr.refs})
    report = mgr.integrity_report()
    assert report.ok and set(report.resident.values()) == {None, *mgr.refs}
    mgr.pool.slot_ranks[mgr.pool.get_slot(None)] = 3
    report = mgr.integrity_report()
    assert not report.ok and any("base-model slot" in p for p in report.problems)
