"""Chat-route conventions a client of OpenAI, vLLM or SGLang relies on, against a real CPU server
(the demo model, with a Qwen-style chat template that, like Qwen's own, renders only the roles it
knows): an rid with n > 1 that /abort_request ends, "developer" messages that reach the model,
errors naming max_completion_tokens, and vLLM's neutral "echo": false."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

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


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_abort_request_ends_every_sample_of_an_openai_rid(url, route) -> None:
    """n > 1 runs rid R as R-0, R-1 on both routes (as /generate does): /abort_request R ends them
    all. Chat used to drop the rid when n > 1."""
    body = {"model": "demo", "n": 2, "max_tokens": 1900, "ignore_eos": True, "rid": "qa-abort-n"}
    body.update({"messages": [{"role": "user", "content": "Go on"}]} if "chat" in route else {"prompt": "Go on"})
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(requests.post, f"{url}{route}", json=body, timeout=120)
        deadline = time.monotonic() + 20
        while _running(url) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert requests.post(f"{url}/abort_request", json={"rid": "qa-abort-n"}, timeout=30).status_code == 200
        r = fut.result(timeout=60)
    assert r.status_code == 200, r.text
    reply = r.json()
    assert [c["finish_reason"] for c in reply["choices"]] == ["abort", "abort"]
    assert reply["usage"]["completion_tokens"] < 2 * 1900


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
