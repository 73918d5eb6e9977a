"""The engine against Hugging Face transformers on tiny random checkpoints (CPU, float32).

Checkpoints are written by transformers' own save_pretrained with peaked next-token distributions
(mean top-1 probability ~0.7), so a logprob tolerance of 1e-4 is meaningful. Each architecture
also exercises one feature: llama (llama3 RoPE scaling, q/k/v/o and MLP biases), mistral (linear
RoPE scaling), qwen2 (q/k/v bias, tied embeddings), qwen3 (q/k norm, head_dim != hidden/heads, YaRN
RoPE scaling with its attention factor).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from helpers import (
    ARCHS,
    EngineDriver,
    hf_greedy,
    hf_model,
    hf_prompt_logprobs,
    make_runner,
    tiny_checkpoint,
)

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_executor.model_loading import get_model
from sglang.srt.tools.make_checkpoint import make_checkpoint

BACKENDS = ("torch_native", "triton")
ARCH_OVERRIDES = {
    "llama": dict(
        attention_bias=True,
        mlp_bias=True,
        rope_scaling=dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64),
    ),
    "mistral": dict(rope_scaling=dict(rope_type="linear", factor=2.0)),
    "qwen2": dict(tie_word_embeddings=True),
    # Qwen3's model card turns YaRN on this way; 256 puts the ramp between extrapolated and
    # interpolated pairs inside the tiny head (pairs 0-7), so every branch of the formula counts.
    "qwen3": dict(rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=256)),
}
TEXTS = (
    "The engine reads a prompt, splits it into tokens, and runs the model one step at a time.",
    "Mira walked to the harbour.",
    "Adapters are small sets of extra weights that change what a model says",
)
ATOL = 1e-4

_runners: dict = {}
_hf: dict = {}


def checkpoint(arch: str) -> str:
    return tiny_checkpoint(arch, **ARCH_OVERRIDES[arch])


def runner_for(arch: str, backend: str, device: str = "cpu"):
    if backend == "triton" and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels on CPU tensors need TRITON_INTERPRET=1 (set by conftest without CUDA)")
    key = (arch, backend)
    if key not in _runners:
        _runners[key] = make_runner(checkpoint(arch), attention_backend=backend)
    return _runners[key]


def hf_for(arch: str):
    if arch not in _hf:
        _hf[arch] = hf_model(checkpoint(arch))
    return _hf[arch]


def prompts_for(arch: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint(arch))
    return [tok(t).input_ids for t in TEXTS]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logprobs_match_hf(arch: str, backend: str) -> None:
    hf = hf_for(arch)
    driver = EngineDriver(runner_for(arch, backend))
    prompts = prompts_for(arch)
    seqs = [driver.add(p) for p in prompts]
    out = driver.extend(seqs, logprob_start=0, top_logprobs_num=5)
    for seq in seqs:
        driver.release(seq)
    for prompt, lps, tops in zip(prompts, out.input_token_logprobs, out.input_top_logprobs):
        ref = hf_prompt_logprobs(hf, prompt)
        assert len(lps) == len(prompt) - 1
        torch.testing.assert_close(torch.tensor(lps), ref, atol=ATOL, rtol=0)
        with torch.no_grad():
            ref_all = torch.log_softmax(hf(input_ids=torch.tensor([prompt])).logits[0, :-1].float(), -1)
        for pos, (vals, ids) in enumerate(tops):
            assert len(vals) == len(ids) == 5
            ref_vals = ref_all[pos].topk(5).values
            torch.testing.assert_close(torch.tensor(vals), ref_vals, atol=ATOL, rtol=0)
            # Ids are compared through HF's values (robust to exact ties).
            torch.testing.assert_close(ref_all[pos, ids], ref_vals, atol=ATOL, rtol=0)
    # The first sampled token is greedy by default: HF's argmax at the last prompt position.
    for prompt, tok in zip(prompts, out.next_token_ids.tolist()):
        with torch.no_grad():
            assert tok == int(hf(input_ids=torch.tensor([prompt])).logits[0, -1].argmax())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_decode_matches_hf_generate(arch: str, backend: str) -> None:
    hf = hf_for(arch)
    driver = EngineDriver(runner_for(arch, backend))
    prompts = prompts_for(arch)[:2]
    seqs = [driver.add(p) for p in prompts]
    out_lps: list[list[float]] = [[] for _ in prompts]
    out = driver.extend(seqs, logprob_start=len(max(prompts, key=len)))  # only the sampled token's
    for _ in range(16):
        for i, (seq, tok) in enumerate(zip(seqs, out.next_token_ids.tolist())):
            seq.tokens.append(tok)
            out_lps[i].append(out.next_token_logprobs[i])
        if len(seqs[0].tokens) - len(prompts[0]) == 16:
            break
        out = driver.decode(seqs, return_logprob=True)
    for seq in seqs:
        driver.release(seq)
    for prompt, seq, lps in zip(prompts, seqs, out_lps):
        generated = seq.tokens[len(prompt):]
        assert generated == hf_greedy(hf, prompt, 16)
        # Decode-path numerics: the logprob of every generated token, against one HF pass.
        ref = hf_prompt_logprobs(hf, seq.tokens)[len(prompt) - 1 :]
        torch.testing.assert_close(torch.tensor(lps), ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_chunked_prefill_matches_single_pass(arch: str, backend: str) -> None:
    driver = EngineDriver(runner_for(arch, backend))
    prompt = [t for p in prompts_for(arch) for t in p][:30]
    for start in (0, 7, 16):
        whole = driver.add(prompt)
        one = driver.extend([whole], logprob_start=start)
        chunked = driver.add(prompt)
        first = driver.extend([chunked], num_tokens=[12], logprob_start=start)
        second = driver.extend([chunked], logprob_start=start)
        driver.release(whole)
        driver.release(chunked)
        lps_one = one.input_token_logprobs[0]
        lps_two = first.input_token_logprobs[0] + second.input_token_logprobs[0]
        assert len(lps_one) == len(prompt) - 1 - start
        torch.testing.assert_close(torch.tensor(lps_two), torch.tensor(lps_one), atol=ATOL, rtol=0)
        assert second.next_token_ids.tolist() == one.next_token_ids.tolist()


def _greedy_continue(driver: EngineDriver, seqs, out, steps: int) -> None:
    """Append the sampled tokens and decode until each seq has `steps` new tokens."""
    for step in range(steps):
        for seq, tok in zip(seqs, out.next_token_ids.tolist()):
            seq.tokens.append(tok)
        if step < steps - 1:
            out = driver.decode(seqs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_request_alone_and_in_mixed_batch_agree(backend: str) -> None:
    driver = EngineDriver(runner_for("qwen3", backend))
    p0, p1, p2 = prompts_for("qwen3")
    alone = driver.generate_greedy([p0], 10)[0]
    neighbour_alone = driver.generate_greedy([p2], 10)[0]
    # In a batch with a shorter fresh prompt and a longer one whose first 5 tokens are already
    # cached (a second chunk): other shapes and prefixes everywhere, the same tokens.
    cached = driver.add(p2)
    driver.extend([cached], num_tokens=[5])
    fresh, target = driver.add(p1), driver.add(p0)
    seqs = [fresh, target, cached]
    _greedy_continue(driver, seqs, driver.extend(seqs), 10)
    for seq in seqs:
        driver.release(seq)
    assert target.tokens[len(p0):] == alone
    assert cached.tokens[len(p2):] == neighbour_alone


def test_sharded_and_single_file_checkpoints_load_identically(tmp_path) -> None:
    single = make_checkpoint(str(tmp_path / "single"), arch="qwen2", seed=3)
    sharded = make_checkpoint(str(tmp_path / "sharded"), arch="qwen2", seed=3, shards=3)
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        files = set(json.load(f)["weight_map"].values())
    # Exactly the shards asked for (transformers' greedy max_shard_size may write one more).
    assert sorted(files) == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors")) == sorted(files)
    models = [get_model(ModelConfig.from_pretrained(p), progress=False) for p in (single, sharded)]
    a, b = (dict(m.named_parameters()) for m in models)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_dummy_load_format_runs_from_config_alone(tmp_path) -> None:
    path = make_checkpoint(str(tmp_path / "cfg"), arch="llama", with_weights=False)
    with pytest.raises(ValueError, match="no safetensors weights"):
        make_runner(path)
    runner = make_runner(path, load_format="dummy")
    driver = EngineDriver(runner)
    seq = driver.add(list(range(3, 20)))
    logits = driver.extend([seq], logprob_start=0).input_token_logprobs[0]
    assert len(logits) == 16 and all(torch.isfinite(torch.tensor(logits)))


def test_unsupported_architecture_and_bad_paths_are_value_errors(tmp_path) -> None:
    path = str(tmp_path / "gpt2")
    shutil.copytree(checkpoint("qwen3"), path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["GPT2LMHeadModel"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="unsupported model architecture"):
        make_runner(path)
    with pytest.raises(ValueError, match="not a directory"):
        make_runner(str(tmp_path / "missing"))


def test_tensor_parallel_loaders_partition_the_full_tensors() -> None:
    """Only tp_size 1 is built, but the loaders already cut each rank's slice: the ranks'
    slices of a fused layer must tile HF's separate tensors exactly."""
    from sglang.srt.distributed import TensorParallelGroup
    from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    hidden, head, heads, kv_heads = 16, 4, 4, 2
    q, k, v = torch.randn(16, hidden), torch.randn(8, hidden), torch.randn(8, hidden)
    gate, up, down = torch.randn(12, hidden), torch.randn(12, hidden), torch.randn(hidden, 12)
    for tp in (1, 2, 4):  # tp=4 replicates each KV head on two ranks
        qkv_parts, gate_up_parts, down_parts = [], [], []
        for rank in range(tp):
            group = TensorParallelGroup.layout_only(rank, tp)
            qkv = QKVParallelLinear(hidden, head, heads, kv_heads, tp_group=group)
            for shard, w in (("q", q), ("k", k), ("v", v)):
                qkv.weight.weight_loader(qkv.weight, w, shard)
            qs, kvs = qkv.q_proj_shard_size, qkv.kv_proj_shard_size
            qkv_parts.append(qkv.weight.split([qs, kvs, kvs]))
            mlp = MergedColumnParallelLinear(hidden, [12, 12], tp_group=group)
            mlp.weight.weight_loader(mlp.weight, gate, 0)
            mlp.weight.weight_loader(mlp.weight, up, 1)
            gate_up_parts.append(mlp.weight.split(mlp.output_sizes))
            row = RowParallelLinear(12, hidden, tp_group=group)
            row.weight.weight_loader(row.weight, down)
            down_parts.append(row.weight)
        assert torch.equal(torch.cat([p[0] for p in qkv_parts]), q)
        step = max(1, tp // kv_heads)  # ranks sharing one KV head hold the same slice
        assert torch.equal(torch.cat([p[1] for p in qkv_parts][::step]), k)
        assert torch.equal(torch.cat([p[2] for p in qkv_parts][::step]), v)
        assert torch.equal(torch.cat([p[0] for p in gate_up_parts]), gate)
        assert torch.equal(torch.cat([p[1] for p in gate_up_parts]), up)
        assert torch.equal(torch.cat(down_parts, dim=1), down)
    qkv = QKVParallelLinear(hidden, head, heads, kv_heads)
    with pytest.raises(ValueError, match="shape"):
        qkv.weight.weight_loader(qkv.weight, torch.randn(3, hidden), "k")


def test_model_config_reads_old_and_new_rope_keys() -> None:
    base = dict(architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=1,
                num_attention_heads=4, intermediate_size=128, vocab_size=100)
    old = ModelConfig.from_dict({**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0},
                                 "torch_dtype": "float16"}, device="cuda")
    new = ModelConfig.from_dict({**base, "rope_parameters": {"rope_theta": 5e5, "rope_type": "linear",
                                                             "factor": 2.0}, "dtype": "bfloat16"}, device="cuda")
    for c in (old, new):
        assert c.rope_theta == 5e5 and c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
        assert c.num_key_value_heads == 4 and c.head_dim == 16
    assert old.dtype == torch.float16 and new.dtype == torch.bfloat16  # auto on CUDA
    assert ModelConfig.from_dict(base, device="cpu").dtype == torch.float32  # auto on CPU
    assert ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "default"}}).rope_scaling is None
    with pytest.raises(ValueError, match="rope scaling"):
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}})
    # Sliding windows are not implemented: the context is capped at the window.
    capped = ModelConfig.from_dict({**base, "sliding_window": 64, "max_position_embeddings": 4096})
    assert capped.context_len == 64
    assert ModelConfig.from_dict(base, context_length=100).context_len == 100


@pytest.mark.parametrize("extra", [
    {},  # Qwen3's model card
    {"attention_factor": 1.25, "beta_fast": 16.0, "beta_slow": 2.0},
    {"mscale": 1.0, "mscale_all_dim": 0.5},  # DeepSeek's form of the attention factor
    {"truncate": False},
])
def test_yarn_frequencies_and_scale_equal_transformers(extra: dict) -> None:
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from sglang.srt.layers.rotary_embedding import rope_frequencies

    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, **extra}
    cfg = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 2560, "num_hidden_layers": 1,
           "num_attention_heads": 32, "head_dim": 128, "intermediate_size": 9728, "vocab_size": 1000,
           "max_position_embeddings": 40960, "rope_theta": 1e6, "rope_scaling": rope}
    ours = ModelConfig.from_dict(cfg)
    inv_freq, scale = rope_frequencies(128, ours.rope_theta, ours.rope_scaling)
    hf_cfg = Qwen3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "rope_scaling")},
                         rope_parameters={"rope_theta": 1e6, **rope})
    ref_freq, ref_scale = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    assert torch.equal(inv_freq, ref_freq) and scale == pytest.approx(ref_scale, rel=1e-12)
    assert scale != 1.0 or extra.get("mscale") == extra.get("mscale_all_dim")
    # The context YaRN extends to is original x factor (vLLM's reading; 131,072 for Qwen3).
    assert ours.context_len == 131072


def test_yarn_context_rules() -> None:
    base = dict(architectures=["Qwen3ForCausalLM"], hidden_size=64, num_hidden_layers=1,
                num_attention_heads=4, intermediate_size=128, vocab_size=100, max_position_embeddings=4096)
    plain = {**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}
    c = ModelConfig.from_dict(plain)  # the old context defaults to max_position_embeddings
    assert c.rope_scaling["original_max_position_embeddings"] == 4096 and c.context_len == 8192
    # A missing factor is the ratio of the two contexts.
    c = ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 1024}})
    assert c.rope_scaling["factor"] == 4.0 and c.context_len == 4096
    assert ModelConfig.from_dict(plain, context_length=8192).context_len == 8192
    with pytest.raises(ValueError, match="YaRN context"):
        ModelConfig.from_dict(plain, context_length=8193)
    with pytest.raises(ValueError, match="factor must be at least 1"):
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 0.5}})


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_on_cpu_follows_hf_bf16_rounding(arch: str) -> None:
    """Norms, RoPE and the residual adds round in HF's order, so on the same CPU our bf16 run
    matches transformers' bf16 run (bit for bit when written; the bar is a tenth of what bf16
    itself moves logprobs away from float32, ~0.1-0.3 nats here)."""
    prompts = prompts_for(arch)[:2]
    ref16 = hf_model(checkpoint(arch), dtype=torch.bfloat16)
    driver = EngineDriver(make_runner(checkpoint(arch), dtype="bfloat16"))
    seqs = [driver.add(p) for p in prompts]
    out = driver.extend(seqs, logprob_start=0)
    for seq in seqs:
        driver.release(seq)
    for prompt, lps in zip(prompts, out.input_token_logprobs):
        torch.testing.assert_close(torch.tensor(lps), hf_prompt_logprobs(ref16, prompt), atol=0.02, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_tracks_float32_hf(backend: str) -> None:
    """bf16 keeps ~8 mantissa bits, so its logprobs cannot match float32 to 1e-4. The bar is
    relative to transformers' own bf16 run: ours may deviate from float32 HF by at most twice
    what HF bf16 does (plus 0.05 nats of slack), which catches real bugs (those move logprobs by
    whole nats) without flaking on rounding."""
    arch = "qwen3"
    prompts = prompts_for(arch)
    ref32 = hf_model(checkpoint(arch))
    ref16 = hf_model(checkpoint(arch), dtype=torch.bfloat16)
    runner = make_runner(checkpoint(arch), device="cuda", dtype="bfloat16", attention_backend=backend)
    driver = EngineDriver(runner)
    seqs = [driver.add(p) for p in prompts]
    out = driver.extend(seqs, logprob_start=0)
    for prompt, lps in zip(prompts, out.input_token_logprobs):
        fp32 = hf_prompt_logprobs(ref32, prompt)
        hf_err = (hf_prompt_logprobs(ref16, prompt) - fp32).abs()
        our_err = (torch.tensor(lps) - fp32).abs()
        assert our_err.max() <= 2 * hf_err.max() + 0.05, (our_err.max(), hf_err.max())
        assert our_err.mean() <= 2 * hf_err.mean() + 0.02, (our_err.mean(), hf_err.mean())
