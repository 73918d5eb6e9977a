"""Penalties, logit_bias and min_new_tokens through the whole engine (`sglang.Engine`: tokenizer
manager, scheduler process, sampler) against Hugging Face `generate` with its own logits
processors, greedy, float32 on the CPU. Each request is checked alone in a mixed batch, with the
ordinary schedule and with the overlap schedule (where a decode step's input token is still on the
device when the next step's penalties are built)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import hf_model
from server_helpers import cache_dir_for_tests, tiny_checkpoint

MAX_NEW = 16
PROMPTS = (
    "The engine reads a prompt, splits it into tokens, and runs the model",
    "Mira walked to the harbour and",
    "Adapters are small sets of extra weights",
    "Numbers: one, two,",
    # Where -2 / -2 penalties make this checkpoint repeat its last token: a step that missed the
    # token just sampled (the overlap schedule's, still on the device) would choose differently.
    "are been was call said so",
)


class OpenAIPenalties:
    """OpenAI's frequency and presence penalties as an HF logits processor (the reference): over
    the generated tokens only, mu[j] - c[j] * frequency - (c[j] > 0) * presence."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores)
        generated = input_ids[:, self.prompt_len:]
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


@pytest.fixture(scope="module")
def ckpt() -> str:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def hf(ckpt):
    return hf_model(ckpt)


@pytest.fixture(scope="module")
def prompts(ckpt) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    return [tok(p).input_ids for p in PROMPTS]


# On the GPU: CUDA graphs and the overlap schedule, as a CUDA server runs by default (the
# adjustments run in the eager tail after the graph replay).
SETUPS = {"ordinary": dict(device="cpu", enable_overlap_schedule=False),
          "overlap": dict(device="cpu", enable_overlap_schedule=True),
          "cuda": dict(device="cuda")}


@pytest.fixture(scope="module", params=["ordinary", "overlap", pytest.param("cuda", marks=pytest.mark.gpu)])
def engine(request, ckpt):
    from sglang import Engine

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SGLANG_CACHE_DIR", cache_dir_for_tests())
        eng = Engine(model_path=ckpt, dtype="float32", random_seed=0, **SETUPS[request.param])
    yield eng
    eng.shutdown()


def hf_generate(hf, prompt: list[int], **kwargs) -> list[int]:
    gen = copy.deepcopy(hf.generation_config)
    processors = kwargs.pop("logits_processor", None)
    gen.update(do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0, **kwargs)
    from transformers import LogitsProcessorList

    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          generation_config=gen, logits_processor=LogitsProcessorList(processors or []))
    return out[0, len(prompt):].tolist()


def cases(hf, prompts: list[list[int]]) -> list[tuple[list[int], dict, list[int]]]:
    """(prompt, our sampling params, HF's tokens) for each feature, and a plain request beside them."""
    eos = hf.generation_config.eos_token_id
    eos = eos if isinstance(eos, int) else eos[0]
    plain = [hf_generate(hf, p) for p in prompts]
    favourite = plain[2][0]  # what the third prompt starts with: its bias must show
    out = [
        (prompts[2], {"repetition_penalty": 1.8}, hf_generate(hf, prompts[2], repetition_penalty=1.8)),
        (prompts[4], {"frequency_penalty": -2.0, "presence_penalty": -2.0},
         hf_generate(hf, prompts[4], logits_processor=[OpenAIPenalties(len(prompts[4]), -2.0, -2.0)])),
        (prompts[2], {"logit_bias": {str(favourite): -100}},
         hf_generate(hf, prompts[2], sequence_bias={(favourite,): -100.0})),
        # EOS made likely, then held back for 6 tokens: the request stops on EOS right after them.
        (prompts[3], {"min_new_tokens": 6, "logit_bias": {str(eos): 30}},
         hf_generate(hf, prompts[3], min_new_tokens=6, sequence_bias={(eos,): 30.0})),
        (prompts[3], {"repetition_penalty": 0.7, "frequency_penalty": 1.0, "presence_penalty": -1.0},
         hf_generate(hf, prompts[3], repetition_penalty=0.7,
                     logits_processor=[OpenAIPenalties(len(prompts[3]), 1.0, -1.0)])),
        (prompts[1], {}, plain[1]),
    ]
    # Every feature changes this checkpoint's greedy output, so a no-op could not pass.
    for prompt, params, want in out[:5]:
        assert want != plain[prompts.index(prompt)], params
    assert out[3][2] == out[3][2][:6] + [eos] and eos not in out[3][2][:6]
    return out


def test_each_request_equals_hf_generate_with_its_processors(engine, hf, prompts) -> None:
    want = cases(hf, prompts)
    params = [{"max_new_tokens": MAX_NEW, "temperature": 0.0, **p} for _, p, _ in want]
    outs = engine.generate(input_ids=[p for p, _, _ in want], sampling_params=params)
    for (_, p, ref), out in zip(want, outs):
        assert out["output_ids"] == ref, p
    # Alone (other batch rows, other table rows) the same.
    alone = engine.generate(input_ids=want[1][0], sampling_params=params[1])
    assert alone["output_ids"] == want[1][2]


def test_min_new_tokens_holds_back_stop_strings_and_stop_ids(engine, prompts) -> None:
    base = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    free = engine.generate(input_ids=prompts[1], sampling_params=base)["output_ids"]
    stop_id = free[1]
    early = engine.generate(input_ids=prompts[1], sampling_params={**base, "stop_token_ids": [stop_id]})
    assert early["output_ids"] == free[:2] and early["meta_info"]["finish_reason"]["matched"] == stop_id
    held = engine.generate(input_ids=prompts[1], sampling_params={**base, "stop_token_ids": [stop_id],
                                                                  "min_new_tokens": 4})
    assert len(held["output_ids"]) >= 4 and stop_id not in held["output_ids"][:4]


def test_min_new_tokens_and_stop_strings(engine, ckpt, prompts) -> None:
    """A stop string within the text of the first min_new_tokens tokens does not count (it is
    neither matched nor cut); a later one does, streamed or not (vLLM's semantics)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    base = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    checked = 0
    for prompt in prompts:
        free = engine.generate(input_ids=prompt, sampling_params=base)
        ids, text = free["output_ids"], free["text"]
        for k in range(1, 6):  # a stop string that the k-th token's text completes
            piece = tok.decode(ids[:k])[-2:]
            if len(piece.strip()) < 2 or piece not in text:
                continue
            cut = text.find(piece)
            early = engine.generate(input_ids=prompt, sampling_params={**base, "stop": [piece]})
            assert early["text"] == text[:cut] and early["meta_info"]["finish_reason"]["matched"] == piece
            params = {**base, "stop": [piece], "min_new_tokens": 8}
            held = engine.generate(input_ids=prompt, sampling_params=params)
            protected = len(tok.decode(ids[:8]))
            later = text.find(piece, max(0, protected - len(piece) + 1))
            assert held["text"] == (text if later == -1 else text[:later]), (piece, held)
            assert len(held["output_ids"]) >= 8 and held["output_ids"] == ids[:len(held["output_ids"])]
            streamed = list(engine.generate(input_ids=prompt, sampling_params=params, stream=True))
            assert streamed[-1]["text"] == held["text"]
            assert all(held["text"].startswith(c["text"]) for c in streamed)
            checked += 1
            break
    assert checked >= 2
