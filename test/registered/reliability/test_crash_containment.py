"""Crash containment through a real server (CPU) with --enable-test-hooks.

Faults are injected with `/debug/inject_fault` at four places: a forward pass (prefill, "forward"),
a later decode step of a streaming request ("decode"), tokenisation ("tokenize", matched on the
prompt text) and detokenisation ("detokenize", matched on the rid). Each must fail only the request
involved, with a 500 whose OpenAI envelope names the cause (an SSE error event when the stream
had already started), log the traceback, give back everything the request held (KV slots, request
rows, adapter references, request states), and leave the server serving: a bystander request
running at the same time completes with its usual output, and a probe answers identically before
and after.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Optional

import pytest
import requests

from lora_server_testlib import PROMPTS, greedy, tiny_lora_checkpoint, write_adapter
from reliability_lib import assert_no_leaks, server_info, wait_idle
from server_helpers import kill_server, popen_launch_server, read_log

MSG = [{"role": "user", "content": "Tell me about TOKFAULT please"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = tiny_lora_checkpoint("llama")
    keep = write_adapter(ckpt, str(tmp_path_factory.mktemp("crash") / "keep"), r=8, seed=51)
    proc, url = popen_launch_server(ckpt, [
        "--device", "cpu", "--dtype", "float32", "--lora-backend", "torch_native", "--enable-test-hooks",
        "--lora-paths", f"keep={keep}", "--max-loras-per-batch", "2",
    ])
    yield proc, url
    assert kill_server(proc) == 0, read_log(proc)[-3000:]


def inject(url: str, substring: str, where: str, after_tokens: int = 0) -> None:
    r = requests.post(f"{url}/debug/inject_fault", json={"rid_substring": substring, "where": where,
                                                         "after_tokens": after_tokens}, timeout=30)
    assert r.status_code == 200, r.text


def sse_events(r: requests.Response) -> list[Any]:
    out = []
    for line in r.iter_lines(decode_unicode=True):
        if line.startswith("data: "):
            out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return out


def assert_500(r: requests.Response, needle: str) -> None:
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "internal_server_error"
    assert needle in err["message"], err


class Bystander:
    """A long greedy stream on the adapter, running while faults hit other requests."""

    def __init__(self, url: str, n: int = 60) -> None:
        self.body = {"input_ids": PROMPTS[3], "lora_path": "keep", "stream": True,
                     "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
        self.url, self.n = url, n
        self.result: Optional[Any] = None
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            r = requests.post(f"{self.url}/generate", json=self.body, stream=True, timeout=300)
            events = []
            for line in r.iter_lines(decode_unicode=True):
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    self.started.set()
            self.result = events[-1]
        except BaseException as e:  # noqa: BLE001 - checked in output()
            self.result = e
        finally:
            self.started.set()

    def __enter__(self) -> "Bystander":
        self.thread.start()
        assert self.started.wait(120)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.thread.join(300)

    def output(self) -> list[int]:
        assert isinstance(self.result, dict), self.result
        assert "error" not in self.result and self.result["meta_info"]["completion_tokens"] == self.n, self.result
        return self.result["output_ids"]


@pytest.fixture(scope="module")
def reference(server) -> dict:
    url = server[1]
    alone = requests.post(f"{url}/generate", json={**Bystander(url).body, "stream": False}, timeout=300).json()
    return {"probe": (greedy(url, PROMPTS[0], None), greedy(url, PROMPTS[1], "keep")),
            "bystander": alone["output_ids"], "failures": server_info(url)["num_forward_failures"]}


def check_unharmed(server, reference: dict) -> dict:
    proc, url = server
    assert proc.poll() is None
    # Promptly: a failed request's clean-up must not wait for the garbage collector.
    info = wait_idle(url, timeout=5)
    assert_no_leaks(info)
    assert (greedy(url, PROMPTS[0], None), greedy(url, PROMPTS[1], "keep")) == reference["probe"]
    return info


def test_forward_fault(server, reference) -> None:
    url = server[1]
    with Bystander(url) as bystander:
        inject(url, "boom-plain", "forward")
        r = requests.post(f"{url}/generate", json={"text": "hi", "rid": "boom-plain-1", "lora_path": "keep",
                                                  "sampling_params": {"max_new_tokens": 8}}, timeout=60)
        assert_500(r, "injected fault")
        # OpenAI non-streaming: the same 500, through the chat layer.
        inject(url, "boom-chat", "forward")
        r = requests.post(f"{url}/v1/chat/completions", json={"model": "default:keep", "rid": "boom-chat-1",
                                                              "messages": [{"role": "user", "content": "x"}],
                                                              "max_tokens": 8}, timeout=60)
        assert_500(r, "injected fault")
    assert bystander.output() == reference["bystander"]
    info = check_unharmed(server, reference)
    assert info["num_forward_failures"] >= reference["failures"] + 2
    log = read_log(server[0])
    assert "Forward failed" in log and "Traceback" in log and "injected fault" in log


# Where the mid-stream faults fire: far enough in that the stream's first chunk has long left. News
# that arrives while the server's reader is away is merged into one chunk, so a fault a few tokens
# in could reach a reader that had not yet taken the first token, in the same chunk: the request
# would fail before its stream began (a plain 500), not mid-stream.
FAULT_AFTER = 200


def test_decode_fault_mid_stream(server, reference) -> None:
    url = server[1]
    # A streaming /generate request fails at a decode step, after its first tokens were sent.
    inject(url, "boom-stream", "decode", after_tokens=FAULT_AFTER)
    r = requests.post(f"{url}/generate", json={"input_ids": PROMPTS[2], "rid": "boom-stream-1", "stream": True,
                                               "lora_path": "keep",
                                               "sampling_params": {"max_new_tokens": FAULT_AFTER + 30,
                                                                   "ignore_eos": True}},
                      stream=True, timeout=60)
    assert r.status_code == 200
    events = sse_events(r)
    assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
    assert events[-2]["error"]["code"] == 500 and "injected fault" in events[-2]["error"]["message"]
    assert all("error" not in e for e in events[:-2])
    # The same for an OpenAI streaming completion.
    inject(url, "boom-oai", "decode", after_tokens=FAULT_AFTER)
    r = requests.post(f"{url}/v1/completions", json={"model": "default:keep", "prompt": "Once", "rid": "boom-oai-1",
                                                     "max_tokens": FAULT_AFTER + 30, "ignore_eos": True, "stream": True},
                      stream=True, timeout=60)
    events = sse_events(r)
    assert r.status_code == 200 and events[-1] == "[DONE]" and events[-2]["error"]["code"] == 500, events[-3:]
    assert any(e["choices"] for e in events[:-2])  # some text had been streamed before the failure
    # The request was cleaned up before [DONE] was sent, not later by the garbage collector.
    tok = wait_idle(url, timeout=1)["tokenizer_integrity_check"]
    assert "now" not in tok and tok["lora_in_flight_refs"] == 0, tok
    check_unharmed(server, reference)


def test_tokenizer_fault(server, reference) -> None:
    url = server[1]
    inject(url, "TOKFAULT", "tokenize")
    r = requests.post(f"{url}/v1/completions", json={"model": "default:keep", "prompt": "a TOKFAULT b",
                                                     "max_tokens": 4}, timeout=60)
    assert_500(r, "internal error while tokenizing the prompt: RuntimeError: injected tokenizer fault")
    inject(url, "TOKFAULT", "tokenize")
    r = requests.post(f"{url}/v1/chat/completions", json={"model": "keep", "messages": MSG, "stream": True,
                                                          "max_tokens": 4}, stream=True, timeout=60)
    assert_500(r, "injected tokenizer fault")  # failed before the stream began: a plain 500
    # The next request with the same text is tokenised normally (the fault fired once).
    ok = requests.post(f"{url}/v1/completions", json={"model": "default", "prompt": "a TOKFAULT b", "max_tokens": 2},
                       timeout=60)
    assert ok.status_code == 200, ok.text
    check_unharmed(server, reference)
    assert "Tokenizing a prompt of" in read_log(server[0])


def test_detokenizer_fault(server, reference) -> None:
    url = server[1]
    with Bystander(url) as bystander:
        # Non-streaming, while the bystander decodes: the failed request shares its batches and
        # its scheduler messages, and must not take the bystander down with it.
        inject(url, "detok-plain", "detokenize")
        r = requests.post(f"{url}/generate", json={"input_ids": PROMPTS[0], "rid": "detok-plain-1", "lora_path": "keep",
                                                  "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}},
                          timeout=60)
        assert_500(r, "internal error while detokenizing the output: RuntimeError: injected detokenizer fault")
        inject(url, "detok-stream", "detokenize")
        r = requests.post(f"{url}/generate", json={"input_ids": PROMPTS[1], "rid": "detok-stream-1", "stream": True,
                                                  "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}},
                          stream=True, timeout=60)
        assert_500(r, "injected detokenizer fault")
    assert bystander.output() == reference["bystander"]
    check_unharmed(server, reference)
    log = read_log(server[0])
    assert "Detokenizing the output of request 'detok-plain-1' failed" in log and "Traceback" in log
