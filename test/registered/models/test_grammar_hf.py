"""Constrained decoding through the whole engine (`sglang.Engine`: door check, scheduler, grammar
masks in the sampling tail) against a reference built from Hugging Face's logits: at every step
xgrammar's own mask (`fill_next_token_bitmask`, `apply_token_bitmask_inplace`) on the HF model's
next-token logits, greedy, the token accepted, until the grammar accepts its stop token. Float32 on
the CPU with the ordinary schedule and with the overlap schedule; on a GPU with CUDA graphs and the
overlap schedule (gpu-marked). (Retraction under KV pressure: unit/test_scheduler_grammar.py and
openai_server/test_structured_outputs.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from helpers import hf_model
from server_helpers import cache_dir_for_tests, tiny_checkpoint

xgr = pytest.importorskip("xgrammar")

from sglang.srt.constrained.xgrammar_backend import JSON_MAX_WHITESPACE  # noqa: E402
from sglang.srt.sampling.grammar_spec import choice_grammar  # noqa: E402

MAX_NEW = 40
PROMPTS = (
    "The engine reads a prompt, splits it into tokens, and runs the model",
    "Mira walked to the harbour and",
    "Adapters are small sets of extra weights",
    "Numbers: one, two,",
    "are been was call said so",
)
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}}, "required": ["id", "ok"]}
# (prompt index, sampling parameters beyond greedy MAX_NEW); every constraint kind, and a plain row.
REQUESTS = (
    (0, {"regex": "(yes|no), [0-9]{2,4}[.!]"}),
    (1, {"json_schema": json.dumps(SCHEMA), "max_new_tokens": 100}),
    (2, {"ebnf": 'root ::= "The " item " is " ("big" | "small") "."\nitem ::= [a-z] [a-z]? [a-z]? [a-z]?'}),
    (3, {"ebnf": choice_grammar(["north", "south", "east by south-east"])}),
    (4, {}),
    (2, {"json_schema": '{"type": "object"}'}),
    (3, {"regex": "[a-z ]+", "max_new_tokens": 12}),  # ends by length
    # A complete grammar allows only EOS; min_new_tokens holds it back: the grammar wins.
    (1, {"regex": "[0-9]{3}", "min_new_tokens": 8}),
    # ignore_eos does not keep a finished grammar going.
    (0, {"regex": "[a-z]{2,5}", "ignore_eos": True}),
    (1, {"regex": "[a-z ]+"}),
)

SETUPS = {"ordinary": dict(device="cpu", enable_overlap_schedule=False),
          "overlap": dict(device="cpu", enable_overlap_schedule=True),
          # CUDA graphs and the overlap schedule, as a CUDA server runs by default.
          "cuda": dict(device="cuda")}


@pytest.fixture(scope="module")
def ckpt() -> str:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def hf(ckpt):
    return hf_model(ckpt)


@pytest.fixture(scope="module")
def tokenizer(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt)


@pytest.fixture(scope="module", params=["ordinary", "overlap", pytest.param("cuda", marks=pytest.mark.gpu)])
def engine(request, ckpt):
    from sglang import Engine

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SGLANG_CACHE_DIR", cache_dir_for_tests())
        eng = Engine(model_path=ckpt, dtype="float32", random_seed=0, grammar_backend="xgrammar",
                     **SETUPS[request.param])
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def compiler(hf, tokenizer):
    eos = hf.generation_config.eos_token_id
    eos = sorted({*([eos] if isinstance(eos, int) else eos), tokenizer.eos_token_id})
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=hf.config.vocab_size, stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info)
    compiler.eos = set(eos)
    return compiler


def compile_spec(compiler, params: dict):
    if "regex" in params:
        return compiler.compile_regex(params["regex"])
    if "json_schema" in params:
        return compiler.compile_json_schema(params["json_schema"], max_whitespace_cnt=JSON_MAX_WHITESPACE)
    if "ebnf" in params:
        return compiler.compile_grammar(params["ebnf"])
    return None


@torch.no_grad()
def reference(hf, compiler, prompt: list[int], params: dict) -> tuple[list[int], str]:
    """Greedy over HF's logits under xgrammar's mask: (tokens, finish type)."""
    compiled = compile_spec(compiler, params)
    matcher = xgr.GrammarMatcher(compiled) if compiled is not None else None
    vocab = hf.config.vocab_size
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    eos = compiler.eos
    ids = list(prompt)
    out: list[int] = []
    for _ in range(params.get("max_new_tokens", MAX_NEW)):
        logits = hf(input_ids=torch.tensor([ids])).logits[0, -1:].float()
        if matcher is not None:
            matcher.fill_next_token_bitmask(bitmask, 0)
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab)
        token = int(logits.argmax())
        out.append(token)
        ids.append(token)
        if matcher is not None:
            assert matcher.accept_token(token)
            if matcher.is_terminated():
                return out, "stop"
        elif token in eos:
            return out, "stop"
    return out, "length"


def test_greedy_under_a_grammar_equals_hfs_logits_under_xgrammars_mask(engine, hf, compiler, tokenizer):
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    want = [reference(hf, compiler, prompts[i], p) for i, p in REQUESTS]
    params = [{"max_new_tokens": MAX_NEW, "temperature": 0.0, **p} for _, p in REQUESTS]
    outs = engine.generate(input_ids=[prompts[i] for i, _ in REQUESTS], sampling_params=params)
    for (i, p), (tokens, finish), out in zip(REQUESTS, want, outs):
        assert out["output_ids"] == tokens, (p, tokenizer.decode(tokens), out["text"])
        assert out["meta_info"]["finish_reason"]["type"] == finish, p
    # The grammars changed the greedy choice (else this would not test the masks).
    for (i, p), (tokens, _) in zip(REQUESTS, want):
        if p:
            assert tokens != reference(hf, compiler, prompts[i], {})[0][: len(tokens)], p
    # Constraints stop the requests as their grammars end, on EOS (the grammar's stop token).
    finishes = [out["meta_info"]["finish_reason"] for out in outs]
    assert [f["type"] for f in finishes] == ["stop"] * 4 + ["length", "stop", "length", "stop", "stop", "length"]
    assert all(finishes[k]["matched"] in compiler.eos for k in (0, 1, 2, 3, 5, 7, 8))
    assert json.loads(outs[1]["text"]).keys() == {"id", "ok"}
    assert outs[2]["text"].startswith("The ") and outs[2]["text"].endswith((" is big.", " is small."))
    assert outs[3]["text"] in ("north", "south", "east by south-east")
    assert isinstance(json.loads(outs[5]["text"]), dict)
    assert len(outs[7]["output_ids"]) == 4 and outs[7]["text"].isdigit()  # 3 digits, then EOS
    assert 2 <= len(outs[8]["text"]) <= 5
    info = engine.get_server_info()
    assert info["grammar_matchers"] == 0 and info["last_integrity_check"]["ok"], info["last_integrity_check"]


def test_a_constrained_request_alone_equals_it_in_the_batch(engine, hf, compiler, tokenizer):
    prompt = tokenizer(PROMPTS[1]).input_ids
    params = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "json_schema": json.dumps(SCHEMA)}
    alone = engine.generate(input_ids=prompt, sampling_params=params)
    assert alone["output_ids"] == reference(hf, compiler, prompt, params)[0]


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["cuda"], indirect=True)
def test_cuda_graphs_serve_constrained_steps_step_by_step(engine, hf, compiler, tokenizer):
    """On the GPU the masks follow graph replays (the eager tail), and a constrained request's steps
    are not overlapped while an unconstrained request's are."""
    prompt = tokenizer(PROMPTS[0]).input_ids
    params = {"max_new_tokens": 24, "temperature": 0.0, "regex": "[a-z ]+"}
    before = engine.get_server_info()
    out = engine.generate(input_ids=prompt, sampling_params=params)
    assert out["output_ids"] == reference(hf, compiler, prompt, params)[0]
    mid = engine.get_server_info()
    assert mid["graph_stats"]["decode_graph_replays"] >= before["graph_stats"]["decode_graph_replays"] + 20
    assert mid["overlapped_decode_steps"] == before["overlapped_decode_steps"]
    engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True})
    assert engine.get_server_info()["overlapped_decode_steps"] > mid["overlapped_decode_steps"]
