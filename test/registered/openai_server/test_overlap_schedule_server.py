"""`--enable-overlap-schedule` end to end (CPU, tiny model): a server with it and one without get the
same requests at once through the official `openai` client (completions of different lengths, one
with a stop string, one with logprobs, a streamed chat) and answer them alike; the overlapped server
really launched its decode steps ahead, and both are at rest and consistent afterwards."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from server_helpers import kill_servers, launch_servers, tiny_checkpoint

openai = pytest.importorskip("openai")  # the GPU machine lacks it; CI installs it (the test extra)

SERVER = ["--device", "cpu", "--max-running-requests", "8"]
PROMPTS = [f"Request {i}: the list of things continues with" for i in range(6)]


def _answers(url: str) -> tuple[list, dict]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

    def completion(i: int):
        kwargs = dict(model="default", prompt=PROMPTS[i], max_tokens=6 + 5 * i, temperature=0)
        if i == 2:
            kwargs["stop"] = [" the"]
        if i == 3:
            kwargs["logprobs"] = 2
        c = client.completions.create(**kwargs).choices[0]
        lps = c.logprobs.token_logprobs if c.logprobs else None
        return c.text, c.finish_reason, lps

    def chat():
        stream = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Count on:"}], max_tokens=12, temperature=0,
            stream=True)
        return "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(completion, i) for i in range(len(PROMPTS))] + [pool.submit(chat)]
        answers = [f.result() for f in futures]
    info = requests.get(f"{url}/get_server_info", timeout=30).json()
    return answers, info


def test_the_overlapped_server_answers_what_the_ordinary_one_does():
    ckpt = tiny_checkpoint("llama")
    names = ("ordinary", "overlap")
    # Both start side by side (each start keeps about one core busy); each then gets the requests
    # alone, the other idle.
    servers = launch_servers(*[dict(model=ckpt, other_args=[*SERVER, extra]) for extra in
                               ("--disable-overlap-schedule", "--enable-overlap-schedule")])
    try:
        results = {name: _answers(url) for name, (_, url) in zip(names, servers)}
    finally:
        kill_servers([proc for proc, _ in servers])
    (ordinary, o_info), (overlap, v_info) = results["ordinary"], results["overlap"]
    for a, b in zip(ordinary[:-1], overlap[:-1]):
        assert a[0] == b[0] and a[1] == b[1], (a, b)
        if a[2] is not None:
            assert b[2] is not None and max(abs(x - y) for x, y in zip(a[2], b[2])) < 1e-4
    assert ordinary[-1] == overlap[-1]
    assert o_info["overlapped_decode_steps"] == 0 and v_info["overlapped_decode_steps"] > 0
    for info in (o_info, v_info):
        assert info["num_running_reqs"] == 0 and info["kv_used_tokens"] == 0
        assert info["last_integrity_check"].get("ok", True)
