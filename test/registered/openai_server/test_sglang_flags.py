"""Everyday SGLang flags, end to end on real servers (CPU): `--chat-template`, `--log-requests`
(`--log-requests-level`), `--enable-cache-report`, `--grammar-backend none`, and the ones refused at
start with a message (`--page-size` above 1, an unknown chat template)."""

from __future__ import annotations

import re

import pytest
import requests
from transformers import AutoTokenizer

from server_helpers import read_log, servers_running, started, tiny_checkpoint
from sglang.srt.server_args import prepare_server_args

TEMPLATE = "{% for m in messages %}{{ '<<' + m['role'] + '>> ' + m['content'] + '\\n' }}{% endfor %}ANSWER:"
SECRET = "the secret prompt words"


@pytest.fixture(scope="module")
def ckpt() -> str:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def servers(ckpt, tmp_path_factory):
    """The two servers below, started side by side (each start keeps about one core busy)."""
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    with servers_running(
        dict(model=ckpt, other_args=["--device", "cpu", "--log-requests", "--served-model-name", "m",
                                     "--grammar-backend", "none"]),
        dict(model=ckpt, other_args=[
            "--device", "cpu", "--served-model-name", "m", "--chat-template", str(path), "--log-requests",
            "--log-requests-level", "2", "--enable-cache-report", "--schedule-policy", "lpm", "--max-top-logprobs",
            "30", "--decode-log-interval", "1",
        ]),
        check_exit=False,
    ) as results:
        yield results


@pytest.fixture(scope="module")
def plain(servers):
    """--log-requests at level 0, no cache report, the tokenizer's own chat template, no grammar backend."""
    return started(servers[0])  # or the error of its start


@pytest.fixture(scope="module")
def custom(servers):
    """A chat template file, --log-requests-level 2, --enable-cache-report, --max-top-logprobs 30 and
    --decode-log-interval 1."""
    return started(servers[1])


def chat(url: str, content: str) -> dict:
    r = requests.post(f"{url}/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 3, "temperature": 0,
    }, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_template_file_replaces_the_tokenizers(ckpt, plain, custom):
    tok = AutoTokenizer.from_pretrained(ckpt)
    messages = [{"role": "user", "content": "hello there"}]
    def prompt_tokens(template: str) -> int:  # what the server does: render, then tokenise as is
        tok.chat_template = template
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(tok(text, add_special_tokens=False)["input_ids"])

    own = prompt_tokens(tok.chat_template)
    ours = prompt_tokens(TEMPLATE)
    assert chat(plain[1], "hello there")["usage"]["prompt_tokens"] == own
    assert chat(custom[1], "hello there")["usage"]["prompt_tokens"] == ours != own


def test_grammar_backend_none_refuses_constraints_saying_how_to_enable(plain):
    url = plain[1]
    for path, body, param in [
        ("/generate", {"text": "hi", "sampling_params": {"regex": "[a-z]+"}}, "regex"),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                  "response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/completions", {"model": "m", "prompt": "hi", "guided_choice": ["a", "b"]}, "guided_choice"),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
                                  "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ]:
        r = requests.post(f"{url}{path}", json=body, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and "--grammar-backend none" in error["message"], error
        assert "--grammar-backend xgrammar" in error["message"] or "pip install xgrammar" in error["message"]
    info = requests.get(f"{url}/get_server_info", timeout=60).json()
    assert info["grammar_backend"] == "none"
    r = requests.post(f"{url}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    assert r.status_code == 200, r.text


def test_add_generation_prompt_is_honoured(ckpt, plain):
    """vLLM's chat extension: false renders the conversation without the assistant's opening."""
    tok = AutoTokenizer.from_pretrained(ckpt)
    messages = [{"role": "user", "content": "hello there"}]
    body = {"model": "m", "messages": messages, "max_tokens": 1, "temperature": 0}
    for flag in (True, False):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=flag)
        r = requests.post(f"{plain[1]}/v1/chat/completions", json={**body, "add_generation_prompt": flag}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(tok(text, add_special_tokens=False)["input_ids"])


def test_max_top_logprobs_bounds_every_route(plain, custom):
    """--max-top-logprobs is the bound of chat's top_logprobs, completions' logprobs and
    /generate's top_logprobs_num alike (20 by default)."""
    requests_by_route = {
        "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                 "logprobs": True, "top_logprobs": 25},
        "/v1/completions": {"model": "m", "prompt": "hi", "max_tokens": 2, "logprobs": 25},
        "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "return_logprob": True,
                      "top_logprobs_num": 25},
    }
    for path, body in requests_by_route.items():
        refused = requests.post(f"{plain[1]}{path}", json=body, timeout=60)
        assert refused.status_code == 400 and "at most 20" in refused.text, (path, refused.text)
        allowed = requests.post(f"{custom[1]}{path}", json=body, timeout=60)
        assert allowed.status_code == 200, (path, allowed.text)
    tops = allowed.json()["meta_info"]["output_top_logprobs"]
    assert [len(t) for t in tops] == [25, 25]


def test_cache_report_only_with_the_flag(plain, custom):
    for _ in range(2):  # the second time the prompt's prefix is cached
        without, with_report = chat(plain[1], "a repeated question"), chat(custom[1], "a repeated question")
    assert without["usage"]["prompt_tokens_details"] is None
    assert with_report["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # /generate reports cached tokens whatever the flag.
    r = requests.post(f"{plain[1]}/generate", json={"text": "a repeated question", "sampling_params": {
        "max_new_tokens": 1}}, timeout=60).json()
    assert "cached_tokens" in r["meta_info"]


def _finished_lines(proc, rid: str) -> list[str]:
    return [ln for ln in read_log(proc).splitlines() if "Finished request:" in ln and f"rid={rid}" in ln]


def test_log_requests_one_line_per_request_and_no_text_below_level_2(plain, custom):
    for (proc, url), rid in ((plain, "log-0"), (custom, "log-2")):
        r = requests.post(f"{url}/generate", json={"text": SECRET, "rid": rid, "sampling_params": {
            "max_new_tokens": 4, "temperature": 0.5, "ignore_eos": True}}, timeout=60)
        assert r.status_code == 200, r.text
    (line0,) = _finished_lines(plain[0], "log-0")
    assert re.search(r"lora=base, prompt_tokens=\d+, cached_tokens=\d+, completion_tokens=4, finish=length", line0)
    assert SECRET not in line0 and "sampling_params" not in line0
    (line2,) = _finished_lines(custom[0], "log-2")
    assert SECRET in line2 and "'temperature': 0.5" in line2 and "completion_tokens=4" in line2
    # A setting of 0 is logged (0 == False in Python; it once dropped temperature 0 and seed 0).
    r = requests.post(f"{custom[1]}/generate", json={"text": "zero", "rid": "log-zero", "sampling_params": {
        "max_new_tokens": 3, "temperature": 0, "seed": 0, "ignore_eos": True}}, timeout=60)
    assert r.status_code == 200, r.text
    (line,) = _finished_lines(custom[0], "log-zero")
    assert "'temperature': 0" in line and "'seed': 0" in line, line


def test_decode_log_lines_describe_the_step_that_ran(custom):
    """--decode-log-interval 1: each line's #token is the KV of the step it reports, read before
    the requests that finished in it gave theirs back (the last step once read 0)."""
    r = requests.post(f"{custom[1]}/generate", json={"text": "count the steps", "sampling_params": {
        "max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}, timeout=60)
    assert r.status_code == 200, r.text
    lines = [ln for ln in read_log(custom[0]).splitlines() if "Decode batch, #running-req: " in ln]
    assert lines
    for ln in lines:
        running, used = map(int, re.search(r"#running-req: (\d+), #token: (\d+)", ln).groups())
        assert used >= running > 0, ln


@pytest.mark.parametrize("argv, needle", [
    (["--page-size", "16"], "--page-size 16 is not supported"),
    (["--chat-template", "no-such-template"], "built-ins: chatml, llama-3-instruct, mistral"),
    (["--schedule-policy", "lof"], "invalid choice"),
])
def test_refused_at_start_with_a_message(argv, needle, capsys):
    with pytest.raises((ValueError, SystemExit)) as e:
        prepare_server_args(["--model-path", "demo", *argv])
    assert needle in (str(e.value) + capsys.readouterr().err)
    assert prepare_server_args(["--model-path", "demo", "--page-size", "1"]).page_size == 1
