"""`--enable-metrics`: /metrics in the Prometheus text format, parsed with prometheus_client's own
parser, against a real LoRA server (CPU, two adapters, one adapter slot) and known traffic:
  - while a request of adapter `a` runs and one of `b` waits for the slot, the LoRA info gauge
    lists `a` as running and `b` as waiting (the endpoint picker's `vllm:lora_requests_info` shape);
  - then base requests, one per adapter, a repeat of a prompt (a cache hit) and an aborted stream:
    every counter moves by exactly what the replies report, per adapter too, and every histogram
    counts every request (TTFT once per request, ITL once per token after the first);
  - the forward-path counter shows the batches ran eagerly ("graphs_disabled": a CPU has no graphs);
  - /metrics is open without the API key (as upstream); without the flag it is a 404;
  - a client that goes away is counted as an abort, with the tokens its request generated.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests

prometheus_parser = pytest.importorskip("prometheus_client.parser")  # the test extra installs it

from lora_server_testlib import tiny_lora_checkpoint, write_adapter
from server_helpers import kill_server, kill_servers, launch_servers, read_log, running, server_env, session_runs, started

KEY = "metrics-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny"


@pytest.fixture(scope="module")
def servers(tmp_path_factory, request):
    """The metrics server and, when the session runs its test, a demo server without the flag,
    started side by side (each start keeps about one core busy)."""
    ckpt = tiny_lora_checkpoint("llama")
    root = tmp_path_factory.mktemp("metrics-adapters")
    adapters = {n: write_adapter(ckpt, str(root / n), r=8, seed=40 + i) for i, n in enumerate("ab")}
    launches = [dict(model=ckpt, other_args=[
        "--device", "cpu", "--enable-metrics", "--served-model-name", MODEL, "--lora-backend", "torch_native",
        "--max-loras-per-batch", "1", "--lora-paths", *[f"{n}={p}" for n, p in adapters.items()],
    ], api_key=KEY, env={"SGLANG_FORWARD_TIMES": "1"})]
    if session_runs(request, "test_no_metrics_without_the_flag"):
        launches.append(dict(model="demo", other_args=["--device", "cpu"], env=server_env()))
    results = launch_servers(*launches, return_exceptions=True)
    yield results
    if not isinstance(results[0], BaseException):
        assert kill_server(results[0][0]) == 0, read_log(results[0][0])[-3000:]
    kill_servers(running(results[1:]))


@pytest.fixture(scope="module")
def server(servers):
    return started(servers[0])  # or the error of its start


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels without model_name): value}; every sample names the model."""
    r = requests.get(f"{url}/metrics", headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text[:300]
    out = {}
    for family in prometheus_parser.text_string_to_metric_families(r.text):
        for s in family.samples:
            if not s.name.startswith("sglang:"):
                continue
            assert s.labels.get("model_name") == MODEL, s
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[s.name, labels] = s.value
    return out


def generate(url: str, body: dict) -> dict:
    r = requests.post(f"{url}/generate", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_lora_info_lists_running_and_waiting_adapters(server):
    url = server[1]
    long_a = {"text": "a long story", "lora_path": "a", "rid": "long-a",
              "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
    short_b = {"text": "b waits", "lora_path": "b", "sampling_params": {"max_new_tokens": 2}}

    def lora_info() -> dict:
        info = [k for k in scrape(url) if k[0] == "sglang:lora_requests_info"]
        return dict(info[0][1]) if info else {}

    def wait_for(pred, seconds: float = 60) -> dict | None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            labels = lora_info()
            if pred(labels):
                return labels
            time.sleep(0.02)
        return None

    # `a` is long and ends by abort, and `b` is sent once `a` is seen running: the wait does not
    # race the length of `a` on a slow machine.
    thread_a = threading.Thread(target=requests.post, args=(f"{url}/generate",),
                                kwargs=dict(json=long_a, headers=AUTH, timeout=300))
    thread_a.start()
    running = wait_for(lambda labels: labels.get("running_lora_adapters") == "a")
    thread_b = threading.Thread(target=generate, args=(url, short_b))
    thread_b.start()
    seen = wait_for(lambda labels: labels.get("running_lora_adapters") == "a"
                    and labels.get("waiting_lora_adapters") == "b")
    assert requests.post(f"{url}/abort_request", json={"rid": "long-a"}, headers=AUTH, timeout=30).status_code == 200
    for t in (thread_a, thread_b):
        t.join(120)
    assert running is not None, "never saw a running"
    assert seen is not None and seen["max_lora"] == "1", "never saw a running with b waiting"


def test_counters_and_histograms_follow_the_traffic(server):
    url = server[1]
    before = scrape(url)
    prompt = "the same prompt, twice, so that the second one is a cache hit"
    outs = [generate(url, {"text": prompt, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})]
    outs.append(generate(url, {"text": prompt, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}))
    outs.append(generate(url, {"text": "for adapter a", "lora_path": "a", "sampling_params": {"max_new_tokens": 5}}))
    outs.append(generate(url, {"text": "for adapter b", "lora_path": "b", "sampling_params": {"max_new_tokens": 4}}))
    # An aborted stream: /abort_request after the first event.
    with requests.post(f"{url}/generate", headers=AUTH, stream=True, timeout=120, json={
            "text": "to be aborted", "rid": "abort-me", "stream": True,
            "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith(b"data: {"):
                assert requests.post(f"{url}/abort_request", json={"rid": "abort-me"}, headers=AUTH,
                                     timeout=30).status_code == 200
                break
        last = None
        for line in lines:
            if line.startswith(b"data: {"):
                last = json.loads(line[6:])
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    outs.append(last)
    after = scrape(url)

    def delta(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    metas = [o["meta_info"] for o in outs]
    assert metas[1]["cached_tokens"] > 0
    assert delta("sglang:num_requests_total") == 5
    assert delta("sglang:num_aborted_requests_total") == 1
    assert delta("sglang:prompt_tokens_total") == sum(m["prompt_tokens"] for m in metas)
    assert delta("sglang:generation_tokens_total") == sum(m["completion_tokens"] for m in metas)
    assert delta("sglang:cached_tokens_total") == sum(m["cached_tokens"] for m in metas)
    for lora, idx in (("", [0, 1, 4]), ("a", [2]), ("b", [3])):
        assert delta("sglang:lora_requests_total", lora_name=lora) == len(idx)
        assert delta("sglang:lora_prompt_tokens_total", lora_name=lora) == sum(metas[i]["prompt_tokens"] for i in idx)
        assert delta("sglang:lora_generation_tokens_total", lora_name=lora) == sum(
            metas[i]["completion_tokens"] for i in idx)
    assert delta("sglang:e2e_request_latency_seconds_count") == 5
    assert delta("sglang:time_to_first_token_seconds_count") == 5
    assert delta("sglang:inter_token_latency_seconds_count") == sum(m["completion_tokens"] - 1 for m in metas)
    assert after["sglang:e2e_request_latency_seconds_bucket", (("le", "+Inf"),)] == after[
        "sglang:e2e_request_latency_seconds_count", ()]
    # Scheduler-side series, read at the scrape: idle now, on the CPU everything ran eagerly.
    assert after["sglang:num_running_reqs", ()] == 0 and after["sglang:num_queue_reqs", ()] == 0
    assert 0 <= after["sglang:token_usage", ()] <= 1 and after["sglang:cache_hit_rate", ()] > 0
    assert delta("sglang:forward_batches_total", mode="prefill", path="eager", reason="graphs_disabled") >= 5
    assert delta("sglang:forward_batches_total", mode="decode", path="eager", reason="graphs_disabled") > 0
    assert delta("sglang:forward_seconds_total", mode="prefill") > 0  # SGLANG_FORWARD_TIMES=1
    assert delta("sglang:forward_seconds_total", mode="decode") > 0
    assert after["sglang:lora_slot_loads_total", ()] >= 2 and after["sglang:lora_resident_adapters", ()] == 1
    assert after["sglang:lora_slot_load_seconds_count", ()] == after["sglang:lora_slot_loads_total", ()]


def test_health_probes_and_log_metrics_false_are_not_counted(server):
    """/health_generate runs a one-token request: a probe every few seconds must not show up as
    traffic. Upstream's `log_metrics: false` leaves any request out the same way."""
    url = server[1]
    before = scrape(url)
    for _ in range(3):
        assert requests.get(f"{url}/health_generate", timeout=60).status_code == 200
    out = generate(url, {"text": "not counted", "log_metrics": False, "sampling_params": {"max_new_tokens": 2}})
    assert out["meta_info"]["completion_tokens"] == 2
    counted = generate(url, {"text": "counted", "sampling_params": {"max_new_tokens": 2}})
    after = scrape(url)
    for name in ("sglang:num_requests_total", "sglang:e2e_request_latency_seconds_count"):
        assert after.get((name, ()), 0.0) - before.get((name, ()), 0.0) == 1, name
    assert (after[("sglang:generation_tokens_total", ())] - before.get(("sglang:generation_tokens_total", ()), 0.0)
            == counted["meta_info"]["completion_tokens"])
    r = requests.post(f"{url}/generate", headers=AUTH, timeout=60,
                      json={"text": "x", "log_metrics": "no", "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and "log_metrics" in r.json()["error"]["message"]


def test_metrics_are_scraped_without_the_api_key(server):
    """As in SGLang: Prometheus and the health probes need no key; the API does."""
    r = requests.get(f"{server[1]}/metrics", timeout=30)
    assert r.status_code == 200 and "sglang:prompt_tokens" in r.text
    assert requests.get(f"{server[1]}/health", timeout=30).status_code == 200
    assert requests.get(f"{server[1]}/get_server_info", timeout=30).status_code == 401


def test_no_metrics_without_the_flag(servers):
    _, url = started(servers[1])
    r = requests.get(f"{url}/metrics", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


def test_a_client_that_goes_away_is_counted_as_aborted(server):
    """A stream whose client disconnects ends without the scheduler's news reaching a waiting
    reply: it still counts as a request and as an abort."""
    url = server[1]
    before = scrape(url)
    with requests.post(f"{url}/generate", headers=AUTH, stream=True, timeout=120, json={
            "text": "a client that leaves", "stream": True,
            "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                break  # leave after the first event; closing the response drops the connection
    key = ("sglang:num_aborted_requests_total", ())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        after = scrape(url)
        if after.get(key, 0.0) > before.get(key, 0.0):
            break
        time.sleep(0.2)
    assert after.get(key, 0.0) - before.get(key, 0.0) == 1
    req_key = ("sglang:num_requests_total", ())
    assert after.get(req_key, 0.0) - before.get(req_key, 0.0) == 1


def test_a_plain_request_whose_client_leaves_counts_the_tokens_it_generated(server):
    """A non-streaming request's tokens reach the server's front only when it ends: one whose
    client goes away is counted when the scheduler's news of its end arrives, with the tokens it
    generated (they were 0 when it was counted at the disconnect). However fast this machine (the
    request may even finish first), the generation tokens move by what the scheduler produced:
    the prefill's token plus one per decode step it ran in."""
    import socket
    from urllib.parse import urlparse

    url = server[1]

    def info() -> dict:
        return requests.get(f"{url}/get_server_info", headers=AUTH, timeout=30).json()

    before, info_before = scrape(url), info()
    body = json.dumps({"text": "a client that leaves", "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True}})
    head = (f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    parsed = urlparse(url)
    with socket.create_connection((parsed.hostname, parsed.port), timeout=30) as conn:
        conn.sendall(head.encode() + body.encode())
        deadline = time.monotonic() + 60
        while info()["num_running_reqs"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
    # The connection is closed: the server notices and aborts the request (unless it ended first).
    req_key = ("sglang:num_requests_total", ())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        after = scrape(url)
        if after.get(req_key, 0.0) > before.get(req_key, 0.0) and info()["num_running_reqs"] == 0:
            break
        time.sleep(0.2)
    info_after = info()
    assert after.get(req_key, 0.0) - before.get(req_key, 0.0) == 1
    generated = after[("sglang:generation_tokens_total", ())] - before.get(("sglang:generation_tokens_total", ()), 0.0)
    decode_steps = info_after["decode_reqs"] - info_before["decode_reqs"]
    assert generated == decode_steps + 1 and generated > 0, (generated, decode_steps)


def test_an_unloaded_adapter_leaves_the_per_adapter_series(server, tmp_path):
    """A server that loads and unloads many names must not export every name it ever served."""
    url = server[1]
    ckpt = tiny_lora_checkpoint("llama")
    path = write_adapter(ckpt, str(tmp_path / "brief"), r=8, seed=77)
    r = requests.post(f"{url}/load_lora_adapter", headers=AUTH, json={"lora_name": "brief", "lora_path": path},
                      timeout=120)
    assert r.status_code == 200, r.text
    for adapter in ("brief", "a"):
        generate(url, {"text": "brief visit", "lora_path": adapter, "sampling_params": {"max_new_tokens": 2}})
    series = [k for k in scrape(url) if ("lora_name", "brief") in k[1]]
    assert {k[0] for k in series} >= {"sglang:lora_requests_total", "sglang:lora_generation_tokens_total"}
    r = requests.post(f"{url}/unload_lora_adapter", headers=AUTH, json={"lora_name": "brief"}, timeout=120)
    assert r.status_code == 200, r.text
    assert not [k for k in scrape(url) if ("lora_name", "brief") in k[1]]
    assert [k for k in scrape(url) if ("lora_name", "a") in k[1]]  # the loaded ones' stay
