"""Chat-route conventions a client of OpenAI, vLLM or SGLang relies on, against a real CPU server
(the demo model, with a Qwen-style chat template that, like Qwen's own, renders only the roles it
knows): an rid with n > 1 that /abort_request ends, "developer" messages that reach the model,
errors naming max_completion_tokens, vLLM's neutral "echo": false, and /generate's max_new_tokens refused."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Iterator

import pytest
import requests

from server_helpers import kill_server, popen_launch_server, read_log, server_env

openai = pytest.importorskip("openai")  # the GPU machine lacks it; CI installs it (the test extra)

# Qwen's templates skip a message whose role they do not know (no "developer" branch).
QWEN_STYLE_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role in ['system', 'user', 'assistant'] -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "qwen_style.jinja"
    template.write_text(QWEN_STYLE_TEMPLATE)
    proc, base_url = popen_launch_server("demo", ["--device", "cpu", "--chat-template", str(template)],
                                         env=server_env())
    yield base_url
    assert kill_server(proc) == 0, read_log(proc)[-3000:]


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def _running(url: str) -> int:
    return requests.get(f"{url}/get_server_info", timeout=30).json()["num_running_reqs"]


@contextmanager
def _two_running_samples(url: str, route: str, rid: str) -> Iterator[Future]:
    """An n=2 request of rid `rid` on `route`, posted in the background; yields its future once both
    samples run (an abort that arrives before its requests is dropped)."""
    body = {"model": "demo", "n": 2, "max_tokens": 1900, "ignore_eos": True, "rid": rid}
    body.update({"messages": [{"role": "user", "content": "Go on"}]} if "chat" in route else {"prompt": "Go on"})
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(requests.post, f"{url}{route}", json=body, timeout=120)
        deadline = time.monotonic() + 60
        while _running(url) < 2:
            assert time.monotonic() < deadline, "the samples never both ran"
            time.sleep(0.05)
        yield fut


def _assert_both_aborted(r: requests.Response) -> None:
    assert r.status_code == 200, r.text
    reply = r.json()
    assert [c["finish_reason"] for c in reply["choices"]] == ["abort", "abort"]
    assert reply["usage"]["completion_tokens"] < 2 * 1900


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_abort_request_ends_every_sample_of_an_openai_rid(url, route) -> None:
    """n > 1 runs rid R as R-0, R-1 on both routes (as /generate does): /abort_request R ends them
    all. Chat used to drop the rid when n > 1."""
    with _two_running_samples(url, route, "qa-abort-n") as fut:
        assert requests.post(f"{url}/abort_request", json={"rid": "qa-abort-n"}, timeout=30).status_code == 200
        _assert_both_aborted(fut.result(timeout=60))


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_abort_request_of_one_sample_ends_that_sample_only(url, route) -> None:
    """Sample j of n > 1 runs as R-j on both routes: /abort_request R-1 ends sample 1, and the other
    runs on. /v1/completions ran a string prompt as a batch of one (R-0-0, R-0-1), so R-1 (and R-0)
    named nothing and both samples ran to their end."""
    with _two_running_samples(url, route, "qa-abort-one") as fut:
        assert requests.post(f"{url}/abort_request", json={"rid": "qa-abort-one-1"}, timeout=30).status_code == 200
        deadline = time.monotonic() + 60
        while _running(url) > 1:  # sample 1 ends (before the fix both ran on to 1900 tokens, then 0)
            assert time.monotonic() < deadline, "sample 1 was not aborted"
            time.sleep(0.05)
        assert requests.post(f"{url}/abort_request", json={"rid": "qa-abort-one-0"}, timeout=30).status_code == 200
        _assert_both_aborted(fut.result(timeout=60))


def test_developer_messages_reach_a_template_without_the_role(url, client) -> None:
    """OpenAI's "developer" role is the newer "system": a template that knows only "system" (Qwen's
    drop other roles) must still get the instructions, as vLLM maps the role (sglang#40082)."""
    def prompt(role: str) -> list[int]:
        msgs = [{"role": role, "content": "Always answer in French."}, {"role": "user", "content": "Hello"}]
        r = requests.post(f"{url}/tokenize", json={"messages": msgs}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    assert prompt("developer") == prompt("system")
    msgs = [{"role": "developer", "content": "Always answer in French."}, {"role": "user", "content": "Hello"}]
    as_developer = client.chat.completions.create(model="demo", messages=msgs, max_tokens=1)
    assert as_developer.usage.prompt_tokens == len(prompt("system"))


def test_max_completion_tokens_errors_name_that_field(url) -> None:
    """A client that sends only max_completion_tokens (OpenAI's current name) is told about it, not
    about a max_tokens it never sent."""
    msgs = [{"role": "user", "content": "hi"}]
    for extra, fragment in (({"max_completion_tokens": 10**9}, "tokens for the completion"),
                            ({"max_completion_tokens": 1, "min_tokens": 3}, "must not exceed max_completion_tokens (1)")):
        r = requests.post(f"{url}/v1/chat/completions", json={"model": "demo", "messages": msgs, **extra}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert fragment in err["message"] and "max_tokens" not in err["message"], err
        if "min_tokens" not in extra:
            assert err["param"] == "max_completion_tokens", err
    # max_tokens alone still names max_tokens.
    r = requests.post(f"{url}/v1/chat/completions", json={"model": "demo", "messages": msgs, "max_tokens": 10**9},
                      timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_neutral_echo_on_chat_is_accepted(url) -> None:
    """vLLM's chat `echo` defaults to false and clients built for vLLM send it: false asks for
    nothing, so it passes like the other neutral values (echo true stays a 400)."""
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    r = requests.post(f"{url}/v1/chat/completions", json={**body, "echo": False}, timeout=30)
    assert r.status_code == 200, r.text
    r = requests.post(f"{url}/v1/chat/completions", json={**body, "echo": True}, timeout=30)
    assert r.status_code == 400 and "echo is not supported on chat completions" in r.json()["error"]["message"]
    r = requests.post(f"{url}/v1/chat/completions", json={**body, "echo": "no"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text


def test_chat_without_max_tokens_runs_to_the_context(url, client) -> None:
    """OpenAI's chat (and vLLM's, SGLang's) has no output cap when max_tokens is unset: the reply
    ends at EOS, a stop or the context. It was cut at 128 tokens with finish_reason "length"."""
    info = requests.get(f"{url}/get_server_info", timeout=30).json()
    limit = min(info["context_len"], info["max_total_num_tokens"])
    room = 160  # more than the old cap of 128, little decode work on the CPU

    def prompt_len(words: int) -> int:
        msgs = [{"role": "user", "content": "hi " * words}]
        return len(requests.post(f"{url}/tokenize", json={"messages": msgs}, timeout=30).json()["tokens"])

    # A message whose rendered prompt leaves about `room` tokens.
    base, per_word = prompt_len(0), (prompt_len(100) - prompt_len(0)) / 100
    words = int((limit - room - base) / per_word)
    msgs = [{"role": "user", "content": "hi " * words}]
    n_prompt = prompt_len(words)
    assert 128 < limit - n_prompt < room + 40, (limit, n_prompt)
    for extra in ({}, {"max_tokens": None}):  # unset, and the explicit null the official client sends
        reply = client.chat.completions.create(model="demo", messages=msgs, extra_body={"ignore_eos": True}, **extra)
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == limit - n_prompt > 128
    # /generate keeps SGLang's default of 128 when the field is left out; its null fills the context.
    ids = requests.post(f"{url}/tokenize", json={"messages": msgs}, timeout=30).json()["tokens"]
    for params, expected in (({}, 128), ({"max_new_tokens": None}, limit - n_prompt)):
        r = requests.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": {"ignore_eos": True, **params}},
                          timeout=120)
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == expected, r.text[:300]
    # /generate's default budget shrinks to that room too, and min_new_tokens past it is a 400 (it
    # was accepted, and the request stopped short of its minimum with "length").
    longer = ids + ids[-100:]  # leaves fewer than the default 128
    r = requests.post(f"{url}/generate", json={"input_ids": longer, "sampling_params": {"min_new_tokens": 100}},
                      timeout=60)
    assert r.status_code == 400 and "leaves after the input" in r.json()["error"]["message"], r.text
    # min_tokens past that room: a 400 that says why, not a cap it never asked for.
    r = requests.post(f"{url}/v1/chat/completions", json={"model": "demo", "messages": msgs, "min_tokens": room + 100},
                      timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
    assert "leaves after the input" in r.json()["error"]["message"]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_generate_budget_name_on_an_openai_route_is_a_400(url, route) -> None:
    """/generate's `max_new_tokens` sent to an OpenAI route (a client reusing its sampling_params)
    is refused as its `min_new_tokens` is. It was ignored: completions kept their 16 tokens and chat
    ran to the context (47 tokens instead of 3 on a 64-token context)."""
    body = {"model": "demo", "max_new_tokens": 3}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in route else {"prompt": "hi"})
    r = requests.post(f"{url}{route}", json=body, timeout=30)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == "max_new_tokens" and "take max_tokens" in err["message"], err
    # Its null asks for nothing: accepted, as the other extensions' neutral values are.
    r = requests.post(f"{url}{route}", json={**body, "max_new_tokens": None, "max_tokens": 1}, timeout=30)
    assert r.status_code == 200, r.text[:300]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_null_means_the_default(client, route) -> None:
    """The official client sends null for an argument passed as None; OpenAI types these fields
    "X or null" and vLLM reads null as the default. They were 400s ("n: Input should be a valid
    integer")."""
    nulls = dict(n=None, stream=None, seed=None, stop=None, temperature=None, top_p=None, user=None,
                 extra_body={"ignore_eos": None, "skip_special_tokens": None, "no_stop_trim": None})
    if "chat" in route:
        reply = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=3, logprobs=None, stream_options=None, **nulls)
        assert len(reply.choices) == 1 and reply.choices[0].logprobs is None
    else:
        reply = client.completions.create(model="demo", prompt="hi", max_tokens=3, echo=None, logprobs=None,
                                          best_of=None, **nulls)
        assert len(reply.choices) == 1 and reply.choices[0].logprobs is None
    assert reply.usage.completion_tokens == 3
    # A required field keeps its null, and its error names it.
    body = {"model": "demo", "max_tokens": 1, **({"messages": None} if "chat" in route else {"prompt": None})}
    r = requests.post(f"{client.base_url}{route.removeprefix('/v1/')}", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] in ("messages", "prompt"), r.text
