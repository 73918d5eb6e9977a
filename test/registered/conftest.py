"""Shared pytest setup: the import path, Triton kernels interpreted on CPU-only machines (GPU tests
skipped there), and the fixtures several suites share."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# The package, then every suite's folder: suites share helper modules (helpers.py,
# lora/lora_server_testlib.py, reliability/reliability_lib.py, distributed/tp_testlib.py, ...) by
# plain import. Rank processes started with `spawn` inherit this path.
sys.path.insert(0, os.path.join(ROOT, "python"))
for _suite in ("lora", "reliability", "distributed", "unit", "cuda_graph"):
    sys.path.insert(0, os.path.join(HERE, _suite))
sys.path.insert(0, HERE)

import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must be set before triton is first imported; server subprocesses inherit it.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ---------------------------------------------------------------------------- shared fixtures
@pytest.fixture(scope="module")
def lora_ckpt() -> str:
    """The tiny Llama checkpoint (float32, peaked predictions) the LoRA server suites serve."""
    from lora_server_testlib import tiny_lora_checkpoint

    return tiny_lora_checkpoint("llama")


@pytest.fixture(scope="module")
def adapter_zoo(lora_ckpt, tmp_path_factory, request) -> dict[str, str]:
    """lora_server_testlib.write_adapter_zoo for `lora_ckpt`: good adapters and every kind of bad
    one, by name. A module's ADAPTER_ZOO_SEED gives it adapters of its own."""
    from lora_server_testlib import write_adapter_zoo

    seed = getattr(request.module, "ADAPTER_ZOO_SEED", 31)
    return write_adapter_zoo(lora_ckpt, str(tmp_path_factory.mktemp("adapter-zoo")), seed=seed)


@pytest.fixture(scope="module")
def zoo_server(lora_ckpt, adapter_zoo, request):
    """(process, url) of a CPU server (float32, torch_native LoRA) whose pool fits the zoo's good
    adapters (3 slots, rank 16, lora_server_testlib.POOL_MODULES), serving `keep` from the start.
    A module's ZOO_SERVER_FLAGS are added to the command line."""
    from lora_server_testlib import zoo_server_launch
    from server_helpers import kill_server, popen_launch_server, read_log

    proc, url = popen_launch_server(**zoo_server_launch(lora_ckpt, adapter_zoo, request.module))
    yield proc, url
    assert kill_server(proc) == 0, read_log(proc)[-3000:]


@pytest.fixture(scope="module")
def offline_tokenizer_manager():
    """A real TokenizerManager over the tiny Qwen3 checkpoint whose scheduler client is never
    started: for what the manager does before a request reaches a scheduler."""
    from server_helpers import tiny_checkpoint
    from sglang.srt.managers.scheduler_client import SchedulerClient
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.server_configs import build_run_configs

    configs = build_run_configs(ServerArgs(model_path=tiny_checkpoint("qwen3"), device="cpu"))
    client = SchedulerClient(configs.scheduler, configs.tp)
    return TokenizerManager(configs.tokenizer_manager, client,
                            {"context_len": 256, "max_total_num_tokens": 512, "vocab_size": 512})


# ---------------------------------------------------------------------------- echo tool servers
def _echo_flags(item):
    flags = getattr(getattr(item, "module", None), "ECHO_SERVER_FLAGS", None)
    return None if flags is None or "echo_server" not in getattr(item, "fixturenames", ()) else tuple(flags)


class _EchoServers:
    """The echo checkpoint's servers (echo_checkpoint.py) of the session's tool-calling modules,
    one per distinct ECHO_SERVER_FLAGS, started side by side (server_helpers.launch_servers) when
    the first of those modules needs one, and stopped together after the last of them."""

    def __init__(self, session) -> None:
        from echo_checkpoint import echo_checkpoint
        from server_helpers import launch_servers

        self.items = session.items
        self.configs = list(dict.fromkeys(f for f in map(_echo_flags, self.items) if f is not None))
        results = launch_servers(*[dict(model=echo_checkpoint(), other_args=["--device", "cpu", *flags])
                                   for flags in self.configs], return_exceptions=True)
        self.results = dict(zip(self.configs, results))
        self.stopped = False

    def stop(self) -> None:
        from server_helpers import kill_servers, read_log, running

        if self.stopped:
            return
        self.stopped = True
        procs = running(self.results.values())
        bad = [read_log(p)[-3000:] for p, code in zip(procs, kill_servers(procs)) if code != 0]
        assert not bad, bad[0]

    def last_user(self, module) -> bool:
        """Whether `module` holds the session's last test that needs one of these servers."""
        users = [item for item in self.items if _echo_flags(item) is not None]
        return bool(users) and users[-1].module is module


@pytest.fixture(scope="session")
def echo_servers(request):
    servers = _EchoServers(request.session)
    yield servers
    servers.stop()  # normally done already, by the last module that used them


@pytest.fixture(scope="module")
def echo_server(echo_servers, request) -> str:
    """The URL of an echo-checkpoint CPU server with the module's ECHO_SERVER_FLAGS (modules with the
    same flags share it; see _EchoServers)."""
    from server_helpers import started

    _, url = started(echo_servers.results[tuple(request.module.ECHO_SERVER_FLAGS)])  # or its start's error
    yield url
    if echo_servers.last_user(request.module):
        echo_servers.stop()
