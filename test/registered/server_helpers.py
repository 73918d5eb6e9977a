"""Start `python -m sglang.launch_server` as a subprocess for end-to-end tests.

    proc, base_url = popen_launch_server("demo", other_args=["--device", "cpu"])
    ...
    kill_server(proc)

stdout and stderr go to files (`proc.stdout_path`, `proc.stderr_path`), so a test can grep the
log (`read_log(proc)`); the server runs on a free port and the helper waits for `/health`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Iterator, Optional, Sequence

import requests

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYTHON_DIR = os.path.join(ROOT, "python")
DEFAULT_TIMEOUT_S = 180.0


def _has_cuda() -> bool:
    import torch  # local: the helper is imported by tests that may never start a server

    return torch.cuda.is_available()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def popen_launch_server(
    model: str = "demo",
    other_args: Sequence[str] = (),
    timeout: float = DEFAULT_TIMEOUT_S,
    env: Optional[dict[str, str]] = None,
    api_key: Optional[str] = None,
    log_dir: Optional[str] = None,
) -> tuple[subprocess.Popen, str]:
    """Launch a server on a free port and wait until `/health` answers 200.

    Returns (process, base_url). The process has `stdout_path` / `stderr_path` attributes. Raises
    RuntimeError with the log tail if the server dies or does not become healthy in time.
    """
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--host", "127.0.0.1",
           "--port", str(port), *other_args]
    if api_key:
        cmd += ["--api-key", api_key]
    run_env = dict(os.environ)
    run_env["PYTHONPATH"] = PYTHON_DIR + os.pathsep + run_env.get("PYTHONPATH", "")
    if not _has_cuda():  # a GPU server must compile its kernels (the H200 run of 2026-11-30 interpreted them)
        run_env.setdefault("TRITON_INTERPRET", "1")
    run_env.update(env or {})
    owned_log_dir = None if log_dir else tempfile.mkdtemp(prefix="sglang-server-")
    log_dir = log_dir or owned_log_dir
    out_path = os.path.join(log_dir, "stdout.log")
    err_path = os.path.join(log_dir, "stderr.log")
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        # A new session: teardown can signal the server and its scheduler child as one group.
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=run_env, start_new_session=True)
    proc.stdout_path, proc.stderr_path = out_path, err_path  # type: ignore[attr-defined]
    proc.owned_log_dir = owned_log_dir  # type: ignore[attr-defined]  (removed by kill_server on a clean exit)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}:\n{read_log(proc)[-4000:]}")
        try:
            if requests.get(f"{base_url}/health", headers=headers, timeout=2).status_code == 200:
                return proc, base_url
        except requests.RequestException:
            pass
        time.sleep(0.3)
    kill_server(proc)
    raise RuntimeError(f"the server did not become healthy in {timeout:.0f} s:\n{read_log(proc)[-4000:]}")


def launch_servers(*launches: dict, return_exceptions: bool = False) -> list:
    """popen_launch_server(**kwargs) for each of `launches`, all at once; (process, base_url) of each,
    in order. A server's start (imports, tokenizer loads, a Python process per rank) keeps about one
    core busy, so on the 2-core CPU machine two starts side by side take about 8 s against 11 s one
    after the other. If one fails, the others are stopped and its error raised; with
    `return_exceptions`, its error takes its place in the list instead (for the fixture of the tests
    that use that server to raise) and the others keep running."""
    from concurrent.futures import ThreadPoolExecutor

    if not launches:
        return []
    with ThreadPoolExecutor(len(launches)) as pool:
        futures = [pool.submit(popen_launch_server, **kwargs) for kwargs in launches]
    results = [f.exception() or f.result() for f in futures]
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors and not return_exceptions:
        kill_servers(running(results))
        raise errors[0]
    return results


def session_runs(request, test_name: str) -> bool:
    """Whether this session runs the test function `test_name` (or the test `test_name[id]` of a
    parametrized one) of the module asking, after -k and node-id selection: a fixture that starts a
    server for it beside others can leave it out."""
    return any(item.module is request.module and test_name in (getattr(item, "originalname", None), item.name)
               for item in request.session.items)


@contextlib.contextmanager
def servers_for_tests(request, launches: dict[str, dict]) -> Iterator[dict]:
    """For a module whose tests each need a fresh server of their own (one they stop or kill):
    {test name (`test_x` or `test_x[id]`): launch_servers(return_exceptions=True) entry} for those of
    `launches` (test name -> popen_launch_server's arguments) that the session runs, all started
    side by side up front. A test takes its own with started(servers[request.node.name]); what is
    left running at the end is stopped (servers_running, no exit code required)."""
    wanted = {name: kwargs for name, kwargs in launches.items() if session_runs(request, name)}
    with servers_running(*wanted.values(), check_exit=False) as results:
        yield dict(zip(wanted, results))


def started(result):
    """A launch_servers(return_exceptions=True) entry: (process, base_url), or its error raised."""
    if isinstance(result, BaseException):
        raise result
    return result


def running(results: Sequence) -> list[subprocess.Popen]:
    """The processes of launch_servers(return_exceptions=True) results that started."""
    return [r[0] for r in results if not isinstance(r, BaseException)]


def kill_servers(procs: Sequence[subprocess.Popen]) -> list[int]:
    """kill_server for each of `procs`, all at once (each one's exit is mostly interpreter clean-up,
    a core's worth of work); their exit codes, in order."""
    from concurrent.futures import ThreadPoolExecutor

    if not procs:
        return []
    with ThreadPoolExecutor(len(procs)) as pool:
        return list(pool.map(kill_server, procs))


@contextlib.contextmanager
def servers_running(*launches: dict, check_exit: bool = True) -> Iterator[list]:
    """launch_servers(*launches, return_exceptions=True) for the body (a module fixture yields the
    list; a test takes its server with started(...)), then every server that started is stopped
    together; with `check_exit`, each must exit cleanly (a test that stops its own passes False)."""
    results = launch_servers(*launches, return_exceptions=True)
    try:
        yield results
    finally:
        procs = running(results)
        codes = kill_servers(procs)
        if check_exit:
            for proc, code in zip(procs, codes):
                assert code == 0, read_log(proc)[-3000:]


def read_log(proc: subprocess.Popen) -> str:
    text = ""
    for path in (getattr(proc, "stdout_path", None), getattr(proc, "stderr_path", None)):
        if path and os.path.exists(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                text += f.read()
    return text


def kill_server(proc: subprocess.Popen, timeout: float = 20.0) -> int:
    """SIGTERM (a clean shutdown that reaps the scheduler), then SIGKILL the whole group if needed.
    Returns the exit code. The log folder the helper made is removed after a clean exit (code 0)
    unless SGLANG_TEST_KEEP_LOGS=1; a server that failed keeps its logs for the report."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group (normally nothing)
    except (ProcessLookupError, PermissionError):
        pass
    code = proc.wait(10)
    owned = getattr(proc, "owned_log_dir", None)
    if code == 0 and owned and os.environ.get("SGLANG_TEST_KEEP_LOGS") != "1":
        shutil.rmtree(owned, ignore_errors=True)
    return code


def group_alive(proc: subprocess.Popen) -> bool:
    """Whether any process of the server's process group is still running."""
    try:
        os.killpg(proc.pid, 0)
        return True
    except ProcessLookupError:
        return False


# ---------------------------------------------------------------------------- checkpoints
def cache_dir_for_tests() -> str:
    """Where tests keep the demo model and tiny checkpoints between runs (contents are
    deterministic, so reusing them is safe)."""
    path = os.environ.get("SGLANG_TEST_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "sglang-test-cache")
    os.makedirs(path, exist_ok=True)
    return path


def tiny_checkpoint(arch: str = "qwen3", seed: int = 0, **overrides) -> str:
    """A tiny random checkpoint (with tokenizer and chat template) made by make_checkpoint, built
    once per machine for each distinct argument set (`overrides` are config fields)."""
    import hashlib
    import json

    from sglang.srt.tools.demo import materialize_once
    from sglang.srt.tools.make_checkpoint import make_checkpoint

    name = f"tiny-{arch}-seed{seed}"
    if overrides:
        key = json.dumps(overrides, sort_keys=True, default=repr).encode()
        name += "-" + hashlib.sha1(key).hexdigest()[:10]
    path = os.path.join(cache_dir_for_tests(), name)
    materialize_once(
        path,
        lambda tmp: make_checkpoint(tmp, arch=arch, preset="tiny", seed=seed, with_weights=True, **overrides),
    )
    return path


def server_env() -> dict[str, str]:
    """Environment for test servers: the demo model goes to the shared test cache."""
    return {"SGLANG_CACHE_DIR": cache_dir_for_tests()}
