"""Event and body text that line splitters break (the 55-minute soak's two unparsable events).

U+0085, U+2028 and U+2029 are line ends for Python's `str.splitlines()`, so for `requests`'
`iter_lines(decode_unicode=True)`, which the soak's worker (and many users' scripts) read streams
with; `json.dumps(ensure_ascii=False)` leaves them raw. To get them into every kind of event
deterministically, the server runs a checkpoint that always emits one added token whose text is
the three characters: the embedding gives every token the same vector, every layer adds nothing
(o_proj and down_proj are zero), and the lm_head scores only that token. Checked on `/generate`,
`/v1/completions` (with `echo` of a prompt that holds them too) and `/v1/chat/completions`:
  - read as the soak's worker read them, every `data:` line is whole JSON, and the decoded text
    holds the characters (the server escapes them: JSON stays valid, the text is the same);
  - `sglang.sse.sse_lines` (CR / LF / CRLF only, what the soak's worker uses now) yields the same
    events;
  - non-streaming bodies, logprob token texts and an error message that echoes the request are one
    line each, and decode to the same text.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import requests
import torch

from server_helpers import cache_dir_for_tests, kill_server, popen_launch_server, server_env, tiny_checkpoint
from sglang.sse import iter_sse_lines, sse_lines

BREAKERS = "\u0085\u2028\u2029"


def always_emits_breakers_checkpoint() -> str:
    """A tiny Llama whose greedy output is the added token BREAKERS, forever (built once)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = os.path.join(cache_dir_for_tests(), "tiny-llama-emits-line-breakers-v1")
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(tiny_checkpoint("llama"), tmp)
    tokenizer = AutoTokenizer.from_pretrained(tmp)
    tokenizer.add_tokens([BREAKERS])
    tokenizer.save_pretrained(tmp)
    token = tokenizer.convert_tokens_to_ids(BREAKERS)
    model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    assert token < model.config.vocab_size and not model.config.tie_word_embeddings
    with torch.no_grad():
        e = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
        model.model.embed_tokens.weight.copy_(e.expand_as(model.model.embed_tokens.weight))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[token] = e / e.norm() * 30.0
    model.save_pretrained(tmp)
    os.replace(tmp, path)
    return path


@pytest.fixture(scope="module")
def server():
    proc, url = popen_launch_server(always_emits_breakers_checkpoint(), ["--device", "cpu", "--served-model-name", "m"],
                                    env=server_env())
    try:
        yield url
    finally:
        kill_server(proc)


PROMPT = f"say{BREAKERS}it"
STREAMS = {
    "/generate": {"text": PROMPT, "stream": True, "return_logprob": True, "logprob_start_len": 0,
                  "return_text_in_logprobs": True, "top_logprobs_num": 2,
                  "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
    "/v1/completions": {"model": "m", "prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 4,
                        "temperature": 0, "stream": True},
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4,
                             "temperature": 0, "logprobs": True, "top_logprobs": 2, "stream": True},
}


def _text_of(event: dict) -> str:
    if "choices" not in event:
        return event["text"]
    return "".join((c.get("text") or (c.get("delta") or {}).get("content") or "") for c in event["choices"])


@pytest.mark.parametrize("route", list(STREAMS))
def test_stream_events_survive_splitlines_readers(server, route):
    body = STREAMS[route]
    with requests.post(server + route, json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        raw = r.content
    # The soak worker's way: iter_lines(decode_unicode=True), i.e. str.splitlines().
    split = [ln for ln in raw.decode("utf-8").splitlines() if ln.startswith("data: ") and ln != "data: [DONE]"]
    events = [json.loads(ln[6:]) for ln in split]  # a fragment would raise here
    texts = [_text_of(e) for e in events]
    assert BREAKERS in "".join(texts) or BREAKERS in texts[-1], texts
    if route == "/v1/completions":
        assert PROMPT in "".join(texts)  # the echo
    # The SSE standard's way gives the same events.
    standard = [json.loads(ln[6:]) for ln in iter_sse_lines([raw]) if ln.startswith("data: ") and ln != "data: [DONE]"]
    assert standard == events
    assert not any(ch in raw.decode("utf-8") for ch in BREAKERS), "raw line breakers in the stream"


def test_the_soak_reader_streams_a_live_response(server):
    with requests.post(server + "/generate", json=STREAMS["/generate"], stream=True, timeout=120) as r:
        lines = [ln for ln in sse_lines(r) if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][6:])
    assert last["text"] == BREAKERS * 4 and last["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize("route", list(STREAMS))
def test_bodies_are_one_line_and_decode_to_the_same_text(server, route):
    body = dict(STREAMS[route], stream=False)
    r = requests.post(server + route, json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert len(r.text.splitlines()) == 1, "a line breaker left raw in the body"
    out = r.json()
    text = out["text"] if route == "/generate" else (out["choices"][0].get("text")
                                                     or out["choices"][0]["message"]["content"])
    assert BREAKERS * 4 in text
    if route == "/generate":  # logprob token texts: the prompt's and the output's
        tokens = [t[2] for t in out["meta_info"]["output_token_logprobs"]]
        assert tokens == [BREAKERS] * 4


def test_error_message_that_echoes_input_is_one_line(server):
    name = f"no{BREAKERS}such"
    r = requests.post(server + "/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 404, r.text
    assert len(r.text.splitlines()) == 1
    assert name in r.json()["error"]["message"]


def test_sse_line_splitting_follows_the_standard():
    """CR, LF and CRLF end a line (also split across chunks); U+2028 and friends do not."""
    stream = f"data: a{BREAKERS}b\r\ndata: c\rdata: d\n\ndata: é".encode()
    for cut in range(len(stream) + 1):  # every way of cutting the bytes into two chunks
        lines = list(iter_sse_lines([stream[:cut], stream[cut:]]))
        assert lines == [f"data: a{BREAKERS}b", "data: c", "data: d", "", "data: é"], (cut, lines)
