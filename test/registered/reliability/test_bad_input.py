"""Bad input on every endpoint, table-driven, against one real server (CPU) plus an API-key server.

Every case sends one request and expects a 4xx in the OpenAI envelope
`{"error": {"message", "type", "param", "code"}}` whose message names the problem (adapter endpoints
also carry `{success: false, error_message, loaded_adapters}`); a few cases are inputs the server
must *accept* (e.g. `top_k` beyond the vocabulary means no top-k), expected as 200. After every case
the server must still be healthy and a probe (greedy tokens and logprobs of the base model and an
adapter, each run alone) must answer identically to the probe taken before the first case.
Covered: malformed JSON, non-UTF-8 bodies, deep nesting, non-object bodies, wrong JSON types
(strings, booleans, NaN, infinities where numbers belong), absurd sizes (`n=10**6`,
`max_tokens=10**12`, `top_logprobs=1000`, `logprobs=-1`, 5000-prompt batches, prompts beyond the
context), empty prompts and messages, unknown roles, lone surrogates, malformed tools, tool_choice
and tool messages (and tools on a server without --tool-call-parser), unknown adapters, every
refused adapter load (missing files, truncated safetensors, wrong tensor shapes, rank above the
pool's, modules outside it, DoRA, modules_to_save, broken config, duplicate name), unloading an
unknown adapter and one with a request in flight (it waits, then succeeds), and missing or wrong
API keys.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Callable, Optional

import pytest
import requests

from bad_input_cases import (
    API_KEY,
    LOAD,
    TYPES,
    UNLOAD,
    Case,
    adapter_cases,
    auth_cases,
    body_cases,
    chat_cases,
    completion_cases,
    generate_cases,
    misc_cases,
)
from lora_server_testlib import PROMPTS, assert_unload_waits, greedy, zoo_server_launch
from reliability_lib import assert_no_leaks, wait_idle
from server_helpers import servers_running, session_runs, started


# ---------------------------------------------------------------------------- fixtures
# The shared LoRA server fixtures (conftest.py): this module's own adapters, and the fault hooks;
# its zoo server starts beside the API-key server (`servers`).
ADAPTER_ZOO_SEED = 41
ZOO_SERVER_FLAGS = ("--enable-test-hooks",)


@pytest.fixture(scope="module")
def servers(lora_ckpt, adapter_zoo, request):
    """The zoo server (conftest.zoo_server's, with this module's flags) and, when the session runs
    its test, a server with an API key, started side by side (each start keeps about one core busy)."""
    launches = [zoo_server_launch(lora_ckpt, adapter_zoo, request.module)]
    if session_runs(request, "test_api_key_matrix"):
        launches.append(dict(model=lora_ckpt, other_args=["--device", "cpu", "--dtype", "float32"], api_key=API_KEY))
    with servers_running(*launches) as results:
        yield results


@pytest.fixture(scope="module")
def zoo_server(servers):
    return started(servers[0])  # or the error of its start


@pytest.fixture(scope="module")
def key_server(servers):
    return started(servers[1])


# ---------------------------------------------------------------------------- tests
def probe(url: str) -> tuple:
    return greedy(url, PROMPTS[0], None, n=4), greedy(url, PROMPTS[1], "keep", n=4)


def adapter_names(url: str) -> list[str]:
    r = requests.get(f"{url}/v1/models", timeout=30)
    return sorted(m["id"] for m in r.json()["data"] if m.get("parent"))


def check(case: Case, r: requests.Response) -> Optional[str]:
    """What is wrong with the reply to `case`, or None."""
    if r.status_code != case.status:
        return f"status {r.status_code} (expected {case.status}): {r.text[:300]}"
    if case.status == 200:
        return None
    try:
        body = r.json()
    except ValueError:
        return f"not JSON: {r.text[:300]}"
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"}:
        return f"no OpenAI error envelope: {body}"
    if err["type"] != TYPES[case.status]:
        return f"error type {err['type']!r}: {err}"
    if type(err["code"]) is not int or err["code"] != case.status:  # always the status, as SGLang sends it
        return f"error code {err['code']!r} is not the status {case.status}: {err}"
    if case.needle.lower() not in err["message"].lower():
        return f"message does not name the problem ({case.needle!r}): {err['message']!r}"
    if case.path in LOAD + UNLOAD and case.status != 401 and not (body.get("success") is False and body.get("error_message") == err["message"]
                                           and isinstance(body.get("loaded_adapters"), dict)):
        return f"adapter reply without success/error_message/loaded_adapters: {body}"
    return None


def run_matrix(url: str, cases: list[Case], after_each: Callable[[], Optional[str]]) -> list[str]:
    failures = []
    for case in cases:
        try:
            problem = check(case, case.send(url))
        except requests.RequestException as e:
            problem = f"no reply: {e!r}"
        problem = problem or after_each()
        if problem:
            failures.append(f"{case}: {problem}")
    return failures


def test_bad_input_matrix(zoo_server, adapter_zoo, tmp_path, capsys) -> None:
    proc, url = zoo_server
    cases = (body_cases() + generate_cases() + completion_cases() + chat_cases()
             + adapter_cases(adapter_zoo, str(tmp_path)) + misc_cases())
    before = probe(url)
    loaded = {"keep": adapter_zoo["keep"]}

    def still_serving() -> Optional[str]:
        if proc.poll() is not None:
            return "the server died"
        if probe(url) != before:
            return "the probe answers differently now"
        if adapter_names(url) != sorted(loaded):
            return f"the loaded adapters changed: {adapter_names(url)}"
        return None

    failures = run_matrix(url, cases, still_serving)
    with capsys.disabled():
        print(f"\n[bad-input] {len(cases)} cases against the LoRA server, {len(failures)} failed")
    assert not failures, "\n".join(failures)
    info = wait_idle(url)
    assert_no_leaks(info)
    assert info["num_forward_failures"] == 0  # no bad input reached the model and broke a batch


def test_api_key_matrix(key_server, capsys) -> None:
    proc, url = key_server
    cases = auth_cases()
    failures = run_matrix(url, cases, lambda: "the server died" if proc.poll() is not None else None)
    with capsys.disabled():
        print(f"\n[bad-input] {len(cases)} cases against the API-key server, {len(failures)} failed")
    assert not failures, "\n".join(failures)


def test_unload_with_a_request_in_flight_waits_then_succeeds(zoo_server, adapter_zoo) -> None:
    url = zoo_server[1]
    assert requests.post(f"{url}/load_lora_adapter", json={"lora_name": "busy", "lora_path": adapter_zoo["good"]},
                         timeout=60).status_code == 200
    # Long enough that the request usually still generates when the test reads its next event (the
    # check asks the scheduler, so a machine slow enough to finish first cannot fail it).
    n = 600
    body = {"input_ids": PROMPTS[2], "lora_path": "busy", "stream": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    stream = requests.post(f"{url}/generate", json=body, stream=True, timeout=120)
    lines = (line for line in stream.iter_lines(decode_unicode=True) if line.startswith("data: "))
    assert json.loads(next(lines)[6:])["meta_info"]["finish_reason"] is None  # running now
    unload: dict = {}
    t = threading.Thread(target=lambda: unload.update(
        r=requests.post(f"{url}/unload_lora_adapter", json={"lora_name": "busy"}, timeout=120)))
    t.start()
    deadline = time.monotonic() + 30
    while "busy" in adapter_names(url) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "busy" not in adapter_names(url)  # the unload has begun: no new request may use it ...
    midway = json.loads(next(lines)[6:])
    assert midway["meta_info"]["finish_reason"] is None
    assert_unload_waits(url, unload)  # ... but it waits
    events = [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]
    t.join(60)
    assert events[-1]["meta_info"]["completion_tokens"] == n  # the request completed in full,
    assert unload["r"].status_code == 200 and unload["r"].json()["success"] is True  # then the unload
    refused = requests.post(f"{url}/generate", json={"input_ids": PROMPTS[2], "lora_path": "busy"}, timeout=30)
    assert refused.status_code == 400 and "not loaded: busy" in refused.json()["error"]["message"]
    assert_no_leaks(wait_idle(url))
