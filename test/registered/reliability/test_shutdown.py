"""Stopping a server under load (CPU, demo model): SIGTERM to the server, or to its whole process
group (systemd's control-group stop, Ctrl-C in a terminal), while replies stream.

Every reply in flight must end cleanly: a stream with its finish or an error event naming the
shutdown, then `data: [DONE]` (never cut off mid-stream); a plain request a JSON body (its reply,
or a 503 in the error envelope). The server exits with status 0 and leaves no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests

from server_helpers import PYTHON_DIR, free_port, group_alive, kill_server, read_log, server_env, servers_for_tests
from server_helpers import started as started_server  # `started` is a test's event below

LONG = {"max_new_tokens": 1900, "ignore_eos": True}


def _stream(url: str, out: dict, k: int, started: threading.Event) -> None:
    try:
        r = requests.post(f"{url}/generate", json={"text": f"Stream {k} goes on", "stream": True,
                                                   "sampling_params": LONG}, stream=True, timeout=60)
        events = []
        for line in r.iter_lines(decode_unicode=True):
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()
        out[k] = events
    except Exception as e:  # noqa: BLE001 - checked below
        out[k] = e


def _plain(url: str, out: dict) -> None:
    try:
        out["plain"] = requests.post(f"{url}/generate", json={"text": "Plain goes on", "sampling_params": LONG},
                                     timeout=60)
    except Exception as e:  # noqa: BLE001 - checked below
        out["plain"] = e


def _stop(proc, threads: list, send_signal, wait_s: float) -> str:
    """Signal the server, wait for it to exit with status 0 and for the client threads to end;
    returns its log."""
    send_signal()
    code = proc.wait(wait_s)
    for t in threads:
        t.join(60)
    log = read_log(proc)
    assert code == 0, log[-3000:]
    return log


@pytest.fixture(scope="module")
def servers(request):
    """A fresh demo server for each test (each stops its own), all started side by side up front
    (each start keeps about one core busy); the others wait idle meanwhile."""
    demo = dict(model="demo", other_args=["--device", "cpu"], env=server_env())
    names = ["test_sigterm_under_load_ends_every_reply_cleanly[server]",
             "test_sigterm_under_load_ends_every_reply_cleanly[process-group]",
             "test_sigterm_to_the_scheduler_alone_stops_the_server_in_seconds"]
    specs = {name: demo for name in names}
    specs["test_a_longer_shutdown_timeout_lets_replies_finish"] = dict(
        demo, other_args=["--device", "cpu", "--shutdown-timeout", "300"])
    with servers_for_tests(request, specs) as started_servers:
        yield started_servers


@pytest.mark.parametrize("whole_group", [False, True], ids=["server", "process-group"])
def test_sigterm_under_load_ends_every_reply_cleanly(whole_group: bool, servers, request) -> None:
    proc, url = started_server(servers[request.node.name])
    try:
        out: dict = {}
        started = threading.Event()
        threads = [threading.Thread(target=_stream, args=(url, out, k, started)) for k in range(3)]
        threads.append(threading.Thread(target=_plain, args=(url, out)))
        for t in threads:
            t.start()
        assert started.wait(60), "no stream started"
        time.sleep(0.5)
        log = _stop(proc, threads, lambda: os.killpg(proc.pid, signal.SIGTERM) if whole_group
                    else proc.send_signal(signal.SIGTERM), wait_s=30)
        deadline = time.monotonic() + 10
        while group_alive(proc) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not group_alive(proc), "a process of the server outlived it"
        for k in range(3):
            events = out[k]
            assert isinstance(events, list), f"stream {k} broke: {events!r}"
            assert events and events[-1] == "[DONE]", f"stream {k} was cut off: {events[-2:]}"
            last = json.loads(events[-2])
            if "error" in last:
                # The server's own 503: the scheduler outlives a signal to the whole group until
                # the server shuts it down.
                assert last["error"]["code"] == 503 and "shutting down" in last["error"]["message"], last
            else:
                assert last["meta_info"]["finish_reason"] is not None, last
        plain = out["plain"]
        assert isinstance(plain, requests.Response), f"the plain request broke: {plain!r}"
        body = plain.json()  # JSON either way
        assert plain.status_code == 200 or (plain.status_code == 503 and "error" in body), plain.text
        assert "Exception in ASGI application" not in log, log[-3000:]
        assert "stopped on the same signal" not in log, log[-3000:]  # the scheduler was not killed by it
        assert "leaked semaphore" not in log, log[-3000:]  # nothing was left for the resource tracker
    finally:
        kill_server(proc)


def test_sigterm_to_the_scheduler_alone_stops_the_server_in_seconds(servers, request) -> None:
    """The scheduler defers a SIGTERM (the server's shutdown follows a group signal), but sent to it
    alone it still exits on its own, and the server stops and says why."""
    proc, url = started_server(servers[request.node.name])
    try:
        children = [int(p) for p in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()]
        scheduler = [p for p in children if "spawn_main" in open(f"/proc/{p}/cmdline").read()
                     and "resource_tracker" not in open(f"/proc/{p}/cmdline").read()]
        assert len(scheduler) == 1, children
        os.kill(scheduler[0], signal.SIGTERM)
        r = requests.post(f"{url}/generate", json={"text": "Still here", "sampling_params": {"max_new_tokens": 4}},
                          timeout=30)
        assert r.status_code == 200, r.text  # it keeps serving meanwhile
        code = proc.wait(30)
        log = read_log(proc)
        assert code != 0 and "the scheduler process exited unexpectedly (exit code 143)" in log, log[-3000:]
    finally:
        kill_server(proc)


def test_a_longer_shutdown_timeout_lets_replies_finish(servers, request) -> None:
    """--shutdown-timeout 300 (vLLM's flag): a SIGTERM stops new requests at once, but the ones in
    flight, streamed and not, run to their end (well past the default 2 s), and the server exits
    as soon as they are done, not after the timeout."""
    proc, url = started_server(servers[request.node.name])
    try:
        tokens = 1800  # seconds of decoding on the CPU: well past the default 2 s
        body = {"max_new_tokens": tokens, "ignore_eos": True}
        out: dict = {}
        started = threading.Event()

        def stream() -> None:
            r = requests.post(f"{url}/generate", json={"text": "A long stream", "stream": True, "sampling_params": body},
                              stream=True, timeout=300)
            events = []
            for line in r.iter_lines(decode_unicode=True):
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
            out["stream"] = events

        def plain() -> None:
            out["plain"] = requests.post(f"{url}/generate", json={"text": "A long reply", "sampling_params": body},
                                         timeout=300)

        threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
        for t in threads:
            t.start()
        assert started.wait(60), "the stream never started"
        t0 = time.monotonic()
        _stop(proc, threads, lambda: proc.send_signal(signal.SIGTERM), wait_s=300)
        last = json.loads(out["stream"][-2])
        assert out["stream"][-1] == "[DONE]" and last["meta_info"]["completion_tokens"] == tokens, last
        assert out["plain"].status_code == 200, out["plain"].text
        assert out["plain"].json()["meta_info"]["completion_tokens"] == tokens
        assert time.monotonic() - t0 < 200, "the server waited for the timeout, not for the replies"
    finally:
        kill_server(proc)


def test_ctrl_c_during_start_up_stops_at_once(tmp_path) -> None:
    """Ctrl-C (SIGINT to the process group) while the scheduler loads: a loading rank reads no
    shutdown request, so asking it used to cost 10 s and end in a KeyboardInterrupt traceback. It
    is stopped at once, with one line and status 130 (the shell's for SIGINT), nothing left."""
    log_path = tmp_path / "server.log"
    env = {**os.environ, **server_env(), "SGLANG_TEST_STALL_AT_START_S": "600",
           "PYTHONPATH": PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", "--device", "cpu", "--port",
                                 str(free_port()), "--enable-test-hooks"], stdout=log_file,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "Start-up stalls for 600 s" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.1)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(60)
        took = time.monotonic() - t0
        log = log_path.read_text()
        assert code == 130 and "Interrupted during start-up" in log, (code, log[-3000:])
        assert "Traceback" not in log and "did not exit in time" not in log, log[-3000:]
        assert took < 9, f"stopping took {took:.1f} s (asking a loading rank to exit waits 10 s)"
        deadline = time.monotonic() + 10
        while group_alive(proc) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not group_alive(proc), "a process of the server outlived it"
    finally:
        kill_server(proc)
