"""The built-in demo (tools/demo.py): deterministic files, atomic materialisation, valid PEFT
adapters that really change the model."""

from __future__ import annotations

import hashlib
import io
import json
import os

import pytest
import torch

from server_helpers import cache_dir_for_tests
from sglang.srt.tools import demo as demo_mod


def digest(folder: str) -> dict[str, str]:
    return {name: hashlib.sha256(open(os.path.join(folder, name), "rb").read()).hexdigest()
            for name in sorted(os.listdir(folder))}


@pytest.fixture(scope="module")
def demo() -> demo_mod.DemoModel:
    return demo_mod.ensure_demo_model(cache_dir_for_tests())


def test_demo_is_materialised_once_and_reused(demo) -> None:
    assert os.path.isfile(os.path.join(demo.model_path, "config.json"))
    assert os.path.isfile(os.path.join(demo.model_path, "tokenizer.json"))
    assert set(demo.adapters) == {s.name for s in demo_mod.DEMO_ADAPTERS}
    stamp = os.path.getmtime(os.path.join(demo.model_path, "model.safetensors"))
    again = demo_mod.ensure_demo_model(cache_dir_for_tests())
    assert again == demo
    assert os.path.getmtime(os.path.join(demo.model_path, "model.safetensors")) == stamp


def test_adapters_are_deterministic(demo, tmp_path) -> None:
    with open(os.path.join(demo.model_path, "config.json")) as f:
        config = json.load(f)
    for spec in demo_mod.DEMO_ADAPTERS:
        out = tmp_path / spec.name
        out.mkdir()
        demo_mod.write_peft_adapter(str(out), config, spec)
        cached = {k: v for k, v in digest(demo.adapters[spec.name]).items() if k != demo_mod.COMPLETE_MARKER}
        assert digest(str(out)) == cached


def test_adapters_load_in_peft_and_change_the_output(demo) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[5, 17, 42, 99, 7, 300]])
    base = AutoModelForCausalLM.from_pretrained(demo.model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = base(ids).logits.log_softmax(-1)
    for spec in demo_mod.DEMO_ADAPTERS:
        cfg = json.load(open(os.path.join(demo.adapters[spec.name], "adapter_config.json")))
        assert cfg["r"] == spec.rank and sorted(cfg["target_modules"]) == sorted(spec.target_modules)
        model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(demo.model_path, dtype=torch.float32), demo.adapters[spec.name]
        ).eval()
        with torch.no_grad():
            got = model(ids).logits.log_softmax(-1)
        assert (got - ref).abs().max() > 5e-2, spec.name  # a real delta, not PEFT's zero init


def test_interrupted_build_leaves_nothing_behind(tmp_path) -> None:
    target = tmp_path / "thing"

    def fail(tmp: str) -> None:
        open(os.path.join(tmp, "half"), "w").close()
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        demo_mod.materialize_once(str(target), fail)
    assert not target.exists() and os.listdir(tmp_path) == []
    target.mkdir()  # an incomplete leftover (no marker) is rebuilt
    demo_mod.materialize_once(str(target), lambda tmp: open(os.path.join(tmp, "ok"), "w").close())
    assert sorted(os.listdir(target)) == sorted(["ok", demo_mod.COMPLETE_MARKER])


def test_banner_and_lora_paths(demo) -> None:
    buf = io.StringIO()
    demo_mod.print_demo_banner(cache_dir_for_tests(), file=buf)
    text = buf.getvalue()
    assert "RANDOM weights" in text and "--model-path" in text
    # The adapters resolve_model serves: every demo adapter, each in its folder.
    assert list(demo.adapters) == [s.name for s in demo_mod.DEMO_ADAPTERS]
    assert all(os.path.isdir(path) for path in demo.adapters.values())
