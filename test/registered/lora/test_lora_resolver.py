"""Adapters loaded on first use from --lora-resolver-dir, through a real server (CPU, float32,
torch_native), with --max-loaded-loras 2: a request for an adapter that is not loaded loads
DIR/<name> and is served as PEFT serves it; concurrent first requests share one load; at the cap
the least recently used idle adapter loaded this way makes room; with every loaded adapter busy the
request gets a 503; names that are not in the folder (or would leave it) are unknown models."""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests

from lora_server_testlib import (
    POOL_MODULES,
    PROMPTS,
    assert_close,
    assert_same_answer,
    greedy,
    hf_prompt_logprobs,
    lora_info,
    post,
    served_prompt_logprobs,
    unload_adapter,
    write_adapter,
)
from server_helpers import kill_server, popen_launch_server, read_log
from sglang.srt.managers.tokenizer_lora import RESOLVER_DELAY_TEST_ENV


@pytest.fixture(scope="module")
def resolver_dir(lora_ckpt, tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("resolver")
    for i, name in enumerate(("a", "b", "c")):
        write_adapter(lora_ckpt, f"{root}/{name}", r=8, target_modules=["q_proj", "v_proj"], seed=70 + i)
    write_adapter(lora_ckpt, f"{root}/org/nested", r=4, target_modules=["o_proj"], seed=80)
    write_adapter(lora_ckpt, f"{root}/slow", r=8, target_modules=["q_proj"], seed=82)  # loads in 3 s
    write_adapter(lora_ckpt, f"{root}/big", r=32, target_modules=["q_proj"], seed=81)  # above the pool's rank
    return str(root)


@pytest.fixture(scope="module")
def server(lora_ckpt, resolver_dir):
    proc, url = popen_launch_server(lora_ckpt, [
        "--device", "cpu", "--dtype", "float32", "--lora-backend", "torch_native", "--max-loras-per-batch", "2",
        "--max-lora-rank", "16", "--lora-target-modules", *POOL_MODULES, "--lora-resolver-dir", resolver_dir,
        "--max-loaded-loras", "2", "--enable-test-hooks",
    ], env={RESOLVER_DELAY_TEST_ENV: "slow=3"})
    yield proc, url
    assert kill_server(proc) == 0, read_log(proc)[-3000:]


@pytest.fixture(autouse=True)
def nothing_loaded(server):
    url = server[1]
    for name in lora_info(url)["loaded_adapters"]:
        unload_adapter(url, name)
    yield


def loaded(url: str) -> set[str]:
    return set(lora_info(url)["loaded_adapters"])


def test_first_use_loads_the_adapter_as_peft_serves_it(server, lora_ckpt, resolver_dir) -> None:
    url = server[1]
    assert loaded(url) == set()
    served = served_prompt_logprobs(url, PROMPTS[:2], ["a", "org/nested"])
    for prompt, got, name in zip(PROMPTS[:2], served, ["a", "org/nested"]):
        assert_close(got, hf_prompt_logprobs(lora_ckpt, f"{resolver_dir}/{name}", prompt), 1e-4, name)
    assert loaded(url) == {"a", "org/nested"}
    # The OpenAI routes name it as a model, before and after it is loaded.
    unload_adapter(url, "a")
    r = post(url, "/v1/completions", {"model": "a", "prompt": "hello", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["model"] == "a", r.text
    assert "a" in {m["id"] for m in requests.get(f"{url}/v1/models", timeout=30).json()["data"]}


def test_the_least_recently_used_idle_adapter_makes_room(server) -> None:
    url = server[1]
    ids = PROMPTS[0]
    first = greedy(url, ids, "a")
    greedy(url, ids, "b")
    assert loaded(url) == {"a", "b"}
    greedy(url, ids, "a")  # a is now the more recent
    greedy(url, ids, "c")
    assert loaded(url) == {"a", "c"}
    greedy(url, ids, "b")
    assert loaded(url) == {"b", "c"}
    assert_same_answer(greedy(url, ids, "a"), first, what="reloaded")  # it answers as before
    log = read_log(server[0])
    assert "Unloaded LoRA adapter 'b' (least recently used) to load 'c'" in log


def test_concurrent_first_requests_share_one_load(server) -> None:
    url, marker = server[1], "Loaded LoRA adapter 'c' on first use"
    before = read_log(server[0]).count(marker)
    results: list = [None] * 6

    def ask(i: int) -> None:
        results[i] = greedy(url, PROMPTS[i % 2], "c")

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is not None for r in results)
    for i in range(2, 6):  # batched with different neighbours: equal up to float32 rounding
        assert_same_answer(results[i], results[i % 2], what=f"request {i}")
    assert read_log(server[0]).count(marker) == before + 1


def test_concurrent_first_requests_for_more_adapters_than_the_cap(server) -> None:
    """Three new adapters at once on a cap of 2: a load never unloads an adapter that another
    request loaded and has not yet taken (each request is served, or told to retry: 503), never
    a 400 "not loaded" for an adapter the folder holds."""
    url = server[1]
    for _ in range(5):
        statuses: dict[str, int] = {}

        def ask(name: str) -> None:
            r = post(url, "/generate", {"input_ids": PROMPTS[0], "lora_path": name,
                                        "sampling_params": {"max_new_tokens": 1}})
            statuses[name] = r.status_code

        threads = [threading.Thread(target=ask, args=(n,)) for n in ("a", "b", "c")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert set(statuses.values()) <= {200, 503} and 200 in statuses.values(), statuses
        for name in loaded(url):
            unload_adapter(url, name)
    # One batch wanting more new adapters than the cap: a 503 that says why, not "not loaded".
    r = post(url, "/generate", {"input_ids": [PROMPTS[0]] * 3, "lora_path": ["a", "b", "c"],
                                "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 503 and "this request's other adapters" in r.json()["error"]["message"], r.text


def test_an_adapter_loaded_explicitly_is_never_unloaded_to_make_room(server, resolver_dir) -> None:
    url = server[1]
    greedy(url, PROMPTS[0], "a")  # first use
    assert unload_adapter(url, "a").status_code == 200
    r = post(url, "/load_lora_adapter", {"lora_name": "a", "lora_path": f"{resolver_dir}/a"})
    assert r.status_code == 200, r.text
    greedy(url, PROMPTS[0], "b")
    greedy(url, PROMPTS[0], "c")  # room comes from b, the only adapter loaded on first use
    assert loaded(url) == {"a", "c"}


@pytest.mark.parametrize("name, status, needle", [
    ("big", 400, "rank"),  # found, refused by the pool: the load's own message
    ("missing", 400, "not loaded: missing"),
    ("../a", 400, "not loaded"),  # never outside the folder
    ("/a", 400, "not loaded"),
    ("a/", 400, "not loaded"),
])
def test_names_that_cannot_be_loaded(server, name, status, needle) -> None:
    url = server[1]
    r = post(url, "/generate", {"text": "hi", "lora_path": name, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == status and needle in r.json()["error"]["message"], r.text
    assert name not in loaded(url)
    r = post(url, "/v1/completions", {"model": name, "prompt": "hi", "max_tokens": 1})
    assert r.status_code in (400, 404), r.text
    assert greedy(url, PROMPTS[0], None)["ids"]  # still serving


def running(url: str) -> int:
    return requests.get(f"{url}/get_server_info", timeout=30).json()["num_running_reqs"]


def test_with_every_loaded_adapter_busy_a_new_one_gets_a_503(server) -> None:
    """Both loaded adapters held by running requests (as long as the context allows): the third is
    refused. The verdict counts only where both were still running after the refusal, so a fast
    machine that finished them first retries instead of failing."""
    url = server[1]
    body = {"input_ids": PROMPTS[0], "stream": True, "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    for attempt in range(3):
        greedy(url, PROMPTS[0], "a", n=1)  # loaded first, so the long requests start back to back
        greedy(url, PROMPTS[0], "b", n=1)
        streams = []
        try:
            for name in ("a", "b"):  # the cap
                r = requests.post(f"{url}/generate", data=json.dumps({**body, "lora_path": name}), stream=True,
                                  timeout=300)
                lines = r.iter_lines()  # kept: a dropped generator closes the connection (an abort)
                next(line for line in lines if line.startswith(b"data: "))  # it runs
                streams.append((r, lines))
            r = post(url, "/generate", {"text": "hi", "lora_path": "c", "sampling_params": {"max_new_tokens": 1}})
            still_busy = running(url) == 2
        finally:
            for stream, _ in streams:
                stream.close()
        if still_busy:
            break
        for name in loaded(url):
            unload_adapter(url, name)
    assert still_busy, "the long requests ended before the check three times"
    assert r.status_code == 503 and "in use" in r.json()["error"]["message"], r.text
    assert loaded(url) == {"a", "b"}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and running(url):  # their clients are gone: they end
        time.sleep(0.2)
    r = post(url, "/generate", {"text": "hi", "lora_path": "c", "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200, r.text


def active_requests(url: str) -> int:
    check = requests.get(f"{url}/get_server_info", timeout=30).json()["tokenizer_integrity_check"]
    return (check.get("now") or check)["active_requests"]


def test_an_abort_while_the_adapter_loads_ends_the_request_unrun(server) -> None:
    """A request whose adapter is still loading on first use (a load slowed by the test hook) is
    aborted by /abort_request once the load ends, before it generates a token; its rid stays taken
    while it waits."""
    url = server[1]
    replies: dict[str, requests.Response] = {}
    waiter = threading.Thread(target=lambda: replies.__setitem__("r", post(url, "/generate", {
        "rid": "waits-for-slow", "input_ids": PROMPTS[1], "lora_path": "slow",
        "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}})))
    waiter.start()
    deadline = time.monotonic() + 60
    while active_requests(url) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert active_requests(url) == 1 and "slow" not in loaded(url)  # it waits for the load
    twin = post(url, "/generate", {"rid": "waits-for-slow", "text": "hi", "sampling_params": {"max_new_tokens": 1}})
    assert twin.status_code == 400 and "already running" in twin.json()["error"]["message"], twin.text
    assert post(url, "/abort_request", {"rid": "waits-for-slow"}).status_code == 200
    waiter.join(120)
    r = replies["r"]
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] == 0, meta
    assert "slow" in loaded(url) and greedy(url, PROMPTS[1], "slow", n=1)["ids"]  # the adapter serves
