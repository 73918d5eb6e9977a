"""End to end against `python -m sglang.launch_server` serving the built-in demo model (CPU):
the official `openai` client, native `/generate`, errors in the OpenAI envelope, the API key,
client disconnects, and a failing forward."""

from __future__ import annotations

import json
import re
import socket
import time

import pytest
import requests

import sglang
from server_helpers import kill_server, popen_launch_server, read_log, server_env

openai = pytest.importorskip("openai")  # the GPU machine lacks it; CI installs it (the test extra)

API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server():
    proc, url = popen_launch_server(
        "demo", ["--device", "cpu", "--enable-test-hooks", "--decode-log-interval", "5"],
        api_key=API_KEY, env=server_env(),
    )
    yield proc, url
    assert kill_server(proc) == 0, read_log(proc)[-3000:]


@pytest.fixture(scope="module")
def url(server) -> str:
    return server[1]


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def post(url: str, path: str, body, **kw) -> requests.Response:
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    kw.setdefault("timeout", 60)
    return requests.post(f"{url}{path}", data=data, headers={**AUTH, **kw.pop("headers", {})}, **kw)


def server_info(url: str) -> dict:
    r = requests.get(f"{url}/get_server_info", headers=AUTH, timeout=30)
    assert r.status_code == 200
    return r.json()


# ---------------------------------------------------------------------------- OpenAI client
def test_completion_streamed_equals_non_streamed(client) -> None:
    kw = dict(model="demo", prompt="The boats were painted", max_tokens=12, temperature=0)
    full = client.completions.create(**kw)
    assert full.choices[0].finish_reason in ("length", "stop")
    assert full.usage.prompt_tokens > 0 and full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason


def test_continuous_usage_stats(client) -> None:
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far (with
    include_usage, as there), ending at the final usage chunk's numbers."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    kw = dict(model="demo", prompt=["The boats were painted", "Numbers"], n=2, max_tokens=6, temperature=0,
              stream=True, extra_body={"ignore_eos": True})
    plain = list(client.completions.create(stream_options={"include_usage": True}, **kw))
    assert all(c.usage is None for c in plain[:-1])
    chunks = list(client.completions.create(stream_options=options, **kw))
    final = chunks[-1].usage
    assert final == plain[-1].usage and final.completion_tokens == 4 * 6
    counts = [c.usage.completion_tokens for c in chunks[:-1]]
    assert all(c.usage is not None for c in chunks) and counts == sorted(counts) and counts[-1] == 24
    assert chunks[-2].usage == final
    msgs = [{"role": "user", "content": "Tell me about Mira."}]
    chat = list(client.chat.completions.create(model="demo", messages=msgs, max_tokens=5, stream=True,
                                               stream_options=options, extra_body={"ignore_eos": True}))
    assert chat[0].usage.completion_tokens == 0 and chat[-2].usage == chat[-1].usage
    assert chat[-1].usage.completion_tokens == 5


def test_chat_streamed_equals_non_streamed(client) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about Mira."}]
    full = client.chat.completions.create(model="demo", messages=messages, max_completion_tokens=10, temperature=0)
    msg = full.choices[0].message
    assert msg.role == "assistant" and full.usage.completion_tokens <= 10
    stream = list(client.chat.completions.create(model="demo", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == msg.content
    assert stream[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_n_and_seed_are_reproducible(client) -> None:
    kw = dict(model="demo", prompt="Numbers: one, two", max_tokens=8, temperature=1.0, n=3, seed=11)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # distinct samples for n > 1
    one = client.completions.create(**{**kw, "n": 1})
    assert a.usage.prompt_tokens == one.usage.prompt_tokens  # a prompt is counted once for n samples
    assert a.usage.completion_tokens <= 24


def test_stop_string_is_removed_in_both_modes(client) -> None:
    kw = dict(model="demo", prompt="Here is a short story. On a cold morning", max_tokens=24, temperature=0)
    base = client.completions.create(**kw).choices[0].text
    words = re.findall(r"[A-Za-z]{2,}", base)
    assert words, f"the greedy output should contain a word: {base!r}"
    stop = words[len(words) // 2]
    full = client.completions.create(stop=[stop], **kw).choices[0]
    assert full.finish_reason == "stop" and stop not in full.text
    assert base.startswith(full.text) and base[len(full.text):].startswith(stop)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=stop, stream=True, **kw))
    assert streamed == full.text
    # Kept on request: SGLang's no_stop_trim and vLLM's include_stop_str_in_output.
    for extra in ({"no_stop_trim": True}, {"include_stop_str_in_output": True}):
        kept = client.completions.create(stop=[stop], extra_body=extra, **kw).choices[0]
        assert kept.text == full.text + stop, extra
    # A stop string that ends inside a token: vLLM's option ends the text with it, streamed or
    # not; SGLang's keeps the rest of that token too.
    longer = [w for w in words if len(w) >= 4]
    assert longer, f"the greedy output should contain a longer word: {base!r}"
    part = longer[0][:2]
    cut = client.completions.create(stop=[part], **kw).choices[0].text
    vllm_kw = dict(stop=[part], extra_body={"include_stop_str_in_output": True}, **kw)
    assert client.completions.create(**vllm_kw).choices[0].text == cut + part
    assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **vllm_kw)) == cut + part
    untrimmed = client.completions.create(stop=[part], extra_body={"no_stop_trim": True}, **kw).choices[0].text
    assert untrimmed.startswith(cut + part) and base.startswith(untrimmed)


def test_echo_with_prompt_logprobs(client) -> None:
    prompt = "Good software is tested."
    r = client.completions.create(model="demo", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2)
    choice = r.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    assert len(lp.tokens) == r.usage.prompt_tokens + r.usage.completion_tokens
    assert lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])
    assert lp.top_logprobs[0] is None and all(len(t) <= 2 for t in lp.top_logprobs[1:])
    # max_tokens=0 with echo returns the prompt and its logprobs only (lm-eval style scoring).
    r0 = client.completions.create(model="demo", prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    assert r0.choices[0].text == prompt and r0.usage.completion_tokens == 0
    assert r0.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1: r0.usage.prompt_tokens], abs=1e-4)
    # A token-id prompt echoes its decoded text (decoded only where echo or logprobs read it).
    ids = [12, 40, 77, 101, 5]
    by_ids = client.completions.create(model="demo", prompt=ids, max_tokens=2, temperature=0, echo=True)
    plain = client.completions.create(model="demo", prompt=ids, max_tokens=2, temperature=0)
    assert by_ids.choices[0].text.endswith(plain.choices[0].text)
    assert len(by_ids.choices[0].text) > len(plain.choices[0].text)


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_logprobs_and_offsets_equal_non_streamed(client, echo) -> None:
    """Text held back (a partial UTF-8 character, a possible stop string) must not shift the
    streamed `text_offset`s: each token's offset is where it starts in the whole reply."""
    kw = dict(model="demo", prompt="中文测试 😀", max_tokens=12, temperature=0, logprobs=1, echo=echo)
    full = client.completions.create(**kw).choices[0].logprobs
    chunks = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kw)
              if c.choices and c.choices[0].logprobs]
    assert sum((c.tokens for c in chunks), []) == full.tokens
    assert sum((c.text_offset for c in chunks), []) == full.text_offset
    assert sum((c.token_logprobs for c in chunks), []) == pytest.approx(full.token_logprobs, abs=1e-4)


def test_chat_logprobs(client) -> None:
    r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3 and item.logprob <= 0
        assert item.top_logprobs[0].logprob >= item.logprob - 1e-6  # greedy picks the top token


def test_models_and_info(url, client) -> None:
    models = client.models.list()
    # The demo serves its two adapters; each is listed with the base model as its parent.
    assert [m.id for m in models.data] == ["demo", "demo-all-r16", "demo-qv-r8"]
    assert [getattr(m, "parent", None) for m in models.data] == [None, "demo", "demo"]
    info = requests.get(f"{url}/get_model_info", headers=AUTH, timeout=10).json()
    assert info["served_model_name"] == "demo" and info["context_length"] > 0
    assert requests.get(f"{url}/version", headers=AUTH, timeout=10).json() == {"version": sglang.__version__}
    assert requests.get(f"{url}/health", timeout=10).status_code == 200  # no key needed
    assert requests.get(f"{url}/health_generate", headers=AUTH, timeout=30).status_code == 200
    s = server_info(url)
    assert s["max_total_num_tokens"] > 0 and "api_key" not in s


# ---------------------------------------------------------------------------- adapters
def test_every_way_of_naming_an_adapter_selects_it(url, client) -> None:
    """model="<base>:<adapter>", model="<adapter>", lora_path in the body and /generate's lora_path
    all select the same demo adapter: the same prompt logprobs, unlike the base model's."""
    prompt = "Adapters are small"

    def completion_logprobs(**kw) -> list:
        r = client.completions.create(prompt=prompt, max_tokens=0, echo=True, logprobs=0, **kw)
        return r.choices[0].logprobs.token_logprobs[1:]

    by_base_colon = completion_logprobs(model="demo:demo-qv-r8")
    by_name = completion_logprobs(model="demo-qv-r8")
    by_body = completion_logprobs(model="demo", extra_body={"lora_path": "demo-qv-r8"})
    # model="<base>:<adapter>" wins over lora_path in the body.
    by_colon_over_body = completion_logprobs(model="demo:demo-qv-r8", extra_body={"lora_path": "demo-all-r16"})
    base = completion_logprobs(model="demo")
    out = post(url, "/generate", {"text": prompt, "lora_path": "demo-qv-r8", "return_logprob": True,
                                  "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 0}}).json()
    native = [e[0] for e in out["meta_info"]["input_token_logprobs"][1:]]
    for other in (by_name, by_body, by_colon_over_body, native):
        assert other == pytest.approx(by_base_colon, abs=1e-5)
    assert max(abs(a - b) for a, b in zip(by_base_colon, base)) > 1e-2  # the adapter matters
    chat = client.chat.completions.create(model="demo:demo-all-r16", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2, temperature=0)
    assert chat.usage.completion_tokens == 2 and chat.model == "demo:demo-all-r16"


def test_unknown_adapter_is_a_not_found_error_listing_the_loaded_ones(client) -> None:
    for model in ("demo:missing-adapter", "missing-adapter"):
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model=model, prompt="hi", max_tokens=1)
        assert "missing-adapter" in str(e.value) and "demo-qv-r8" in str(e.value) and "demo-all-r16" in str(e.value)


# ---------------------------------------------------------------------------- native /generate
def test_penalties_bias_and_min_tokens_reach_the_sampler(url, client) -> None:
    """OpenAI's penalties and logit_bias, and the extensions repetition_penalty and min_tokens, sent
    by the official client, give what /generate gives with the same parameters (model-level
    equality with Hugging Face: models/test_penalties_hf.py); a banned token is not chosen."""
    prompt, n = "The boats were", 10
    greedy = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    first = post(url, "/generate", {"text": prompt, "sampling_params": greedy}).json()["output_ids"][0]
    params = {"frequency_penalty": 1.5, "presence_penalty": -0.5, "repetition_penalty": 1.3,
              "logit_bias": {str(first): -100}}
    native = post(url, "/generate", {"text": prompt, "sampling_params": {**greedy, **params}}).json()
    assert native["output_ids"][0] != first
    out = client.completions.create(
        model="demo", prompt=prompt, max_tokens=n, temperature=0, frequency_penalty=1.5, presence_penalty=-0.5,
        logit_bias={str(first): -100}, extra_body={"repetition_penalty": 1.3, "ignore_eos": True})
    assert out.choices[0].text == native["text"]
    # EOS made certain: one token, unless min_tokens holds it back (then it comes right after).
    eos = server_info(url)["eos_token_ids"][0]
    msgs = [{"role": "user", "content": "Say something."}]
    now = client.chat.completions.create(model="demo", messages=msgs, max_tokens=n, logit_bias={str(eos): 100})
    assert now.usage.completion_tokens == 1 and now.choices[0].finish_reason == "stop"
    later = client.chat.completions.create(model="demo", messages=msgs, max_tokens=n, logit_bias={str(eos): 100},
                                           extra_body={"min_tokens": 4})
    assert later.usage.completion_tokens == 5 and later.choices[0].finish_reason == "stop"
    check = server_info(url)["last_integrity_check"]
    assert check["ok"] and check["token_count_rows_used"] == 0, check  # every penalised request gave its row back


def test_tokenize_and_detokenize(url, client) -> None:
    """/tokenize counts what the server will serve (a completion's and a chat's prompt_tokens),
    /detokenize reads it back; both under /v1 too (vLLM's paths), with SGLang's and vLLM's fields."""
    text = "The boats were"
    r = post(url, "/tokenize", {"prompt": text})
    assert r.status_code == 200, r.text
    one = r.json()
    served = client.completions.create(model="demo", prompt=text, max_tokens=1)
    assert one["count"] == len(one["tokens"]) == served.usage.prompt_tokens
    assert one["char_count"] == len(text) and one["max_model_len"] == server_info(url)["context_len"]
    assert post(url, "/v1/tokenize", {"model": "demo-qv-r8", "prompt": text}).json() == one
    bare = post(url, "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True}).json()
    assert len(bare["token_strs"]) == bare["count"] <= one["count"]
    batch = post(url, "/tokenize", {"prompt": [text, "Numbers"]}).json()
    assert batch["tokens"][0] == one["tokens"] and len(batch["count"]) == 2
    msgs = [{"role": "user", "content": "Say something."}]
    chat = post(url, "/v1/tokenize", {"model": "demo", "messages": msgs}).json()
    assert chat["count"] == client.chat.completions.create(model="demo", messages=msgs, max_tokens=1).usage.prompt_tokens
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "something."}]}]
    assert post(url, "/tokenize", {"messages": parts}).json() == chat  # a string template joins them by a space
    back = post(url, "/detokenize", {"tokens": bare["tokens"]}).json()
    assert back["text"] == back["prompt"] == text
    both = post(url, "/v1/detokenize", {"tokens": [bare["tokens"], []]}).json()
    assert both["text"] == [text, ""]


def test_generate_batch_and_stream(url) -> None:
    body = {"text": ["The engine reads", "Adapters are"], "sampling_params": {"max_new_tokens": 6, "temperature": 0},
            "return_logprob": True, "logprob_start_len": 1, "top_logprobs_num": 2, "return_text_in_logprobs": True}
    r = post(url, "/generate", body)
    assert r.status_code == 200, r.text
    outs = r.json()
    assert len(outs) == 2
    for out in outs:
        meta = out["meta_info"]
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == len(out["output_ids"])
        assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"] - 1
        assert all(isinstance(e[2], str) for e in meta["input_token_logprobs"])
        assert all(len(t) == 2 for t in meta["output_top_logprobs"])
    single = {"text": "The engine reads", "sampling_params": {"max_new_tokens": 6, "temperature": 0}, "stream": True}
    r = post(url, "/generate", single, stream=True)
    events = [line[6:] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["text"] == outs[0]["text"] and last["output_ids"] == outs[0]["output_ids"]


# ---------------------------------------------------------------------------- errors
ERROR_CASES = [
    ("/v1/completions", '{"model": "demo", "prompt": "hi"', 400, "not valid JSON"),
    ("/v1/completions", {"model": "demo", "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"model": "demo", "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": "demo", "prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"model": "demo", "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": "demo", "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"model": "demo", "prompt": "hi " * 3000}, 400, "context length"),
    ("/v1/completions", {"model": "demo", "prompt": "hi", "max_tokens": 100000}, 400, "maximum context length"),
    ("/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "does not exist"),
    ("/v1/completions", {"model": "demo:sql", "prompt": "hi"}, 404, "adapters are not loaded: sql"),
    ("/v1/completions", {"model": "demo", "prompt": "hi", "lora_path": "sql"}, 404, "Loaded adapters"),
    # Named in lora_path beside the base model: the model exists, so the message does not deny it.
    ("/v1/completions", {"model": "demo", "prompt": ["a", "b"], "lora_path": ["demo-qv-r8", "zzz"]}, 404,
     re.compile(r"^The following requested LoRA adapters are not loaded: zzz\. Loaded adapters")),
    ("/v1/chat/completions", {"model": "sql", "messages": [{"role": "user", "content": "hi"}]}, 404,
     "demo-qv-r8"),
    ("/v1/completions", {"prompt": "hi"} | {"model": "demo", "logit_bias": {"1": 500}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"model": "demo", "messages": []}, 400, "messages"),
    ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, 400, "exactly one of"),
    ("/tokenize", {}, 400, "exactly one of"),
    ("/tokenize", {"prompt": "hi", "tokenize_extra": 1}, 400, "tokenize_extra"),
    ("/v1/tokenize", {"model": "nope", "prompt": "hi"}, 404, "does not exist"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role must be one of"),
    ("/detokenize", {"tokens": [1, 99999]}, 400, "token id 99999 is outside the vocabulary"),
    ("/v1/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"tokens": [[1], 2]}, 400, "tokens"),
    ("/detokenize", '[1, 2]', 400, "JSON object"),
    ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     400, "logprobs"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}, 400, "temperature"),
    ("/generate", {"text": "hi", "lora_path": "sql"}, 400, "not loaded: sql. Loaded adapters: ['demo-all-r16', "),
    ("/generate", {"input_ids": [1, 99999]}, 400, "vocabulary"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2.5}}, 400, "max_new_tokens"),
    ("/generate", [1, 2], 400, "JSON object"),
    ("/generate", {"text": "hi", "stream": True, "sampling_params": {"top_p": 0}}, 400, "top_p"),
    ("/v1/chat/completions", {"model": "demo", "stream": True, "messages": [{"role": "user", "content": "hi"}],
                              "temperature": -1}, 400, "temperature"),
]


@pytest.mark.parametrize("path, body, status, needle", ERROR_CASES)
def test_bad_requests_get_the_error_envelope(url, path, body, status, needle) -> None:
    r = post(url, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if isinstance(needle, re.Pattern):
        assert needle.search(err["message"]), err
    else:
        assert needle.lower() in err["message"].lower(), err


def test_openai_client_raises_typed_errors(client) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo", prompt="hi", max_tokens=-3)
    assert "max_tokens" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="missing", messages=[{"role": "user", "content": "x"}])


def test_api_key_is_enforced(url) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = requests.post(f"{url}/v1/completions", json={"model": "demo", "prompt": "hi"}, headers=headers, timeout=10)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    bad = openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_server_keeps_serving_after_errors(client) -> None:
    r = client.completions.create(model="demo", prompt="still alive?", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


# ---------------------------------------------------------------------------- robustness
def wait_for_free_kv(url: str, expected: int, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    info = server_info(url)
    while time.monotonic() < deadline and (info["kv_available_tokens"] != expected or info["num_running_reqs"]):
        time.sleep(0.2)
        info = server_info(url)
    return info


def test_client_disconnect_frees_kv(url) -> None:
    initial = server_info(url)["kv_available_tokens"]
    # Penalised: its row of the penalties' token-count table must go back with its KV.
    body = {"text": "A long story:", "stream": True,
            "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 0,
                                "frequency_penalty": 0.5}}
    r = post(url, "/generate", body, stream=True)
    lines = r.iter_lines()
    got = 0
    for line in lines:
        if line.startswith(b"data: "):
            got += 1
            if got == 5:
                break
    assert server_info(url)["kv_available_tokens"] < initial  # the request holds KV while it runs
    r.close()  # the client goes away mid-stream
    info = wait_for_free_kv(url, initial)
    assert info["kv_available_tokens"] == initial and info["num_running_reqs"] == 0
    assert info["last_integrity_check"]["ok"] and info["last_integrity_check"]["token_count_rows_used"] == 0


def test_non_streaming_disconnect_frees_kv(url, server) -> None:
    """The client goes away while its request decodes. No timeout decides when: the connection is
    closed once the server reports the request running (it then has ~1,900 tokens left to decode),
    so the test does not depend on how fast the machine decodes."""
    initial = server_info(url)["kv_available_tokens"]
    tracebacks_before = read_log(server[0]).count("Traceback")
    disconnects_before = read_log(server[0]).count("client disconnected")
    body = json.dumps({"text": "Another long story:", "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True}})
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall((f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                  f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
    deadline = time.monotonic() + 60
    while server_info(url)["num_running_reqs"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.01)
    sock.close()  # mid-decode: the reply has not been written yet
    info = wait_for_free_kv(url, initial)
    assert info["kv_available_tokens"] == initial and info["num_running_reqs"] == 0
    # A disconnect is routine: an info line, not an ASGI traceback.
    log = read_log(server[0])
    assert log.count("client disconnected") > disconnects_before, log[-2000:]
    assert log.count("Traceback") == tracebacks_before, log[-2000:]


def test_failed_forward_fails_only_that_request(url, server) -> None:
    r = post(url, "/debug/inject_fault", {"rid_substring": "boom"})
    assert r.status_code == 200
    r = post(url, "/generate", {"text": "hi", "rid": "boom-1", "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
    r = post(url, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4
    log = read_log(server[0])
    assert "Forward failed" in log and "Traceback" in log


def test_log_lines(server) -> None:
    log = read_log(server[0])
    assert re.search(r"Prefill batch, #new-seq: \d+, #new-token: \d+, #cached-token: \d+, token usage: [\d.]+, "
                     r"#running-req: \d+, #queue-req: \d+, cuda graph: (True|False)", log)
    assert re.search(r"Decode batch, .*gen throughput \(token/s\): [\d.]+", log)
    assert "DEMO MODE" in log


# ---------------------------------------------------------------------------- load generator
@pytest.mark.parametrize("fmt", ["ids", "text"])
def test_bench_serving(url, fmt) -> None:
    import os
    import subprocess
    import sys

    from server_helpers import PYTHON_DIR

    # 16 tokens a request: the inter-token latencies need a stream of more than one event, and news
    # that arrives while the server's reader is away is merged into one event (a few tokens would
    # leave a stalled reader room to merge a whole reply).
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--base-url", url, "--api-key", API_KEY,
           "--num-prompts", "6", "--random-input-len", "12", "--random-output-len", "16", "--prompt-format", fmt,
           "--max-concurrency", "3", "--request-rate", "50", "--backend", "threads"]
    env = {**os.environ, "PYTHONPATH": PYTHON_DIR}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["completed"] == 6 and res["failed"] == 0
    assert res["total_output_tokens"] == 6 * 16  # ignore_eos: every request produces its full length
    assert res["ttft_ms"]["mean"] > 0 and res["itl_ms"]["p99"] >= res["itl_ms"]["median"] > 0
    assert "Time to first token" in out.stdout and "requests" in out.stderr  # the progress bar


def test_bench_serving_picks_adapters_by_popularity(url) -> None:
    import os
    import subprocess
    import sys

    from server_helpers import PYTHON_DIR

    before = server_info(url)["lora"]["loaded_adapters"]
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--base-url", url, "--api-key", API_KEY,
           "--num-prompts", "6", "--random-input-len", "8", "--random-output-len", "2", "--max-concurrency", "6",
           "--backend", "threads", "--disable-tqdm", "--lora-name", "demo-all-r16", "demo-qv-r8",
           "--lora-distribution", "zipf", "--lora-zipf-alpha", "2", "--seed", "3"]
    env = {**os.environ, "PYTHONPATH": PYTHON_DIR}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["completed"] == 6 and res["failed"] == 0 and res["lora_distribution"] == "zipf"
    counts = res["lora_requests"]
    assert list(counts) == ["demo-all-r16", "demo-qv-r8"] and sum(counts.values()) == 6
    assert counts["demo-all-r16"] > counts["demo-qv-r8"] > 0  # weights 1 : 1/4
    assert "LoRA requests (zipf)" in out.stdout and set(before) >= set(counts)


def test_abort_request_ends_a_running_request(url) -> None:
    from concurrent.futures import ThreadPoolExecutor

    body = {"text": "Go on and on", "rid": "to-abort", "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True}}
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(post, url, "/generate", body)
        # An abort that arrives before its request is dropped: wait until the request runs.
        deadline = time.monotonic() + 60
        while server_info(url)["num_running_reqs"] == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.05)
        assert post(url, "/abort_request", {"rid": "to-abort"}).status_code == 200
        r = fut.result(timeout=30)
    assert r.status_code == 200
    meta = r.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 1900


def test_abort_request_ends_every_sample_of_a_rid(url) -> None:
    """n > 1 runs rid R as R-0, R-1: /abort_request with R aborts them all."""
    from concurrent.futures import ThreadPoolExecutor

    body = {"text": "Go on and on", "rid": "to-abort-n",
            "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True, "n": 2}}
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(post, url, "/generate", body)
        # An abort that arrives before its requests is dropped: wait until both samples run.
        deadline = time.monotonic() + 60
        while server_info(url)["num_running_reqs"] < 2:
            assert time.monotonic() < deadline, "the samples never both ran"
            time.sleep(0.05)
        assert post(url, "/abort_request", {"rid": "to-abort-n"}).status_code == 200
        r = fut.result(timeout=30)
    assert r.status_code == 200
    for out in r.json():
        assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["meta_info"]["completion_tokens"] < 1900


def test_models_retrieve_and_the_model_a_reply_names(client, url) -> None:
    card = client.models.retrieve("demo")
    assert card.id == "demo" and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    # A request naming the base by an alias (or not at all) gets the served name back.
    r = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == "demo", r.text
    assert client.completions.create(model="default", prompt="hi", max_tokens=1).model == "demo"
