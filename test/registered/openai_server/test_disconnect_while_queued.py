"""A streaming client that leaves while its request still waits in the queue (no token yet), on a
real CPU server with one running-request slot: the request is dropped quietly (an info line and a
499), not logged as an internal error with an ASGI traceback, on /generate and both OpenAI routes.

The queue is made without timing: a 1,900-token request holds the only slot until /abort_request
ends it, so the streaming request waits for as long as the test needs."""

from __future__ import annotations

import asyncio
import time

import pytest
import requests

from server_helpers import kill_server, popen_launch_server, read_log, server_env

from sglang.srt.entrypoints.openai.serving_base import prime
from sglang.srt.managers.generate_request import RequestFailedError


@pytest.fixture(scope="module")
def server():
    proc, url = popen_launch_server("demo", ["--device", "cpu", "--max-running-requests", "1"], env=server_env())
    yield proc, url
    assert kill_server(proc) == 0, read_log(proc)[-3000:]


def _info(url: str) -> dict:
    return requests.get(f"{url}/get_server_info", timeout=30).json()


def _wait(cond, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.parametrize("route", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_a_queued_stream_whose_client_leaves_ends_quietly(server, route) -> None:
    proc, url = server
    blocker = {"text": "Hold the slot:", "rid": f"blocker{route.replace('/', '-')}",
               "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True}}
    with requests.Session() as s:
        hold = s.post(f"{url}/generate", json={**blocker, "stream": True}, stream=True, timeout=120)
        _wait(lambda: _info(url)["num_running_reqs"] == 1, "the blocking request never started")
        before = read_log(proc)
        if route == "/generate":
            body = {"text": "queued", "stream": True, "sampling_params": {"max_new_tokens": 4}}
        elif route == "/v1/completions":
            body = {"model": "demo", "prompt": "queued", "stream": True, "max_tokens": 4}
        else:
            body = {"model": "demo", "messages": [{"role": "user", "content": "queued"}], "stream": True,
                    "max_tokens": 4}
        # The reply's headers wait for the first token (errors before it get a status): the client
        # gives up on them while the request is queued behind the blocker.
        with pytest.raises(requests.exceptions.ReadTimeout):
            requests.post(f"{url}{route}", json=body, stream=True, timeout=(10, 0.5))
        _wait(lambda: "client disconnected" in read_log(proc)[len(before):],
              "the server never noticed the client leave", timeout=30)
        assert requests.post(f"{url}/abort_request", json={"rid": blocker["rid"]}, timeout=30).status_code == 200
        hold.close()
    _wait(lambda: _info(url)["num_running_reqs"] == 0 and _info(url)["num_waiting_reqs"] == 0, "not idle")
    new = read_log(proc)[len(before):]
    assert "Traceback" not in new and "Exception in ASGI application" not in new, new[-3000:]
    assert "internal error" not in new, new[-3000:]


def test_prime_passes_a_disconnect_before_the_first_item_on_as_its_499() -> None:
    """The tokenizer manager ends a call whose client left with RequestFailedError(499), streamed
    or not; before the first item, prime raises it (the route's quiet handler) and closes the call."""
    closed = []

    async def gone():
        try:
            raise RequestFailedError("the client disconnected", status_code=499)
            yield  # an async generator that fails before its first item
        finally:
            closed.append(True)

    with pytest.raises(RequestFailedError) as e:
        asyncio.run(prime(gone()))
    assert e.value.status_code == 499 and closed
