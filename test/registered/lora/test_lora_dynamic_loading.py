"""Adapters loaded and unloaded at run time through a real server (CPU, float32, torch_native).

The server starts with one adapter (`keep`) and a pool sized by flags (rank 16; q/k/v/o and
gate/up, not down_proj). Checked:
  * load -> use -> unload -> load again, while background clients stream long generations on
    `keep` and the base model: everything completes, and the cycled adapter answers exactly as
    before its reload;
  * unload waits for the adapter's in-flight request (which completes in full), while the name
    leaves /v1/models at once and new requests for it are refused;
  * every refused load (rank above the pool's, modules outside it, DoRA, modules_to_save, added
    tokens, per-module ranks, missing or corrupt files, duplicate name, missing fields, too many
    pinned) gets a 4xx with the error envelope and {success, error_message, loaded_adapters},
    and a probe request answers identically before and after;
  * a bad adapter given at start makes the server exit with a clear message.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests

from lora_server_testlib import (
    PROMPTS,
    assert_same_answer,
    assert_unload_waits,
    greedy,
    lora_info,
    load_adapter,
    model_ids,
    post,
    unload_adapter,
)
from server_helpers import PYTHON_DIR


# The shared LoRA server fixtures (conftest.py): this module's own adapters and a larger KV pool.
ADAPTER_ZOO_SEED = 31
ZOO_SERVER_FLAGS = ("--max-total-tokens", "4096")


@pytest.fixture(autouse=True)
def only_keep_loaded_afterwards(zoo_server, adapter_zoo):
    """A failing test must not leave its adapters loaded for the next one."""
    yield
    url = zoo_server[1]
    for name in set(lora_info(url)["loaded_adapters"]) - {"keep"}:
        unload_adapter(url, name)
    if "keep" not in lora_info(url)["loaded_adapters"]:
        load_adapter(url, "keep", adapter_zoo["keep"])


def assert_refused(r: requests.Response, status: int, needle: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["success"] is False and needle.lower() in body["error_message"].lower(), body
    assert isinstance(body["loaded_adapters"], dict)
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"] == body["error_message"]
    return body


class Streamer:
    """Background clients that stream long greedy generations until stopped; every run of the same
    (adapter, prompt) must give the same tokens."""

    def __init__(self, url: str, jobs: list) -> None:
        self.url, self.jobs = url, jobs
        self.stop = threading.Event()
        self.results: dict[int, list[list[int]]] = {i: [] for i in range(len(jobs))}
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(len(jobs))]

    def _loop(self, i: int) -> None:
        lora, prompt, n = self.jobs[i]
        body = {"input_ids": prompt, "lora_path": lora, "stream": True,
                "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
        try:
            while not self.stop.is_set():
                r = requests.post(f"{self.url}/generate", json=body, stream=True, timeout=300)
                assert r.status_code == 200, r.text
                last = None
                for line in r.iter_lines(decode_unicode=True):
                    if line.startswith("data: ") and line != "data: [DONE]":
                        last = json.loads(line[6:])
                assert last is not None and last["meta_info"]["completion_tokens"] == n, last
                self.results[i].append(last["output_ids"])
        except BaseException as e:  # noqa: BLE001 - reported by check()
            self.errors.append(e)

    def __enter__(self) -> "Streamer":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)

    def check(self) -> int:
        assert not self.errors, self.errors
        for i, runs in self.results.items():
            assert runs and all(run == runs[0] for run in runs), f"background job {i} changed its output"
        return sum(len(r) for r in self.results.values())


def test_load_use_unload_load_again_while_others_stream(zoo_server, adapter_zoo) -> None:
    url = zoo_server[1]
    base = greedy(url, PROMPTS[0], None)
    jobs = [("keep", PROMPTS[1], 40), (None, PROMPTS[2], 40), ("keep", PROMPTS[3], 29)]
    with Streamer(url, jobs) as streamer:
        time.sleep(0.3)
        assert load_adapter(url, "cyc", adapter_zoo["good"]).json()["success"] is True
        assert "cyc" in model_ids(url)
        first = greedy(url, PROMPTS[0], "cyc")
        assert first["ids"] != base["ids"]  # the adapter changes the answer
        r = unload_adapter(url, "cyc")
        assert r.status_code == 200 and r.json() == {"success": True, "error_message": "",
                                                     "loaded_adapters": {"keep": adapter_zoo["keep"]}}
        assert "cyc" not in model_ids(url) and "cyc" not in lora_info(url)["loaded_adapters"]
        gone = post(url, "/generate", {"input_ids": PROMPTS[0], "lora_path": "cyc"})
        assert gone.status_code == 400 and "cyc" in gone.json()["error"]["message"]
        for prefix in ("", "/v1"):  # twice: both spellings of the endpoints
            r = load_adapter(url, "cyc", adapter_zoo["good"], prefix=prefix)
            assert r.status_code == 200, r.text
            assert_same_answer(greedy(url, PROMPTS[0], "cyc"), first, what="the reloaded adapter")
            assert unload_adapter(url, "cyc", prefix=prefix).status_code == 200
        time.sleep(0.3)
    completed = streamer.check()
    assert completed >= len(jobs)
    assert_same_answer(greedy(url, PROMPTS[0], None), base, what="the base model")


def test_unload_waits_for_in_flight_requests(zoo_server, adapter_zoo) -> None:
    url = zoo_server[1]
    assert load_adapter(url, "cyc", adapter_zoo["good"]).status_code == 200
    n = 600
    body = {"input_ids": PROMPTS[1], "lora_path": "cyc", "stream": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    stream = requests.post(f"{url}/generate", json=body, stream=True, timeout=300)
    lines = stream.iter_lines(decode_unicode=True)
    first = next(line for line in lines if line.startswith("data: "))  # it is running now
    assert json.loads(first[6:])["meta_info"]["finish_reason"] is None

    unload: dict = {}
    t = threading.Thread(target=lambda: unload.update(r=unload_adapter(url, "cyc"), t=time.monotonic()))
    t.start()
    deadline = time.monotonic() + 10
    while "cyc" in model_ids(url) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "cyc" not in model_ids(url)  # gone for new requests at once ...
    refused = post(url, "/generate", {"input_ids": PROMPTS[0], "lora_path": "cyc"})
    assert refused.status_code == 400
    # Other adapters load meanwhile: the waiting unload holds up no one else. A name with a colon
    # is selected whole by model="<name>".
    other = load_adapter(url, "team:b", adapter_zoo["good"])
    assert other.status_code == 200, other.text
    assert_unload_waits(url, unload)
    chosen = post(url, "/v1/completions", {"model": "team:b", "prompt": PROMPTS[0], "max_tokens": 2,
                                           "temperature": 0})
    assert chosen.status_code == 200 and chosen.json()["model"] == "team:b", chosen.text
    # ... while the running request still generates, and the unload waits for it.
    running = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
    assert running["meta_info"]["finish_reason"] is None
    assert_unload_waits(url, unload)
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
    t.join(60)
    last = events[-1]
    assert last["meta_info"]["completion_tokens"] == n and last["meta_info"]["finish_reason"]["type"] == "length"
    assert unload["r"].status_code == 200 and unload["r"].json()["success"] is True
    info = lora_info(url)
    assert "cyc" not in info["loaded_adapters"] and "cyc" not in info["resident_adapters"]


def test_a_client_that_stops_reading_does_not_hold_an_unload(zoo_server, adapter_zoo) -> None:
    """The adapter reference goes back when the request ends in the scheduler, not when its
    client has read the last event: a stalled stream must not keep the adapter loaded."""
    url = zoo_server[1]
    host, port = url.rsplit("//", 1)[1].split(":")
    assert load_adapter(url, "stall", adapter_zoo["good"]).status_code == 200
    body = json.dumps({"input_ids": PROMPTS[2], "lora_path": "stall", "stream": True,
                       "sampling_params": {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}})
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        sock.connect((host, int(port)))
        sock.sendall(f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        assert sock.recv(64).startswith(b"HTTP/1.1 200")  # it runs; from here on nothing is read
        # Every /generate event repeats the text so far: the socket's buffers fill long before
        # the end, and the server's writer waits on them while the scheduler finishes the request.
        deadline = time.monotonic() + 120
        while requests.get(f"{url}/get_server_info", timeout=30).json()["num_running_reqs"] and time.monotonic() < deadline:
            time.sleep(0.2)
        t0 = time.monotonic()
        r = unload_adapter(url, "stall")
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        assert time.monotonic() - t0 < 10  # it waited for nobody
        assert "stall" not in lora_info(url)["loaded_adapters"]
    finally:
        sock.close()


REFUSALS = [
    ("rank32", "rank 32"),
    ("down", "down_proj"),
    ("dora", "DoRA"),
    ("modules_to_save", "modules_to_save"),
    ("added_tokens", "vocabulary"),
    ("rank_pattern", "per-module"),
    ("no_weights", "adapter_model.safetensors"),
    ("truncated", "adapter_model.safetensors"),
]


def test_refused_loads_leave_the_server_unharmed(zoo_server, adapter_zoo, tmp_path) -> None:
    url = zoo_server[1]

    def probe() -> tuple:
        return (greedy(url, PROMPTS[0], "keep"), greedy(url, PROMPTS[2], None), model_ids(url),
                lora_info(url)["loaded_adapters"])

    before = probe()
    assert before[3] == {"keep": adapter_zoo["keep"]}
    for name, needle in REFUSALS:
        body = assert_refused(load_adapter(url, f"bad-{name}", adapter_zoo[name]), 400, needle)
        assert f"bad-{name}" in body["error_message"]
        assert body["loaded_adapters"] == {"keep": adapter_zoo["keep"]}
    assert_refused(load_adapter(url, "missing", str(tmp_path / "nowhere")), 400, "does not exist")
    assert_refused(load_adapter(url, "keep", adapter_zoo["good"]), 400, "already loaded")  # duplicate name
    assert_refused(load_adapter(url, "default", adapter_zoo["good"]), 400, "base model")  # a base model alias
    assert_refused(post(url, "/load_lora_adapter", {"lora_name": "x"}), 400, "must be provided")
    assert_refused(post(url, "/v1/load_lora_adapter", {"lora_path": adapter_zoo["good"]}), 400, "must be provided")
    assert_refused(post(url, "/load_lora_adapter", {"lora_name": "x", "lora_path": adapter_zoo["good"], "rank": 8}),
                   400, "unknown field")
    assert_refused(unload_adapter(url, "never-loaded"), 404, "never-loaded")
    assert_refused(unload_adapter(url, "never-loaded", prefix="/v1"), 404, "cannot be found")
    # Pinning: at most --max-loras-per-batch - 1 = 2 adapters, so that a slot stays free.
    for name in ("pin1", "pin2"):
        assert load_adapter(url, name, adapter_zoo["good"], pinned=True).status_code == 200
    assert_refused(load_adapter(url, "pin3", adapter_zoo["good"], pinned=True), 400, "pinned")
    assert lora_info(url)["pinned_adapters"] == ["pin1", "pin2"]
    for name in ("pin1", "pin2"):
        assert unload_adapter(url, name).status_code == 200
    after = probe()
    assert_same_answer(after[0], before[0], what="the probe on keep")
    assert_same_answer(after[1], before[1], what="the probe on the base model")
    assert after[2:] == before[2:]
    assert requests.get(f"{url}/health", timeout=10).status_code == 200


def test_a_startup_adapter_can_be_unloaded_and_loaded_again(zoo_server, adapter_zoo) -> None:
    url = zoo_server[1]
    before = greedy(url, PROMPTS[3], "keep")
    assert unload_adapter(url, "keep").json() == {"success": True, "error_message": "", "loaded_adapters": {}}
    assert model_ids(url) == [model_ids(url)[0]] and lora_info(url)["resident_adapters"] == []
    assert load_adapter(url, "keep", adapter_zoo["keep"]).status_code == 200
    assert_same_answer(greedy(url, PROMPTS[3], "keep"), before, what="keep after its reload")


def test_bad_startup_adapter_stops_the_server_with_a_clear_message(lora_ckpt, adapter_zoo) -> None:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", lora_ckpt, "--device", "cpu",
           "--port", "1", "--lora-backend", "torch_native",
           "--lora-paths", f"keep={adapter_zoo['keep']}", f"broken={adapter_zoo['dora']}"]
    env = {**os.environ, "PYTHONPATH": PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    log = out.stdout + out.stderr
    assert out.returncode != 0, log
    assert "Failed to load LoRA adapter 'broken' at startup" in log and "DoRA" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]  # a configuration error, not a crash
