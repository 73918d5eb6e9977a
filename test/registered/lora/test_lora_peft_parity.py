"""LoRA through our ModelRunner vs Hugging Face + PEFT, in float32, for every LoRA backend.

Adapters are written by `peft` with non-zero B (scaled so each visibly moves the logprobs); the
Triton backends run under TRITON_INTERPRET=1 on the CPU. Checked per architecture and backend:
  - prompt logprobs of each adapter (ranks 4, 8, 16; q/v only; all-linear rsLoRA) and of the base
    model match HF(+PEFT) within 1e-4;
  - a mixed batch (A, base, B, A) gives each request what it gets alone, prefill and decode;
  - more distinct adapters than pool slots complete, one batch after another, through eviction.
"""

import functools

import pytest
import torch
from helpers import EngineDriver, hf_model, hf_prompt_logprobs, make_runner, tiny_checkpoint
from lora_testlib import write_peft_adapter

ATOL = 1e-4
BATCH_ATOL = 4e-5  # a request in a mixed batch against the same request alone (float32)
BACKENDS = ("torch_native", "triton", "csgmv")
ADAPTERS = {  # name -> write_peft_adapter kwargs
    "r4": dict(r=4, seed=11),
    "qv8": dict(r=8, target_modules=["q_proj", "v_proj"], seed=12, b_std=0.05),
    "rs16": dict(r=16, lora_alpha=8, target_modules="all-linear", use_rslora=True, seed=13),
}


def _prompts(n: int, vocab: int = 512, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(L),), generator=gen).tolist() for L in (7, 13, 10, 17, 5)[:n]]


PROMPTS = _prompts(5)


@functools.lru_cache(maxsize=None)
def world(arch: str, root: str):
    ckpt = tiny_checkpoint(arch, hidden_size=64, intermediate_size=128)
    paths = {
        name: write_peft_adapter(f"{root}/{arch}-{name}", base_model=hf_model(ckpt), **kw)
        for name, kw in ADAPTERS.items()
    }
    return ckpt, paths


@functools.lru_cache(maxsize=None)
def hf_lora_model(arch: str, root: str, adapter: "str | None", dtype: torch.dtype = torch.float32):
    from peft import PeftModel

    ckpt, paths = world(arch, root)
    model = hf_model(ckpt, dtype=dtype)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, paths[adapter]).eval()
    return model


@functools.lru_cache(maxsize=None)
def hf_reference(arch: str, root: str, adapter: "str | None") -> list[torch.Tensor]:
    """HF(+PEFT) prompt logprobs of every prompt."""
    return [hf_prompt_logprobs(hf_lora_model(arch, root, adapter), p) for p in PROMPTS]


@torch.no_grad()
def hf_next_logprob(arch: str, root: str, adapter: "str | None", ids: list[int], token: int) -> float:
    logits = hf_lora_model(arch, root, adapter)(input_ids=torch.tensor([ids])).logits[0, -1].float()
    return float(torch.log_softmax(logits, -1)[token])


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("lora-parity"))


def _runner(arch, root, backend, **kw):
    ckpt, paths = world(arch, root)
    runner = make_runner(ckpt, lora_paths=[f"{n}={p}" for n, p in paths.items()], lora_backend=backend, **kw)
    ids = {ref.lora_name: lid for lid, ref in runner.lora_manager.refs.items()}
    return runner, ids


def _prompt_logprobs(driver, prompts, lora_ids):
    """Prefill with prompt logprobs; the caller releases the returned seqs."""
    seqs = [driver.add(p, lora_id=lid) for p, lid in zip(prompts, lora_ids)]
    out = driver.extend(seqs, logprob_start=0)
    return [torch.tensor(x) for x in out.input_token_logprobs], out, seqs


def _release(driver, seqs):
    for s in seqs:
        driver.release(s)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_each_adapter_matches_peft(arch, backend, root):
    runner, ids = _runner(arch, root, backend)
    driver = EngineDriver(runner)
    base_ref = hf_reference(arch, root, None)
    for name in [None, *ADAPTERS]:
        ref = hf_reference(arch, root, name)
        for i in (0, 3):
            got, _, seqs = _prompt_logprobs(driver, [PROMPTS[i]], [ids.get(name)])
            _release(driver, seqs)
            torch.testing.assert_close(got[0], ref[i], rtol=0, atol=ATOL, msg=f"{name} prompt {i}")
            if name is not None:  # the adapter must matter, or the comparison proves nothing
                assert (ref[i] - base_ref[i]).abs().max() > 5e-2, name


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_batch_equals_requests_alone(arch, backend, root):
    runner, ids = _runner(arch, root, backend)
    driver = EngineDriver(runner)
    names = ["r4", None, "rs16", "r4"]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3]]
    lora_ids = [ids.get(n) for n in names]

    got, out, seqs = _prompt_logprobs(driver, prompts, lora_ids)
    # One decode step of the same mixed batch.
    for s, t in zip(seqs, out.next_token_ids.tolist()):
        s.tokens.append(t)
    dec = driver.decode(seqs, return_logprob=True)
    _release(driver, seqs)

    for i, (p, lid, name) in enumerate(zip(prompts, lora_ids, names)):
        alone, out1, seqs1 = _prompt_logprobs(driver, [p], [lid])
        for s, t in zip(seqs1, out1.next_token_ids.tolist()):
            s.tokens.append(t)
        dec1 = driver.decode(seqs1, return_logprob=True)
        _release(driver, seqs1)
        # Batch invariance, not bit-exactness: the shrink's row tiles hold other requests' rows in
        # the mixed batch, so float32 sums are ordered differently (a few ulp of logprobs ~10-30).
        torch.testing.assert_close(got[i], alone[0], rtol=0, atol=BATCH_ATOL, msg=f"request {i} ({name})")
        torch.testing.assert_close(got[i], hf_reference(arch, root, name)[i], rtol=0, atol=ATOL)
        assert out.next_token_ids[i] == out1.next_token_ids[0]
        assert dec.next_token_ids[i] == dec1.next_token_ids[0]
        assert abs(dec.next_token_logprobs[i] - dec1.next_token_logprobs[0]) < BATCH_ATOL
        # The decode step (LoRA on a one-token segment) against HF+PEFT over the whole sequence.
        seq = seqs[i].tokens
        expected = hf_next_logprob(arch, root, name, seq, int(dec.next_token_ids[i]))
        assert abs(dec.next_token_logprobs[i] - expected) < ATOL, (name, dec.next_token_logprobs[i], expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_more_adapters_than_slots_complete_through_eviction(backend, root):
    arch = "llama"
    # 2 slots for 3 adapters and the base model.
    runner, ids = _runner(arch, root, backend, max_loras_per_batch=2)
    mgr = runner.lora_manager
    driver = EngineDriver(runner)
    ptrs = mgr.pool.data_ptrs()
    schedule = [["r4"], ["qv8"], ["rs16", None], ["r4", "r4"], [None, "qv8"], ["rs16"]]
    for batch in schedule:
        lora_ids = [ids.get(n) for n in batch]
        assert mgr.validate_lora_batch(set(lora_ids))
        prompt_idx = list(range(len(batch)))
        got, _, seqs = _prompt_logprobs(driver, [PROMPTS[i] for i in prompt_idx], lora_ids)
        _release(driver, seqs)
        for i, name in zip(prompt_idx, batch):
            torch.testing.assert_close(got[i], hf_reference(arch, root, name)[i], rtol=0, atol=ATOL)
        assert mgr.integrity_report().ok
    assert mgr.pool.data_ptrs() == ptrs
    # Three distinct ids do not fit two slots: admission says no, and the pool refuses loudly.
    too_many = {ids["r4"], ids["qv8"], ids["rs16"]}
    assert not mgr.validate_lora_batch(too_many)
    with pytest.raises(ValueError, match="distinct adapters"):
        mgr.make_resident(too_many)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_lora_tracks_float32_peft(backend, root):
    """The same parity on the GPU in bf16. bf16 keeps ~8 mantissa bits, so logprobs cannot match
    float32 to 1e-4; the bar is relative to HF+PEFT's own bf16 run: our error against float32
    HF+PEFT may be at most twice PEFT's bf16 error plus 0.05 nats (mean: plus 0.02). A real bug
    (a wrong slice, scaling or segment) moves logprobs by whole nats, so this still catches it.
    GPU only: Triton 3.9's CPU interpreter gets `tl.dot` on bf16 inputs wrong (garbage of ~1e10),
    so the CPU suites run the kernels in float32."""
    arch = "qwen3"
    ckpt, paths = world(arch, root)
    runner = make_runner(ckpt, device="cuda", dtype="bfloat16", attention_backend="triton",
                         lora_paths=[f"{n}={p}" for n, p in paths.items()], lora_backend=backend)
    ids = {ref.lora_name: lid for lid, ref in runner.lora_manager.refs.items()}
    driver = EngineDriver(runner)
    names = [None, *ADAPTERS]
    # All four adapters (base included) in one mixed batch, then each checked against PEFT.
    got, _, seqs = _prompt_logprobs(driver, PROMPTS[:4], [ids.get(n) for n in names])
    _release(driver, seqs)
    for i, name in enumerate(names):
        ref32 = hf_reference(arch, root, name)[i]
        peft16 = hf_lora_model(arch, root, name, torch.bfloat16)
        peft_err = (hf_prompt_logprobs(peft16, PROMPTS[i]) - ref32).abs()
        our_err = (got[i] - ref32).abs()
        print(f"{backend} {name}: ours max {our_err.max():.4f} mean {our_err.mean():.4f}; "
              f"HF+PEFT bf16 max {peft_err.max():.4f} mean {peft_err.mean():.4f}")
        assert our_err.max() <= 2 * peft_err.max() + 0.05, (name, our_err.max(), peft_err.max())
        assert our_err.mean() <= 2 * peft_err.mean() + 0.02, (name, our_err.mean(), peft_err.mean())
        if name is not None:  # the adapter must still matter at this precision
            assert (got[i] - hf_reference(arch, root, None)[i]).abs().max() > 5e-2, name
