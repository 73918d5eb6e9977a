"""Shared pieces of the reliability suites: waiting for an idle server, and the leak checks read
from /get_server_info (both processes' integrity checks)."""

from __future__ import annotations

import time
from typing import Optional

import requests


def server_info(url: str, headers: Optional[dict] = None) -> dict:
    r = requests.get(f"{url}/get_server_info", headers=headers or {}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle(url: str, timeout: float = 60.0, headers: Optional[dict] = None) -> dict:
    """Wait until nothing runs or waits in either process and both integrity checks ran idle;
    returns the server info then."""
    deadline = time.monotonic() + timeout
    while True:
        info = server_info(url, headers)
        tok = info["tokenizer_integrity_check"]
        sched = info["last_integrity_check"]
        idle = (info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0 and tok["idle"]
                and "now" not in tok and sched.get("idle"))
        if idle or time.monotonic() > deadline:
            return info
        time.sleep(0.2)


def assert_no_leaks(info: dict) -> None:
    """Everything given back: KV slots (free, or cached and evictable: free + evictable == total,
    nothing locked), request rows, adapter references, request states."""
    sched, tok = info["last_integrity_check"], info["tokenizer_integrity_check"]
    assert sched["ok"] and tok["ok"], (sched, tok)
    assert sched["idle"] and tok["idle"], (sched, tok)
    assert info["kv_available_tokens"] == info["max_total_num_tokens"] == sched["kv_total"], sched
    assert sched["kv_free"] + sched["kv_evictable"] == sched["kv_total"] and sched["kv_protected"] == 0, sched
    assert info["kv_free_tokens"] == sched["kv_free"] and info["kv_evictable_tokens"] == sched["kv_evictable"], sched
    assert sched["kv_used"] == 0 and sched["rows_used"] == 0 and sched["rows_free"] == sched["rows_total"], sched
    assert sched["num_requests"] == 0, sched
    assert tok["request_states"] == 0 and tok["lora_in_flight_refs"] == 0, tok
