"""Structured outputs end to end: one real server (CPU, the tiny Llama checkpoint with its real
byte-level BPE tokenizer and a LoRA adapter, the overlap schedule on, a small KV cache) and the
official `openai` client. Regexes are matched in full, JSON parses and is validated against its
schema, choices are one of the choices, structural tags in both forms; streaming, n > 1, an
adapter under a constraint, a mixed batch whose unconstrained requests are bit-equal to the same
batch without the constraint, bad specs as 400s naming the field, an abort mid-grammar and retraction under KV pressure leaving no
state behind (both processes' integrity checks), and --skip-tokenizer-init refusing constraints."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests

from lora_server_testlib import tiny_lora_checkpoint, write_adapter
from reliability_lib import assert_no_leaks, server_info, wait_idle
from server_helpers import cache_dir_for_tests, kill_server, popen_launch_server, read_log

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

KV_TOKENS = 512
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
PROMPTS = ["The weather today is", "Once upon a time", "Numbers: one, two,", "Adapters are small sets of"]


# ---------------------------------------------------------------------------- a small JSON schema validator
def validate(value: Any, schema: dict, path: str = "$") -> None:
    """The subset of JSON Schema these tests use; AssertionError naming the first violation."""
    kinds = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    kind = schema.get("type")
    if kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), (path, value)
    elif kind == "number":
        assert isinstance(value, (int, float)) and not isinstance(value, bool), (path, value)
    elif kind is not None:
        assert isinstance(value, kinds[kind]), (path, kind, value)
    if "enum" in schema:
        assert value in schema["enum"], (path, value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), (path, value)
    if isinstance(value, str):
        assert schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)), (path, value)
    if isinstance(value, list):
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)), (path, value)
        for i, item in enumerate(value):
            validate(item, schema.get("items", {}), f"{path}[{i}]")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            assert key in value, (path, "missing", key)
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), (path, set(value) - set(props))
        for key, item in value.items():
            if key in props:
                validate(item, props[key], f"{path}.{key}")


def test_the_validator_catches_violations() -> None:
    validate({"name": "Ann", "age": 30, "role": "user", "tags": ["a"]}, PERSON)
    for bad in ({"name": "Ann", "age": 30}, {"name": "Ann", "age": 300, "role": "user"},
                {"name": "Ann", "age": 3, "role": "root"}, {"name": "Ann", "age": 3, "role": "user", "x": 1},
                {"name": "Ann", "age": True, "role": "user"}, {"name": "", "age": 3, "role": "user"}):
        with pytest.raises(AssertionError):
            validate(bad, PERSON)


# ---------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def ckpt() -> str:
    return tiny_lora_checkpoint("llama")


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    adapter = write_adapter(ckpt, str(tmp_path_factory.mktemp("adapters") / "ad"), r=8, seed=5, b_std=0.5)
    proc, url = popen_launch_server(ckpt, [
        "--device", "cpu", "--dtype", "float32", "--served-model-name", "m", "--lora-backend", "torch_native",
        "--lora-paths", f"ad={adapter}", "--enable-overlap-schedule", "--max-total-tokens", str(KV_TOKENS),
    ], env={"SGLANG_CACHE_DIR": cache_dir_for_tests()})
    yield proc, url
    assert kill_server(proc) == 0, read_log(proc)[-3000:]


@pytest.fixture(scope="module")
def url(server) -> str:
    return server[1]


@pytest.fixture(scope="module")
def client(url) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def generate(url: str, body: dict) -> Any:
    r = requests.post(f"{url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


# ---------------------------------------------------------------------------- the kinds
def test_regex_on_completions_and_chat(client) -> None:
    pattern = r"(red|green|blue) [0-9]{2,3}(, [a-z]{3,6})?\."
    for prompt in PROMPTS:
        c = client.completions.create(model="m", prompt=prompt, max_tokens=64, temperature=0,
                                      extra_body={"regex": pattern})
        assert re.fullmatch(pattern, c.choices[0].text), c.choices[0].text
        assert c.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Pick a colour"}],
                                          max_tokens=64, temperature=0.8, seed=3, extra_body={"guided_regex": pattern})
    assert re.fullmatch(pattern, chat.choices[0].message.content)
    assert chat.choices[0].finish_reason == "stop"


def test_json_schema_response_format_parses_and_validates(client) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for i, prompt in enumerate(PROMPTS):
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}],
                                           max_tokens=300, temperature=0.7 * (i % 2), seed=i, response_format=fmt)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        validate(json.loads(r.choices[0].message.content), PERSON)
    # vLLM's and SGLang's spellings of the same request, on /v1/completions.
    for extra in ({"guided_json": PERSON}, {"json_schema": json.dumps(PERSON)}, {"structured_outputs": {"json": PERSON}}):
        c = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=300, temperature=0, extra_body=extra)
        validate(json.loads(c.choices[0].text), PERSON)


def test_json_object_gives_an_object(client) -> None:
    for prompt in PROMPTS[:2]:
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}],
                                           max_tokens=300, temperature=0, response_format={"type": "json_object"})
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_guided_choice_and_ebnf(client) -> None:
    choices = ["positive", "negative", "neutral (mixed)"]
    for prompt in PROMPTS:
        c = client.completions.create(model="m", prompt=prompt, max_tokens=16, temperature=1.0, seed=11,
                                      extra_body={"guided_choice": choices})
        assert c.choices[0].text in choices and c.choices[0].finish_reason == "stop"
    grammar = 'root ::= greeting ", " name "!"\ngreeting ::= "Hello" | "Hi"\nname ::= [A-Z] [a-z] [a-z]? [a-z]?'
    for extra in ({"ebnf": grammar}, {"guided_grammar": grammar}, {"structured_outputs": {"grammar": grammar}}):
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Greet"}],
                                           max_tokens=32, temperature=0, extra_body=extra)
        assert re.fullmatch(r"(Hello|Hi), [A-Z][a-z]{1,3}!", r.choices[0].message.content)


def test_structural_tags_on_the_openai_routes(client, url) -> None:
    """response_format {"type": "structural_tag"} in xgrammar's form: the reply is the fixed text and
    a JSON person between the tags; the older `structures` / `triggers` form (SGLang's extra field,
    vLLM's structured_outputs and /generate's sampling parameter) is served, and whatever follows a
    trigger in the reply is one of the structures, held to its schema."""
    fmt = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "Person: "},
        {"type": "tag", "begin": "<p>", "content": {"type": "json_schema", "json_schema": PERSON}, "end": "</p>"}]}}
    for i, prompt in enumerate(PROMPTS[:2]):
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}], max_tokens=300,
                                           temperature=0.7 * i, seed=i, response_format=fmt)
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop" and text.startswith("Person: <p>") and text.endswith("</p>"), text
        validate(json.loads(text[len("Person: <p>"):-len("</p>")]), PERSON)
    legacy = {"structures": [{"begin": "<p>", "schema": PERSON, "end": "</p>"}], "triggers": ["<p>"]}
    texts = [client.completions.create(model="m", prompt=PROMPTS[2], max_tokens=24, temperature=1.0, seed=3,
                                       extra_body=extra).choices[0].text
             for extra in ({"structural_tag": json.dumps(legacy)}, {"structured_outputs": {"structural_tag": legacy}})]
    texts.append(generate(url, {"text": PROMPTS[2], "sampling_params": {
        "max_new_tokens": 24, "temperature": 1.0, "seed": 3, "structural_tag": json.dumps(legacy)}})["text"])
    for text in texts:
        for call in text.split("<p>")[1:]:  # each call's JSON, where the reply got to its end
            if "</p>" in call:
                validate(json.loads(call.split("</p>")[0]), PERSON)


def test_streaming_equals_the_whole_reply(client) -> None:
    kw = dict(model="m", messages=[{"role": "user", "content": "Give me a person"}], max_tokens=300, temperature=0,
              response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    whole = client.chat.completions.create(**kw).choices[0].message.content
    pieces, finish = [], None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == whole and finish == "stop"
    validate(json.loads(whole), PERSON)
    # It streams: the text goes out as it is written. Measured in tokens, not in chunks: news that
    # arrives while the server's reader is away is merged into one chunk (as upstream's), so how
    # many chunks a reply gives is timing. With continuous usage stats each chunk carries the
    # completion tokens written when it was sent: a long constrained reply (400 digits, a token
    # each) must send text before half of it is written, which only a server that holds it back,
    # or a reader stalled for that whole time, would miss.
    chunks = list(client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Digits"}], max_tokens=410, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"regex": "[0-9]{400}"}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    total = chunks[-1].usage.completion_tokens
    assert re.fullmatch("[0-9]{400}", text) and total >= 400, (text, total)
    first = next(c for c in chunks if c.choices and c.choices[0].delta.content)
    assert first.usage.completion_tokens <= total // 2, (first.usage.completion_tokens, total)


def test_n_samples_each_follow_the_grammar(client) -> None:
    pattern = r"[a-z]{3,8}( [a-z]{3,8}){2}"
    c = client.completions.create(model="m", prompt=PROMPTS[1], max_tokens=48, temperature=1.0, n=4, seed=7,
                                  extra_body={"regex": pattern})
    texts = [ch.text for ch in c.choices]
    assert len(texts) == 4 and all(re.fullmatch(pattern, t) for t in texts), texts
    assert len(set(texts)) > 1  # each sample its own draw and matcher


def test_an_adapter_under_a_constraint(client) -> None:
    pattern = r"[a-z]{4,12}"
    base = [client.completions.create(model="m", prompt=p, max_tokens=16, temperature=0,
                                      extra_body={"regex": pattern}).choices[0].text for p in PROMPTS]
    tuned = [client.completions.create(model="m:ad", prompt=p, max_tokens=16, temperature=0,
                                       extra_body={"regex": pattern}).choices[0].text for p in PROMPTS]
    assert all(re.fullmatch(pattern, t) for t in base + tuned), (base, tuned)
    assert base != tuned  # the adapter's logits, under the same mask


def test_unconstrained_rows_of_a_mixed_batch_are_untouched(url) -> None:
    """The same batch with and without a constraint on its middle request: the other requests'
    tokens and logprobs are equal bit for bit (the constrained request runs to the same length, so
    the batches keep the same shape)."""
    texts = ["Mira walked to the harbour and", PROMPTS[1], "The engine reads a prompt"]
    plain = {"max_new_tokens": 24, "ignore_eos": True}
    sampled = {**plain, "temperature": 1.0, "seed": 5}

    def run(middle: dict, salt: str) -> list:
        # Each run its own cache salt: a prefix cached by the other run would be computed otherwise.
        return generate(url, {"text": texts, "return_logprob": True, "top_logprobs_num": 2, "cache_salt": salt,
                              "sampling_params": [{**plain, "temperature": 0}, middle, sampled]})

    # The grammar compiled first: the constrained batch then reaches the scheduler whole, however
    # long a compile takes on a loaded machine (else its other rows could start as a smaller batch,
    # whose float sums differ).
    generate(url, {"text": "warm", "sampling_params": {"max_new_tokens": 2, "regex": "[a-z ]{200}"}})
    free = run({**plain, "temperature": 0}, "free")
    constrained = run({**plain, "temperature": 0, "regex": "[a-z ]{200}"}, "constrained")
    assert constrained[1]["output_ids"] != free[1]["output_ids"]
    assert re.fullmatch("[a-z ]+", constrained[1]["text"])
    for k in (0, 2):
        assert constrained[k]["output_ids"] == free[k]["output_ids"]
        assert constrained[k]["meta_info"]["output_token_logprobs"] == free[k]["meta_info"]["output_token_logprobs"]
        assert constrained[k]["meta_info"]["output_top_logprobs"] == free[k]["meta_info"]["output_top_logprobs"]
    alone = generate(url, {"text": texts[0], "sampling_params": {**plain, "temperature": 0}})
    assert alone["output_ids"] == free[0]["output_ids"]


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize("route, extra, param, fragment", [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", "Invalid JSON schema in 'response_format': Unsupported type"),
    ("chat", {"regex": "([a-z"}, "regex", "Invalid regex in 'regex'"),
    ("completions", {"guided_regex": "a{2,1}"}, "guided_regex", "Invalid regex in 'guided_regex'"),
    ("completions", {"guided_json": '{"type": "object", "properties": '}, "guided_json", "Failed to parse JSON"),
    ("completions", {"ebnf": 'root ::= "a" | '}, "ebnf", "Invalid EBNF grammar in 'ebnf'"),
    ("chat", {"guided_grammar": 'start ::= "a"'}, "guided_grammar", 'root rule with name "root" is not found'),
    ("chat", {"regex": "a", "guided_choice": ["a"]}, "guided_choice", "only one structured-output constraint"),
])
def test_bad_specs_are_400s_naming_the_field(client, url, route, extra, param, fragment) -> None:
    before = server_info(url)["num_finished"]
    with pytest.raises(openai.BadRequestError) as e:
        if route == "chat":
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           extra_body=extra)
        else:
            client.completions.create(model="m", prompt="hi", max_tokens=4, extra_body=extra)
    error = e.value.body
    assert error["param"] == param and fragment in error["message"], error
    assert server_info(url)["num_finished"] == before  # refused before anything was queued


def test_native_generate_refuses_bad_specs(url) -> None:
    r = requests.post(f"{url}/generate", json={"text": "hi", "sampling_params": {"json_schema": "{nope"}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "json_schema", r.text
    assert "Invalid JSON schema" in r.json()["error"]["message"]


# ---------------------------------------------------------------------------- state
def test_abort_mid_grammar_leaves_no_state(url) -> None:
    """A request aborted while its grammar constrains it leaves no matcher, no KV, nothing queued.
    Its 400 digits (one token each) take ~0.3 s on this CPU model: a host stalled past that between
    the first token and the abort sees the request end on its own, and the attempt is run again.
    The matcher count is judged only for an attempt the abort ended (so the request still ran when
    the count was read, before the abort): a request that streams with no matcher still fails."""
    for attempt in range(5):
        rid = f"grammar-abort-{attempt}"
        body = {"text": "Tell me everything", "rid": rid, "stream": True,
                "sampling_params": {"max_new_tokens": 400, "temperature": 0, "regex": "[0-9]{400}"}}
        events: list[dict] = []

        def read() -> None:
            with requests.post(f"{url}/generate", json=body, stream=True, timeout=120) as r:
                for line in r.iter_lines(decode_unicode=True):
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))

        reader = threading.Thread(target=read)
        reader.start()
        deadline = time.monotonic() + 60
        while not events and time.monotonic() < deadline:
            time.sleep(0.01)
        assert events, "the request never streamed"
        matchers = server_info(url)["grammar_matchers"]
        assert requests.post(f"{url}/abort_request", json={"rid": rid}, timeout=30).status_code == 200
        reader.join(120)
        assert not reader.is_alive(), "the aborted stream never ended"
        last = events[-1]["meta_info"]
        if last["finish_reason"]["type"] != "abort":
            # It ended on its own before the abort (and maybe before the count): run it again.
            assert last["completion_tokens"] == 400, last
            continue
        assert last["completion_tokens"] < 400, last
        # Aborted, so it still ran when the matchers were counted: its matcher was there.
        assert matchers == 1, (matchers, [e.get("meta_info") for e in events[-2:]])
        break
    else:
        pytest.fail("five requests of 400 tokens each ended before their abort")
    info = wait_idle(url)
    assert_no_leaks(info)
    assert info["grammar_matchers"] == 0 and info["last_integrity_check"]["grammar_matchers"] == 0


@pytest.mark.parametrize("route", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_abort_while_the_grammar_is_checked_at_the_door(url, route: str) -> None:
    """A request whose schema takes seconds to compile (arrays nested 350 deep; a fresh description,
    so no cached check) is aborted by /abort_request while it is checked at the door: it ends unrun,
    and its rid is taken meanwhile (the abort was dropped, and the request ran in full). The OpenAI
    routes check the grammar before generate(): there too."""
    schema: dict[str, Any] = {"type": "string", "description": f"door-{route}-{time.time()}"}
    for _ in range(350):
        schema = {"type": "array", "items": schema}
    rid = f"door-abort{route.replace('/', '-')}"
    if route == "/generate":
        body = {"text": "hi", "rid": rid,
                "sampling_params": {"max_new_tokens": 16, "ignore_eos": True, "json_schema": json.dumps(schema)}}
    else:
        body = {"model": "m", "rid": rid, "max_tokens": 16, "ignore_eos": True,
                "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}},
                **({"prompt": "hi"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})}
    replies: dict[str, requests.Response] = {}
    waiter = threading.Thread(target=lambda: replies.__setitem__("r", requests.post(f"{url}{route}", json=body,
                                                                                    timeout=120)))
    waiter.start()

    def active() -> int:
        check = server_info(url)["tokenizer_integrity_check"]
        return (check.get("now") or check)["active_requests"]

    deadline = time.monotonic() + 60
    while active() < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    twin = requests.post(f"{url}/generate", json={"text": "hi", "rid": rid,
                                                   "sampling_params": {"max_new_tokens": 1}}, timeout=60)
    assert twin.status_code == 400 and "already running" in twin.json()["error"]["message"], twin.text
    assert requests.post(f"{url}/abort_request", json={"rid": rid}, timeout=30).status_code == 200
    waiter.join(120)
    r = replies["r"]
    assert r.status_code == 200, r.text
    if route == "/generate":
        meta = r.json()["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] == 0, meta
    else:
        reply = r.json()
        assert reply["choices"][0]["finish_reason"] == "abort" and reply["usage"]["completion_tokens"] == 0, reply
    assert_no_leaks(wait_idle(url))


def test_retraction_under_kv_pressure_keeps_every_grammar(client, url) -> None:
    # Decode steps lower the share of a running request's budget that admission reserves (to its
    # floor after ~400): the burst below is then admitted whole and outgrows the small KV cache.
    generate(url, {"text": "warm", "sampling_params": {"max_new_tokens": 420, "temperature": 0, "ignore_eos": True}})
    before = server_info(url)["num_retractions"]
    pattern = r"([a-z]{2,6} ){24}[0-9]{3}"  # ~40 tokens: 16 such requests want twice the cache

    def ask(i: int) -> tuple[str, str]:
        c = client.completions.create(model="m", prompt=f"{PROMPTS[i % 4]} {i}", max_tokens=120, temperature=0,
                                      extra_body={"regex": pattern} if i % 3 else {"guided_json": PERSON})
        return c.choices[0].text, c.choices[0].finish_reason

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(ask, range(16)))
    info = wait_idle(url)
    assert info["num_retractions"] > before, info["num_retractions"]
    for i, (text, finish) in enumerate(results):
        if i % 3:
            assert finish == "stop" and re.fullmatch(pattern, text), text
        elif finish == "stop":  # JSON within the budget, or cut by it: never invalid when complete
            validate(json.loads(text), PERSON)
    assert_no_leaks(info)
    assert info["grammar_matchers"] == 0


def test_skip_tokenizer_init_refuses_constraints(ckpt) -> None:
    from sglang import Engine
    from sglang.srt.managers.generate_request import InvalidRequestError

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SGLANG_CACHE_DIR", cache_dir_for_tests())
        engine = Engine(model_path=ckpt, device="cpu", dtype="float32", skip_tokenizer_init=True)
    try:
        with pytest.raises(InvalidRequestError, match="--skip-tokenizer-init") as e:
            engine.generate(input_ids=[5, 6, 7], sampling_params={"regex": "[a-z]+"})
        assert e.value.param == "regex"
        assert engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})["output_ids"]
    finally:
        engine.shutdown()
