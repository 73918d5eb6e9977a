"""QA pass (Dec 07) on a real CPU LoRA server: an empty adapter name in `lora_path` on the OpenAI
routes.

`/generate` refuses `"lora_path": ""` (or a batch entry "") as a malformed value: 400 naming
`lora_path`. `/v1/completions` and `/v1/chat/completions` with `model` naming the base model used
to answer 404 "The model `default:` does not exist. The following requested LoRA adapters are not
loaded: ." -- a model the client never asked for, an empty adapter list, and the status of an
unknown model for what is a malformed field. They now refuse it as `/generate` does.

One server (tiny Llama, one rank-4 PEFT adapter written by `peft`) serves the whole module.
"""

from __future__ import annotations

import pytest
import requests

from lora_server_testlib import write_adapter
from server_helpers import kill_server, popen_launch_server, read_log


@pytest.fixture(scope="module")
def server(lora_ckpt, tmp_path_factory):
    adapter = write_adapter(lora_ckpt, str(tmp_path_factory.mktemp("qa-dec07") / "r4"), r=4, seed=11)
    proc, url = popen_launch_server(model=lora_ckpt, other_args=[
        "--device", "cpu", "--dtype", "float32", "--lora-backend", "torch_native",
        "--lora-paths", f"r4={adapter}"])
    yield url
    assert kill_server(proc) == 0, read_log(proc)[-3000:]


def _assert_lora_path_400(resp: requests.Response) -> None:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == "lora_path" and error["code"] == 400
    assert error["type"] == "invalid_request_error"
    assert "does not exist" not in error["message"], error["message"]


@pytest.mark.parametrize("model", ["default", "<served>"])
@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "Hello", "lora_path": ""}),
    ("/v1/completions", {"prompt": ["Hello", "world"], "lora_path": ["r4", ""]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "lora_path": ""}),
], ids=["completions", "completions-batch", "chat"])
def test_empty_lora_path_is_a_400_naming_lora_path(server, lora_ckpt, model, route, body):
    model = lora_ckpt if model == "<served>" else model
    resp = requests.post(f"{server}{route}", json={"model": model, "max_tokens": 2, **body}, timeout=60)
    _assert_lora_path_400(resp)
    # The server keeps serving, adapters included.
    assert requests.get(f"{server}/health", timeout=10).status_code == 200
    ok = requests.post(f"{server}/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 2,
                                                        "lora_path": "r4"}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_generate_refuses_the_same_value(server):
    # The native route's answer, which the OpenAI routes now match.
    resp = requests.post(f"{server}/generate", json={"text": "Hello", "lora_path": "",
                                                     "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    _assert_lora_path_400(resp)
