"""LoRAConfig and LoRAAdapter on real PEFT adapters: normalisation, scaling and every refusal."""

import json
import math
import os
import shutil

import pytest
import torch
from lora_testlib import edit_adapter_config, peft_tensors, peft_weight, tiny_hf_config, write_peft_adapter

from sglang.srt.lora.lora import LoRAAdapter, LoRAModelShapes
from sglang.srt.lora.lora_config import LoRAConfig
from sglang.srt.lora.mem_pool import LoRAMemoryPool

SHAPES = LoRAModelShapes.from_hf_config(tiny_hf_config())
Q, KV, INTER = 64, 32, 128  # tiny llama: 4 heads x 16, 2 kv heads x 16


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for r in (4, 8, 16):
        out[f"r{r}"] = write_peft_adapter(str(root / f"r{r}"), r=r, lora_alpha=3 * r, seed=r)
    out["qv"] = write_peft_adapter(str(root / "qv"), r=8, target_modules=["q_proj", "v_proj"], seed=5)
    out["rslora"] = write_peft_adapter(
        str(root / "rslora"), r=16, lora_alpha=8, target_modules="all-linear", use_rslora=True, seed=6
    )
    out["bin"] = write_peft_adapter(str(root / "bin"), r=4, seed=7, safe_serialization=False)
    return out


def load(path: str, shapes: LoRAModelShapes = SHAPES) -> LoRAAdapter:
    return LoRAAdapter.load("id", LoRAConfig.from_path(path, base_vocab_size=256), shapes)


def copy_adapter(src: str, tmp_path, name: str = "copy") -> str:
    dst = str(tmp_path / name)
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------------- normalisation
@pytest.mark.parametrize("r", [4, 8, 16])
def test_fused_layout_matches_peft_tensors(adapters, r):
    path = adapters[f"r{r}"]
    ad = load(path)
    t = peft_tensors(path)
    assert ad.rank == r and ad.scaling == pytest.approx(3.0)
    assert ad.modules == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    for layer in range(2):
        a, b = ad.layers[layer]["qkv_proj"]
        assert a.shape == (3 * r, 64) and b.shape == (Q + 2 * KV, r)
        for k, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            torch.testing.assert_close(
                a[k * r : (k + 1) * r], peft_weight(t, layer, proj, "A"), rtol=0, atol=0
            )
        torch.testing.assert_close(
            b,
            torch.cat([peft_weight(t, layer, p, "B") for p in ("q_proj", "k_proj", "v_proj")]),
            rtol=0,
            atol=0,
        )
        a, b = ad.layers[layer]["gate_up_proj"]
        assert a.shape == (2 * r, 64) and b.shape == (2 * INTER, r)
        torch.testing.assert_close(a[:r], peft_weight(t, layer, "gate_proj", "A"), rtol=0, atol=0)
        torch.testing.assert_close(b[INTER:], peft_weight(t, layer, "up_proj", "B"), rtol=0, atol=0)
        a, b = ad.layers[layer]["down_proj"]
        assert a.shape == (r, INTER) and b.shape == (64, r)
        torch.testing.assert_close(b, peft_weight(t, layer, "down_proj", "B"), rtol=0, atol=0)


def test_q_v_only_adapter_has_zero_k_and_no_other_modules(adapters):
    ad = load(adapters["qv"])
    t = peft_tensors(adapters["qv"])
    assert LoRAConfig.from_path(adapters["qv"]).normalized_target_modules == {"qkv_proj"}
    assert ad.modules == {"qkv_proj"}
    a, b = ad.layers[1]["qkv_proj"]
    assert torch.count_nonzero(a[8:16]) == 0 and torch.count_nonzero(b[Q : Q + KV]) == 0
    torch.testing.assert_close(a[16:24], peft_weight(t, 1, "v_proj", "A"), rtol=0, atol=0)
    torch.testing.assert_close(b[Q + KV :], peft_weight(t, 1, "v_proj", "B"), rtol=0, atol=0)
    assert torch.count_nonzero(a[:8]) > 0 and torch.count_nonzero(b[:Q]) > 0


def test_all_linear_rslora_scaling(adapters, tmp_path):
    cfg = LoRAConfig.from_path(adapters["rslora"])
    assert cfg.use_rslora and cfg.scaling == pytest.approx(8 / math.sqrt(16))
    assert cfg.normalized_target_modules == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert load(adapters["rslora"]).modules == cfg.normalized_target_modules
    # The literal PEFT string, as hand-written configs have it.
    path = copy_adapter(adapters["rslora"], tmp_path)
    edit_adapter_config(path, target_modules="all-linear", use_rslora=False)
    cfg = LoRAConfig.from_path(path)
    assert cfg.normalized_target_modules == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert cfg.scaling == pytest.approx(8 / 16)


def test_regex_target_modules_resolve_like_peft(adapters, tmp_path):
    path = copy_adapter(adapters["qv"], tmp_path)
    edit_adapter_config(path, target_modules=r".*\.(q_proj|v_proj)")
    assert LoRAConfig.from_path(path).normalized_target_modules == {"qkv_proj"}
    assert load(path).modules == {"qkv_proj"}


def test_regex_target_modules_of_one_layer_load(tmp_path):
    """A PEFT regex may name one layer (here layer 1): it targets q/v there, not nowhere."""
    path = write_peft_adapter(str(tmp_path / "layer1"), r=4, target_modules=r".*layers\.1\.self_attn\.(q_proj|v_proj)")
    assert {k.split(".layers.")[1].split(".")[0] for k in peft_tensors(path)} == {"1"}
    assert LoRAConfig.from_path(path).normalized_target_modules == {"qkv_proj"}
    assert load(path).modules == {"qkv_proj"}


def test_layers_to_transform_limits_the_adapter_to_those_layers(adapters, tmp_path):
    """PEFT adapts only the layers in `layers_to_transform` and ignores the file's tensors for
    others; they were applied to every layer (prompt logprobs off PEFT's by up to 7)."""
    path = write_peft_adapter(str(tmp_path / "peft_l1"), r=4, layers_to_transform=[1], seed=9)
    assert {k.split(".layers.")[1].split(".")[0] for k in peft_tensors(path)} == {"1"}  # PEFT wrote layer 1 only
    ad = load(path)
    assert not ad.layers[0] and set(ad.layers[1]) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    # A file with every layer's tensors and a config that names layer 0 only (one int, as PEFT allows).
    path = copy_adapter(adapters["r4"], tmp_path, "hand_l0")
    edit_adapter_config(path, layers_to_transform=0)
    ad, full = load(path), load(adapters["r4"])
    assert not ad.layers[1] and set(ad.layers[0]) == set(full.layers[0])
    for module, (a, b) in ad.layers[0].items():
        torch.testing.assert_close(a, full.layers[0][module][0], rtol=0, atol=0)
        torch.testing.assert_close(b, full.layers[0][module][1], rtol=0, atol=0)
    edit_adapter_config(path, layers_to_transform=[])  # PEFT: an empty list restricts nothing
    assert set(load(path).layers[1]) == set(full.layers[1])
    for bad in ([-1], ["0"], [True], "all"):
        edit_adapter_config(path, layers_to_transform=bad)
        _refused(path, "layers_to_transform must be a layer index")
    edit_adapter_config(path, layers_to_transform=[5])  # the tiny model has 2 layers
    with pytest.raises(ValueError, match="no weights for its layers_to_transform"):
        load(path)


def test_bin_checkpoint_loads(adapters):
    assert not os.path.exists(os.path.join(adapters["bin"], "adapter_model.safetensors"))
    ad = load(adapters["bin"])
    assert ad.modules == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert ad.layers[0]["o_proj"][0].shape == (4, 64)


def test_reading_an_adapter_keeps_nothing(adapters):
    """A server loads and unloads adapters all day: reading one's tensors must leave nothing behind
    (safetensors 0.8's memory-mapped `load_file` kept two objects per tensor, ~1.6 KB here)."""
    import gc
    import tracemalloc

    from sglang.srt.lora.lora import read_adapter_tensors

    path = adapters["rslora"]  # all seven modules: 28 tensors a read
    for _ in range(20):
        read_adapter_tensors(path)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(200):
            read_adapter_tensors(path)
        gc.collect()
        grown = sum(d.size_diff for d in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    assert grown / 200 < 200, f"{grown / 200:.0f} bytes kept per read"


def test_accepted_neutral_patterns_and_base_added_tokens(adapters, tmp_path):
    path = copy_adapter(adapters["r8"], tmp_path)
    edit_adapter_config(path, rank_pattern={"q_proj": 8}, alpha_pattern={"v_proj": 24})
    with open(os.path.join(path, "added_tokens.json"), "w") as f:
        json.dump({"<s>": 1, "<pad>": 255}, f)  # copies of base tokens: ids below the vocab
    assert LoRAConfig.from_path(path, base_vocab_size=256).r == 8


# ---------------------------------------------------------------------- refusals
def _refused(path: str, *needles: str, shapes: LoRAModelShapes = SHAPES) -> str:
    with pytest.raises(ValueError) as e:
        load(path, shapes)
    msg = str(e.value)
    for n in needles:
        assert n in msg, msg
    return msg


def test_dora_refused(tmp_path):
    path = write_peft_adapter(str(tmp_path / "dora"), r=4, target_modules=["q_proj"], use_dora=True)
    _refused(path, "DoRA", path)


def test_modules_to_save_refused(tmp_path):
    path = write_peft_adapter(
        str(tmp_path / "mts"), r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]
    )
    _refused(path, "modules_to_save", "lm_head")


def test_rank_pattern_refused(tmp_path):
    path = write_peft_adapter(
        str(tmp_path / "rp"), r=8, target_modules=["q_proj", "v_proj"], rank_pattern={"q_proj": 4}
    )
    _refused(path, "rank_pattern", "q_proj")


def test_alpha_pattern_refused(adapters, tmp_path):
    path = copy_adapter(adapters["r4"], tmp_path)
    edit_adapter_config(path, alpha_pattern={"o_proj": 99})
    _refused(path, "alpha_pattern")


def test_added_tokens_refused(adapters, tmp_path):
    path = copy_adapter(adapters["r4"], tmp_path)
    with open(os.path.join(path, "added_tokens.json"), "w") as f:
        json.dump({"<tool>": 256, "<pad>": 3}, f)
    _refused(path, "adds 1 token")


@pytest.mark.parametrize("target", ["lm_head", "embed_tokens"])
def test_unservable_targets_refused(tmp_path, target):
    path = write_peft_adapter(str(tmp_path / target), r=4, target_modules=["q_proj", target])
    _refused(path, target, "cannot be served")


def test_other_peft_type_refused(adapters, tmp_path):
    path = copy_adapter(adapters["r4"], tmp_path)
    edit_adapter_config(path, peft_type="LOHA")
    _refused(path, "LOHA", "only LoRA")


@pytest.mark.parametrize(
    "option,value,needle",
    [
        ("alora_invocation_tokens", [5, 6], "aLoRA"),
        ("layer_replication", [[0, 2], [1, 2]], "replication"),
        ("use_qalora", True, "QALoRA"),
        ("trainable_token_indices", [3], "token"),
    ],
)
def test_semantics_changing_options_refused(adapters, tmp_path, option, value, needle):
    path = copy_adapter(adapters["r4"], tmp_path)
    edit_adapter_config(path, **{option: value})
    _refused(path, needle, option)


def test_trained_bias_refused(adapters, tmp_path):
    path = copy_adapter(adapters["r4"], tmp_path)
    edit_adapter_config(path, bias="all")
    _refused(path, "bias")


def test_missing_files_refused(adapters, tmp_path):
    _refused(str(tmp_path / "nowhere"), "does not exist", "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    _refused(str(empty), "adapter_config.json", str(empty))
    path = copy_adapter(adapters["r4"], tmp_path, "noweights")
    os.remove(os.path.join(path, "adapter_model.safetensors"))
    _refused(path, "adapter_model.safetensors", path)
    path = copy_adapter(adapters["r4"], tmp_path, "badjson")
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        f.write("{not json")
    _refused(path, "adapter_config.json")


def test_truncated_safetensors_refused(adapters, tmp_path):
    path = copy_adapter(adapters["r4"], tmp_path)
    file = os.path.join(path, "adapter_model.safetensors")
    size = os.path.getsize(file)
    with open(file, "r+b") as f:
        f.truncate(size // 2)
    _refused(path, "truncated or corrupt", file)


def test_wrong_shapes_name_tensor_and_both_shapes(tmp_path):
    # Trained for a base whose MLP is 96 wide; our base's is 128.
    from lora_testlib import tiny_hf_model

    other = tiny_hf_model(intermediate_size=96)
    path = write_peft_adapter(str(tmp_path / "other"), r=4, target_modules=["down_proj"], base_model=other)
    msg = _refused(path, "down_proj.lora_A.weight", "(4, 96)", "(4, 128)")
    assert "layers.0" in msg or "layers.1" in msg


def test_non_finite_weights_refused(adapters, tmp_path):
    """A folded GEMM multiplies every slot's B by the other rows' zeros: inf/NaN must never load."""
    from safetensors.torch import load_file, save_file

    path = copy_adapter(adapters["qv"], tmp_path)
    file = f"{path}/adapter_model.safetensors"
    tensors = load_file(file)
    name = next(n for n in sorted(tensors) if "v_proj.lora_B" in n)
    tensors[name][0, 0] = float("inf")
    save_file(tensors, file)
    _refused(path, name, "inf or NaN")
    tensors[name][0, 0] = float("nan")
    save_file(tensors, file)
    _refused(path, name, "inf or NaN")


def test_host_copy_in_the_pool_dtype(adapters, tmp_path):
    """The host copy is kept in the pool's dtype (rounded once, as a copy into the pool would);
    a value that overflows in it is refused like an inf in the file."""
    from safetensors.torch import load_file, save_file

    ref = load(adapters["qv"])
    half = LoRAAdapter.load("id", LoRAConfig.from_path(adapters["qv"], base_vocab_size=256), SHAPES, torch.bfloat16)
    for layer, ref_layer in zip(half.layers, ref.layers):
        assert sorted(layer) == sorted(ref_layer)
        for module, (a, b) in layer.items():
            assert a.dtype == b.dtype == torch.bfloat16
            assert torch.equal(a, ref_layer[module][0].to(torch.bfloat16))
            assert torch.equal(b, ref_layer[module][1].to(torch.bfloat16))
    path = copy_adapter(adapters["qv"], tmp_path)
    file = f"{path}/adapter_model.safetensors"
    tensors = load_file(file)
    name = next(n for n in sorted(tensors) if "q_proj.lora_A" in n)
    tensors[name][1, 2] = 1e6  # finite in float32, inf in float16
    save_file(tensors, file)
    assert load(path).layers  # float32: fine
    with pytest.raises(ValueError, match=f"{name}.*inf or NaN.*float16"):
        LoRAAdapter.load("id", LoRAConfig.from_path(path, base_vocab_size=256), SHAPES, torch.float16)


def test_tensor_outside_config_targets_refused(adapters, tmp_path):
    path = copy_adapter(adapters["qv"], tmp_path)
    edit_adapter_config(path, target_modules=["q_proj"])
    _refused(path, "v_proj", "target_modules")


def test_tensor_for_missing_layer_refused(adapters):
    shapes = LoRAModelShapes(num_layers=1, modules=SHAPES.modules)
    _refused(adapters["r4"], "layer 1", "1 layers", shapes=shapes)


# ---------------------------------------------------------------------- pool compatibility
def test_pool_refuses_rank_above_its_max_and_targets_outside(adapters):
    pool = LoRAMemoryPool(SHAPES, ["qkv_proj"], 3, 8, torch.float32, "cpu")
    assert pool.can_support(LoRAConfig.from_path(adapters["qv"]))
    msg = pool.incompatibility(LoRAConfig.from_path(adapters["r16"]))
    assert "rank 16" in msg and "--max-lora-rank" in msg
    msg = pool.incompatibility(LoRAConfig.from_path(adapters["r4"]))
    assert "--lora-target-modules" in msg and "down_proj" in msg and "o_proj" in msg
