"""Servers for the serving benchmarks: start `sglang.launch_server` in its own process group, wait
for /health, read /get_server_info, stop it (SIGTERM, then the whole group)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any, Optional

import requests

PYTHON_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python")


def start_server(args: list[str], port: int, log_path: str, timeout: float,
                 env: Optional[dict[str, str]] = None) -> tuple[subprocess.Popen, float]:
    """Launch `python -m sglang.launch_server --port PORT ARGS...` (log to `log_path`; `env`: more
    environment variables) and wait until /health answers; returns (process, seconds it took).
    Raises with the log's path if the server exits or stays unhealthy for `timeout` seconds."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port", str(port), *args]
    env = {**os.environ, "PYTHONPATH": PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    start = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} (log: {log_path})")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, time.perf_counter() - start
        except requests.RequestException:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"the server was not healthy after {timeout:.0f} s (log: {log_path})")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the scheduler processes too
            proc.wait(10)


def server_info(url: str) -> dict[str, Any]:
    r = requests.get(f"{url}/get_server_info", timeout=60)
    r.raise_for_status()
    return r.json()
