"""--watchdog-timeout through a real server (CPU, demo model, --enable-test-hooks): a forward that
never returns (the "hang" fault; on one TP rank, its peers wait in a collective) must not leave the
server unanswering. The rank reports the stack it is stuck in and exits, the request in flight gets a
500 naming the cause, and the server stops with status 1 (for a supervisor to restart it).
"""

from __future__ import annotations

import threading

import pytest
import requests

from server_helpers import kill_server, read_log, server_env, servers_for_tests, started


@pytest.fixture(scope="module")
def servers(request):
    """A fresh server for each test (the test stops it), both started side by side up front (each
    start keeps about one core busy); an idle server's turns keep its watchdog quiet meanwhile."""
    with servers_for_tests(request, {
        f"test_a_hung_forward_stops_the_server_with_the_stack[{tp_size}]": dict(
            model="demo", other_args=["--device", "cpu", "--enable-test-hooks", "--watchdog-timeout", "3",
                                      "--tp-size", str(tp_size)], env=server_env())
        for tp_size in (1, 2)}) as started_servers:
        yield started_servers


@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_hung_forward_stops_the_server_with_the_stack(tp_size: int, servers, request) -> None:
    proc, url = started(servers[request.node.name])
    try:
        ok = requests.post(f"{url}/generate", json={"text": "Before", "sampling_params": {"max_new_tokens": 2}},
                           timeout=60)
        assert ok.status_code == 200, ok.text  # an idle server's turns keep the watchdog quiet
        r = requests.post(f"{url}/debug/inject_fault", json={"rid_substring": "HANG", "where": "hang",
                                                             "tp_rank": tp_size - 1}, timeout=30)
        assert r.status_code == 200, r.text
        out: dict = {}

        def run() -> None:
            out["r"] = requests.post(f"{url}/generate", json={"text": "Hangs", "rid": "HANG-1",
                                                              "sampling_params": {"max_new_tokens": 4}}, timeout=60)

        t = threading.Thread(target=run)
        t.start()
        code = proc.wait(60)
        t.join(30)
        log = read_log(proc)
        assert code == 1, log[-3000:]
        assert "made no progress for" in log and "--watchdog-timeout 3" in log, log[-3000:]
        assert "_maybe_inject_fault" in log, log[-3000:]  # the stack the rank was stuck in
        reply = out["r"]
        assert reply.status_code == 500, reply.text
        assert "made no progress" in reply.json()["error"]["message"], reply.text
    finally:
        kill_server(proc)
