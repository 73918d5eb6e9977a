"""Constrained decoding's glue, piece by piece (CPU, xgrammar and the tiny checkpoint's real
tokenizer): the bitmask unpacked and applied as xgrammar applies it, unconstrained rows untouched
bit for bit, the sampler under a mask, the xgrammar backend's matchers, the compile cache, the
sampling parameters, the OpenAI fields' mapping, and the tokenizer manager's door check."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
import torch

xgr = pytest.importorskip("xgrammar")  # CI installs it (the test extra); the GPU machine brings its wheel

from sglang.srt.constrained.backends import create_grammar_backend  # noqa: E402
from sglang.srt.constrained.base import GrammarError  # noqa: E402
from sglang.srt.constrained.cache import GrammarCache  # noqa: E402
from sglang.srt.constrained.xgrammar_backend import (  # noqa: E402
    JSON_MAX_WHITESPACE,
    bounded_strings_as_patterns,
    clean_error,
)
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from sglang.srt.entrypoints.openai.structured_outputs import requested_constraint  # noqa: E402
from sglang.srt.layers.sampler import Sampler  # noqa: E402
from sglang.srt.managers.generate_request import InvalidRequestError  # noqa: E402
from sglang.srt.managers.tokenizer_grammar import GrammarChecker  # noqa: E402
from sglang.srt.sampling.grammar_mask import GrammarMask, new_host_bitmask, unpack_bitmask  # noqa: E402
from sglang.srt.sampling.grammar_spec import ANY_JSON_OBJECT, GrammarSpec, choice_grammar  # noqa: E402
from sglang.srt.sampling.logit_adjustments import BiasEntries, LogitAdjustments  # noqa: E402
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from server_helpers import ROOT, tiny_checkpoint  # noqa: E402

VOCAB = 512


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def eos(tokenizer) -> list[int]:
    return [tokenizer.convert_tokens_to_ids("<|endoftext|>"), tokenizer.convert_tokens_to_ids("<|im_end|>")]


@pytest.fixture(scope="module")
def backend(tokenizer, eos):
    return create_grammar_backend("xgrammar", tokenizer, VOCAB, eos)


def allowed_ids(matcher, vocab: int = VOCAB) -> set[int]:
    mask = new_host_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(mask, 0)
    return set(torch.nonzero(unpack_bitmask(mask, vocab)[0]).flatten().tolist())


# ---------------------------------------------------------------------------- the mask
@pytest.mark.parametrize("vocab", [VOCAB, 77])
def test_mask_matches_xgrammars_apply_and_leaves_other_rows_bit_for_bit(vocab):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, vocab, generator=gen)
    rows = [1, 4, 5]
    host = torch.randint(-2**31, 2**31 - 1, (len(rows), (vocab + 31) // 32), generator=gen, dtype=torch.int32)
    out = GrammarMask.build(rows, host, "cpu").apply(logits, logits)
    want = logits.clone()
    full = torch.full((6, host.shape[1]), -1, dtype=torch.int32)
    full[rows] = host
    xgr.apply_token_bitmask_inplace(want, full, vocab_size=vocab, indices=rows)
    assert torch.equal(out, want)
    for r in (0, 2, 3):  # rows without a grammar: the same bits
        assert torch.equal(out[r].view(torch.int32), logits[r].view(torch.int32))
    assert torch.isneginf(out[rows]).any() and torch.isfinite(logits).all()  # it did mask, out of place


def test_mask_disallows_tokens_past_its_words():
    mask = torch.full((1, 1), -1, dtype=torch.int32)  # covers 32 tokens
    allowed = unpack_bitmask(mask, 40)
    assert allowed[0, :32].all() and not allowed[0, 32:].any()


def test_a_row_the_adjustments_leave_empty_takes_the_grammar_alone():
    """min_new_tokens bans EOS with -inf; a complete grammar allows only EOS: the grammar wins."""
    raw = torch.tensor([[0.5, 2.0, -1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    adjusted = raw.clone()
    adjusted[0, 2] = float("-inf")  # held back
    host = torch.tensor([[0b0100]], dtype=torch.int32)  # only token 2 allowed
    out = GrammarMask.build([0], host, "cpu").apply(adjusted, raw)
    assert out[0].tolist() == [float("-inf"), float("-inf"), -1.0, float("-inf")]
    assert torch.equal(out[1], raw[1])


def test_sampler_under_a_mask_never_leaves_it_and_unconstrained_rows_are_unchanged():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 64, generator=gen) * 3
    host = new_host_bitmask(2, 64)
    host.zero_()
    host[0, 0] = 0b1011 << 8  # tokens 8, 9, 11
    host[1, 1] = 1 << 5  # token 37
    mask_rows = [0, 2]

    def info(grammar):
        return SamplingBatchInfo.from_params(
            temperatures=[0.0, 1.0, 0.9, 1.2], top_ps=[1.0, 0.9, 1.0, 1.0], top_ks=[-1, 20, 5, -1],
            min_ps=[0.0, 0.0, 0.0, 0.1], seeds=[None, 7, 8, 9], steps=[0, 3, 4, 5], device="cpu",
            # +5 on (row 1, token 10), -5 on (row 3, token 11)
            adjustments=LogitAdjustments(bias=BiasEntries(index=torch.tensor([1 * 64 + 10, 3 * 64 + 11]),
                                                          values=torch.tensor([5.0, -5.0]), vocab_size=64)),
            grammar=grammar,
        )

    sampler = Sampler()
    plain = sampler(logits, info(None), return_logprob=True)
    for step in range(20):
        out = sampler(logits, info(GrammarMask.build(mask_rows, host, "cpu")), return_logprob=True)
        assert out.next_token_ids[0].item() in (8, 9, 11)
        assert out.next_token_ids[2].item() == 37
        # Seeded rows without a grammar draw exactly what they draw without the others' masks.
        assert out.next_token_ids[1] == plain.next_token_ids[1] and out.next_token_ids[3] == plain.next_token_ids[3]
        # The reported logprobs stay the model's (the mask changes the choice only).
        lp = torch.log_softmax(logits, dim=-1).gather(1, out.next_token_ids.unsqueeze(1)).squeeze(1)
        assert torch.equal(out.logprobs, lp)
    greedy = sampler(logits, SamplingBatchInfo.from_params(
        temperatures=[0.0] * 4, top_ps=[1.0] * 4, top_ks=[-1] * 4, min_ps=[0.0] * 4, seeds=[None] * 4,
        steps=[0] * 4, device="cpu", grammar=GrammarMask.build(mask_rows, host, "cpu")))
    assert greedy.next_token_ids[0].item() == max((8, 9, 11), key=lambda t: logits[0, t].item())
    assert greedy.next_token_ids[1] == logits[1].argmax() and greedy.next_token_ids[3] == logits[3].argmax()


# ---------------------------------------------------------------------------- the backend
def test_matcher_follows_a_regex_and_ends_on_eos(backend, tokenizer, eos):
    m = backend.matcher(backend.compile(GrammarSpec("regex", "(cat|dog) [0-9]{2}")))
    first = allowed_ids(m)
    assert first and all(tokenizer.decode([t])[0] in "cd" for t in first)
    assert not set(eos) & first
    for t in tokenizer.encode("dog 42", add_special_tokens=False):
        assert t in allowed_ids(m)
        assert m.accept_token(t)
    assert allowed_ids(m) == set(eos)  # complete: only a stop token
    assert not m.is_terminated() and not m.accept_token(tokenizer.encode("7", add_special_tokens=False)[0])
    assert m.accept_token(eos[1]) and m.is_terminated()


def test_json_schema_bounds_white_space(backend, tokenizer):
    m = backend.matcher(backend.compile(GrammarSpec("json_schema", ANY_JSON_OBJECT)))
    assert m.accept_token(tokenizer.encode("{", add_special_tokens=False)[0])
    space = tokenizer.encode(" ", add_special_tokens=False)
    assert len(space) == 1
    accepted = 0
    while accepted <= JSON_MAX_WHITESPACE and m.accept_token(space[0]):
        accepted += 1
    assert accepted == JSON_MAX_WHITESPACE


def test_bounded_strings_keep_their_bounds_and_json_validity(backend):
    """xgrammar 0.2.8 lets raw control characters into minLength/maxLength strings (its issue
    #800); the backend compiles those bounds as patterns, which keep them out."""
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 2, "maxLength": 5},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}},
        "code": {"type": "string", "pattern": "[A-Z]+", "maxLength": 4}}, "required": ["name", "tags"]}
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps(schema)))

    def accepts(text: str) -> bool:
        m = xgr.GrammarMatcher(compiled)
        return m.accept_string(text) and m.is_completed()

    assert accepts('{"name": "ab", "tags": ["xyz"]}') and accepts('{"name": "abcde", "tags": [], "code": "AB"}')
    # Raw control characters (invalid JSON), and strings too short or too long.
    for bad in ('{"name": "a\x18b", "tags": []}', '{"name": "ab", "tags": ["a\tb"]}', '{"name": "a", "tags": []}',
                '{"name": "abcdef", "tags": []}', '{"name": "ab", "tags": ["abcd"]}'):
        assert not accepts(bad), bad
    raw = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(backend.tokenizer, vocab_size=VOCAB))
    m = xgr.GrammarMatcher(raw.compile_json_schema(json.dumps(schema)))
    assert m.accept_string('{"name": "a\x18b", "tags": []}')  # what xgrammar alone accepts: the bug worked around
    untouched = {"type": "string", "pattern": "[a-z]+", "maxLength": 3}
    assert bounded_strings_as_patterns(untouched) == untouched
    assert bounded_strings_as_patterns({"anyOf": [{"type": "string", "minLength": 1}, {"type": "integer"}]}) == \
        {"anyOf": [{"type": "string", "pattern": "[\\s\\S]{1,}"}, {"type": "integer"}]}


def test_a_structural_tags_json_schemas_get_what_a_json_schema_gets(backend, tokenizer):
    """Inside a structural tag too, JSON white space is bounded and minLength / maxLength strings
    keep raw control characters out; a user's own max_whitespace_cnt is kept."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}}}

    def tag(**node) -> GrammarSpec:
        fmt = {"type": "tag", "begin": "<x>", "content": {"type": "json_schema", "json_schema": schema, **node},
               "end": "</x>"}
        return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}))

    def accepts(spec: GrammarSpec, text: str) -> bool:
        m = xgr.GrammarMatcher(backend.compile(spec))
        return m.accept_string(text) and m.is_completed()

    assert accepts(tag(), '<x>{"name": "ab"}</x>')
    assert not accepts(tag(), '<x>{"name": "a\tb"}</x>')
    assert accepts(tag(), "<x>{" + " " * JSON_MAX_WHITESPACE + "}</x>")
    assert not accepts(tag(), "<x>{" + " " * (JSON_MAX_WHITESPACE + 1) + "}</x>")
    assert not accepts(tag(max_whitespace_cnt=2), "<x>{   }</x>")


def test_the_older_structural_tag_form_holds_each_structure_to_its_schema(backend):
    """SGLang's / vLLM's `structures` + `triggers` (grammar_spec.legacy_structural_tag): free text,
    then at a trigger one of the structures, its JSON held to that structure's schema; free text
    again after its end; the same from the sampling parameters of /generate."""
    params = SamplingParams(max_new_tokens=8, structural_tag=json.dumps(LEGACY_TAG))
    params.verify(VOCAB)
    assert json.loads(params.structural_tag) == LEGACY_AS_NEW
    compiled = backend.compile(params.grammar)

    def accepts(text: str) -> bool:
        return xgr.GrammarMatcher(compiled).accept_string(text)

    assert accepts('Let me check. <f=a>{"a": 3}</f> and <f=b>"x"</f> done')
    assert accepts("no call at all")
    assert not accepts('<f=a>{"a": "three"}</f>')  # a's schema wants an integer
    assert not accepts("<f=b>3</f>")  # b's wants a string
    assert not accepts("<f=c>{}</f>")  # after the trigger, only a structure's begin
    anything = SamplingParams(structural_tag={"structures": [{"begin": "<j>", "end": "</j>"}], "triggers": ["<j>"]})
    anything.verify(VOCAB)
    matcher = xgr.GrammarMatcher(backend.compile(anything.grammar))
    assert matcher.accept_string('a <j>[1, "x", null]</j> b')  # no schema: any JSON value
    with pytest.raises(ValueError, match=r"structural_tag.structures\[0\]: begin \(non-empty\) and end"):
        SamplingParams(structural_tag={"structures": [{"begin": 1, "schema": {}, "end": ""}],
                                       "triggers": ["<"]}).verify(VOCAB)


@pytest.mark.parametrize("spec, fragment", [
    (GrammarSpec("regex", "[a-"), "Unclosed '['"),
    (GrammarSpec("json_schema", '{"type":'), "Failed to parse JSON"),
    (GrammarSpec("json_schema", '{"type": "foo"}'), 'Unsupported type "foo"'),
    (GrammarSpec("ebnf", 'root ::= "a" |'), "EBNF parser error"),
    (GrammarSpec("ebnf", 'other ::= "a"'), 'root rule with name "root" is not found'),
    (GrammarSpec("structural_tag", "{}"), "Structural tag must have a format field"),
    (GrammarSpec("structural_tag", "[1"), "Failed to parse JSON"),
    (GrammarSpec("structural_tag", '{"type": "structural_tag", "format": {"type": "foo"}}'),
     "Format type not recognized: foo"),
    (GrammarSpec("structural_tag", '{"type": "structural_tag", "format": {"type": "json_schema", "json_schema": '
                                   '{"type": "foo"}}}'), 'Unsupported type "foo"'),
])
def test_bad_specs_raise_grammar_errors_without_log_prefixes(backend, spec, fragment):
    with pytest.raises(GrammarError) as e:
        backend.compile(spec)
    assert fragment in str(e.value)
    assert not str(e.value).startswith("[") and ".cc:" not in str(e.value)


def test_clean_error_strips_xgrammars_prefixes():
    e = RuntimeError("[11:50:45] /project/cpp/json_schema_converter.cc:4939: Check failed: (error.empty()) is "
                     "false: Failed to parse JSON: syntax error\n")
    assert clean_error(e) == "Failed to parse JSON: syntax error"
    e = RuntimeError("[19:48:10] /project/cpp/grammar_compiler.cc:1207: Check failed: (std::holds_alternative<Grammar>"
                     "(result)) is false: Invalid structural tag error: Structural tag must have a format field\n")
    assert clean_error(e) == "Structural tag must have a format field"


@pytest.mark.parametrize("choices", [["yes", "no"], ['say "hi"', "a\\b\nc\t\x01", "ünï", ""]])
def test_choice_grammar_accepts_exactly_the_choices(backend, tokenizer, choices):
    compiled = backend.compile(GrammarSpec("ebnf", choice_grammar(choices)))
    for c in choices:
        m = xgr.GrammarMatcher(compiled)
        assert m.accept_string(c) and m.is_completed(), c
    m = xgr.GrammarMatcher(compiled)
    assert not (m.accept_string(choices[0] + "x") and m.is_completed())


def test_choice_grammar_refuses_what_is_not_a_list_of_strings():
    for bad in ([], "yes", ["a", 5], None):
        with pytest.raises(ValueError, match="non-empty list of strings"):
            choice_grammar(bad)


# ---------------------------------------------------------------------------- the cache
def test_cache_is_lru_within_its_bytes_and_keeps_refusals():
    cache = GrammarCache(size_of=lambda compiled: compiled, max_bytes=100)
    a, b, c = (GrammarSpec("regex", x) for x in ("a", "b", "c"))
    cache.put(a, 40)
    cache.put(b, 40)
    assert cache.get(a) == 40  # a is now the most recent
    cache.put(c, 40)  # 123 bytes > 100: the least recently used (b) goes
    assert b not in cache and a in cache and c in cache and cache.total_bytes == 82
    cache.put(GrammarSpec("regex", "big"), 500)  # larger than the whole cache: not kept
    assert len(cache) == 2
    err = GrammarError("bad")
    cache.put(b, err)
    assert cache.get(b) is err and cache.total_bytes == 86  # a refusal costs its spec and message
    assert cache.info()["hits"] == 2


# ---------------------------------------------------------------------------- parameters
def test_sampling_params_take_one_constraint():
    p = SamplingParams.from_dict({"json_schema": {"type": "object", "properties": {"é": {"type": "string"}}}})
    assert p.grammar == GrammarSpec("json_schema", '{"type": "object", "properties": {"é": {"type": "string"}}}')
    assert SamplingParams.from_dict({"regex": "a+"}).grammar == GrammarSpec("regex", "a+")
    assert SamplingParams.from_dict({}).grammar is None
    with pytest.raises(ValueError, match="ebnf: only one of regex, json_schema, ebnf and structural_tag"):
        SamplingParams.from_dict({"regex": "a", "ebnf": 'root ::= "a"'})
    with pytest.raises(ValueError, match="regex must be a string"):
        SamplingParams.from_dict({"regex": 5})
    # A structural tag (xgrammar's JSON) is a constraint like the others: JSON text, or an object.
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "é"}}
    assert SamplingParams.from_dict({"structural_tag": tag}).grammar == GrammarSpec("structural_tag", json.dumps(
        tag, ensure_ascii=False))
    with pytest.raises(ValueError, match="structural_tag: only one of"):
        SamplingParams.from_dict({"regex": "a", "structural_tag": "{}"})
    with pytest.raises(ValueError, match="structural_tag must be a JSON string or an object"):
        SamplingParams.from_dict({"structural_tag": 5})


def _chat(**extra) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **extra)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
# A structural tag in xgrammar's form, and in SGLang's / vLLM's older one with what it becomes.
NEW_TAG = {"type": "structural_tag", "format": {"type": "const_string", "value": "ok"}}
LEGACY_TAG = {"structures": [{"begin": "<f=a>", "schema": SCHEMA, "end": "</f>"},
                             {"begin": "<f=b>", "schema": json.dumps({"type": "string"}), "end": "</f>"}],
              "triggers": ["<f="]}
LEGACY_AS_NEW = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f="], "tags": [
    {"type": "tag", "begin": "<f=a>", "content": {"type": "json_schema", "json_schema": SCHEMA}, "end": "</f>"},
    {"type": "tag", "begin": "<f=b>", "content": {"type": "json_schema", "json_schema": {"type": "string"}},
     "end": "</f>"}]}}


@pytest.mark.parametrize("extra, kind, value, field", [
    ({"response_format": {"type": "json_object"}}, "json_schema", ANY_JSON_OBJECT, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     "json_schema", json.dumps(SCHEMA), "response_format"),
    ({"regex": "[0-9]+"}, "regex", "[0-9]+", "regex"),
    ({"json_schema": json.dumps(SCHEMA)}, "json_schema", json.dumps(SCHEMA), "json_schema"),
    ({"ebnf": 'root ::= "a"'}, "ebnf", 'root ::= "a"', "ebnf"),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"}, "json_schema", json.dumps(SCHEMA), "guided_json"),
    ({"guided_regex": "a|b"}, "regex", "a|b", "guided_regex"),
    ({"guided_choice": ["x", "y"]}, "ebnf", choice_grammar(["x", "y"]), "guided_choice"),
    ({"guided_grammar": 'root ::= "a"'}, "ebnf", 'root ::= "a"', "guided_grammar"),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema", json.dumps(SCHEMA), "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}}, "regex", "a", "structured_outputs"),
    ({"structured_outputs": {"choice": ["p", "q"], "disable_any_whitespace": False}}, "ebnf",
     choice_grammar(["p", "q"]), "structured_outputs"),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "ebnf", 'root ::= "a"', "structured_outputs"),
    ({"structured_outputs": {"json_object": True}}, "json_schema", ANY_JSON_OBJECT, "structured_outputs"),
    ({"response_format": NEW_TAG}, "structural_tag", json.dumps(NEW_TAG), "response_format"),
    ({"response_format": {"type": "structural_tag", **LEGACY_TAG}}, "structural_tag", json.dumps(LEGACY_AS_NEW),
     "response_format"),
    ({"structural_tag": json.dumps(LEGACY_TAG)}, "structural_tag", json.dumps(LEGACY_AS_NEW), "structural_tag"),
    ({"structural_tag": NEW_TAG}, "structural_tag", json.dumps(NEW_TAG), "structural_tag"),
    ({"structured_outputs": {"structural_tag": json.dumps(LEGACY_TAG)}}, "structural_tag", json.dumps(LEGACY_AS_NEW),
     "structured_outputs"),
])
def test_openai_fields_map_to_one_native_constraint(extra, kind, value, field):
    for req in (_chat(**extra), CompletionRequest(model="m", prompt="hi", **extra)):
        c = requested_constraint(req, "xgrammar")
        assert (c.spec, c.field) == (GrammarSpec(kind, value), field)


def test_openai_requests_without_a_constraint():
    assert requested_constraint(_chat(), "xgrammar") is None
    assert requested_constraint(_chat(response_format={"type": "text"}, guided_decoding_backend="auto"), "none") is None


@pytest.mark.parametrize("extra, param, fragment", [
    ({"regex": "a", "guided_json": SCHEMA}, "guided_json", "only one structured-output constraint"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice", "only one"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "schema must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": "yes"}}},
     "response_format", "strict must be a boolean"),
    ({"response_format": {"type": "yaml"}}, "response_format", "must be 'text', 'json_object', 'json_schema' or "
                                                                 "'structural_tag'"),
    ({"response_format": {"type": "structural_tag", "structures": [], "triggers": ["<"]}}, "response_format",
     "response_format.structures must be a non-empty list"),
    ({"response_format": {"type": "structural_tag", "structures": [{"begin": "<a>", "schema": {}}],
                          "triggers": ["<"]}}, "response_format",
     "response_format.structures[0] must be an object of begin, end and (optionally) schema"),
    ({"structural_tag": {**LEGACY_TAG, "triggers": "<f="}}, "structural_tag",
     "structural_tag.triggers must be a non-empty list"),
    ({"structured_outputs": {"structural_tag": {**LEGACY_TAG, "format": {}}}}, "structured_outputs.structural_tag",
     "takes only type 'structural_tag', structures and triggers, got ['format']"),
    ({"structural_tag": {"structures": [{"begin": "<a>", "schema": "{nope", "end": ""}], "triggers": ["<"]}},
     "structural_tag", "structural_tag.structures[0].schema is not valid JSON"),
    ({"response_format": "json"}, "response_format", "must be an object"),
    ({"guided_choice": []}, "guided_choice", "non-empty list of strings"),
    ({"guided_choice": ["a", 1]}, "guided_choice", "non-empty list of strings"),
    ({"guided_regex": 5}, "guided_regex", "must be a string"),
    ({"guided_json": [1]}, "guided_json", "must be a JSON schema"),
    ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern", "not supported"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend", "runs only xgrammar"),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs", "json and regex"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}}, "structured_outputs",
     "disable_any_whitespace is not supported"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs",
     "whitespace_pattern is not supported"),
    ({"structured_outputs": {"yaml": "a"}}, "structured_outputs", "unknown option(s) ['yaml']"),
    ({"structured_outputs": {"regex": "a", "structural_tag": "{}"}}, "structured_outputs", "regex and structural_tag"),
    ({"structured_outputs": 5}, "structured_outputs", "must be an object"),
])
def test_openai_constraint_errors_name_the_field(extra, param, fragment):
    with pytest.raises(InvalidRequestError) as e:
        requested_constraint(_chat(**extra), "xgrammar")
    assert e.value.param == param and fragment in e.value.message


def test_guided_decoding_backend_on_a_server_without_one():
    with pytest.raises(InvalidRequestError, match="runs no grammar backend"):
        requested_constraint(_chat(guided_decoding_backend="xgrammar"), "none")


# ---------------------------------------------------------------------------- the door check
def test_door_check_compiles_once_per_spec_and_names_the_field(tokenizer, eos):
    checker = GrammarChecker("xgrammar", tokenizer, VOCAB, eos)

    async def run() -> None:
        good = GrammarSpec("regex", "[a-z]+")
        await asyncio.gather(*(checker.check(good, "regex") for _ in range(4)))
        with pytest.raises(InvalidRequestError) as e:
            await checker.check(GrammarSpec("json_schema", '{"type": "foo"}'), "response_format")
        assert e.value.param == "response_format" and e.value.status_code == 400
        assert e.value.message.startswith("Invalid JSON schema in 'response_format': Unsupported type")
        with pytest.raises(InvalidRequestError):  # the refusal is remembered, not compiled again
            await checker.check(GrammarSpec("json_schema", '{"type": "foo"}'), "guided_json")

    asyncio.run(run())
    assert len(checker.cache) == 2 and checker.cache.info()["hits"] >= 1


@pytest.mark.parametrize("backend_name, tok, fragment", [
    ("none", True, "--grammar-backend xgrammar"), ("xgrammar", False, "--skip-tokenizer-init")])
def test_door_check_refuses_where_nothing_can_constrain(tokenizer, eos, backend_name, tok, fragment):
    checker = GrammarChecker(backend_name, tokenizer if tok else None, VOCAB, eos)
    with pytest.raises(InvalidRequestError, match=fragment) as e:
        asyncio.run(checker.check(GrammarSpec("regex", "a"), "guided_regex"))
    assert e.value.param == "guided_regex"


# ---------------------------------------------------------------------------- without xgrammar
PROBE = """
import sys
sys.modules['xgrammar'] = None  # what an import of a missing package finds: nothing
from sglang.srt.server_args import ServerArgs
import sglang.srt.entrypoints.http_server, sglang.srt.entrypoints.engine
import sglang.srt.managers.scheduler, sglang.srt.managers.tokenizer_manager
assert ServerArgs().grammar_backend == 'none', ServerArgs().grammar_backend
try:
    ServerArgs(grammar_backend='xgrammar')
except ValueError as e:
    print('REFUSED', e)
"""


def test_the_engine_imports_and_starts_its_args_without_xgrammar():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": f"{ROOT}/python"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "REFUSED --grammar-backend xgrammar: the xgrammar package is not installed" in out.stdout
    assert "pip install xgrammar" in out.stdout


def test_importing_the_engine_does_not_import_xgrammar():
    code = ("import sys, sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler; "
            "print('xgrammar' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": f"{ROOT}/python"})
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]
