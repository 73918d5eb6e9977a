"""The soak: worker threads hammer a live server with mixed traffic while adapters are loaded and
unloaded, then everything must be given back (shared by the CPU test and the GPU run).

Traffic, chosen at random per request: native `/generate` (token ids, sometimes with logprobs) and
OpenAI completions and chat (text), streaming or not, on a random adapter or the base model, with
random prompt and output lengths. Some clients close the connection mid-stream or give up on a
non-streaming request (client-side aborts), some abort their own request through
`/abort_request`. One thread loads and unloads a cycling adapter the whole time; requests that pick
it while it is unloaded are refused with a 4xx naming it (counted apart, allowed only for it).
Every other request must complete normally; any 5xx, any other 4xx, an error event in a stream or
a connection the server dropped fails the soak.
The prefix cache is on: half the prompts start with one of a few shared prefixes (a "system
prompt"), some `/generate` requests continue the last finished conversation (its prompt and
output, then new tokens: a multi-turn chat) or ask for two samples of one prompt (`n=2`), and
some requests carry a `cache_salt`, so prefixes are
reused, evicted, and kept apart by adapter and salt while everything else happens.
"""

from __future__ import annotations

import json
import os
import random
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import requests

from sglang.sse import sse_lines

WORDS = ("the quick brown fox jumps over a lazy dog while seven bright engines hum softly under "
         "pale winter skies and small adapters learn new tricks every single morning").split()


# U+0085, U+2028, U+2029: line ends for str.splitlines(), never for the SSE standard.
LINE_BREAKERS = "split\u0085here\u2028and\u2029here"

# The shared prefixes (token ids for /generate, words for the OpenAI routes).
_prefix_rng = random.Random(1234)
SHARED_IDS = [[_prefix_rng.randrange(3, 480) for _ in range(600)] for _ in range(3)]
SHARED_TEXTS = [" ".join(_prefix_rng.choice(WORDS) for _ in range(200)) for _ in range(3)]


@dataclass
class SoakConfig:
    url: str
    duration: float
    adapters: list[str]  # always loaded
    cycling: dict[str, str]  # name -> path: loaded and unloaded in a loop
    vocab: int = 480  # token ids for /generate are drawn below this
    workers: int = 8
    prompt_tokens: tuple[int, int] = (4, 120)
    prompt_words: tuple[int, int] = (2, 60)
    max_new_tokens: tuple[int, int] = (1, 48)
    model: str = "default"
    request_timeout: float = 300.0
    seed: int = 0


@dataclass
class SoakStats:
    counts: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    # How long each completed request waited, counted in the soak's own progress: the requests
    # (of every outcome) that ended while it ran. A loaded machine slows every request alike, so
    # this count stays put where a wall-clock latency grows; a starved request, waiting until the
    # load stops, sees most of the run's requests end.
    ended: int = 0  # requests ended so far
    ended_meanwhile: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: str, kind: str, latency: Optional[float] = None, detail: str = "",
            since: Optional[int] = None) -> None:
        """`since`: `ended` when the request began (completed requests)."""
        with self.lock:
            self.counts[outcome] += 1
            self.counts[f"{outcome}:{kind}"] += 1
            if latency is not None:
                self.latencies.append(latency)
            if since is not None:
                self.ended_meanwhile.append(self.ended - since)
            if outcome == "failed" and len(self.failures) < 50:
                self.failures.append(f"{kind}: {detail[:400]}")

    def request_ended(self) -> None:
        with self.lock:
            self.ended += 1


class Soak:
    def __init__(self, cfg: SoakConfig) -> None:
        self.cfg = cfg
        self.stats = SoakStats()
        self.stop = threading.Event()
        self.loaded: set[str] = set()  # cycling adapters currently loaded
        # The last finished /generate (token ids with its output, adapter, salt): a later request
        # may continue it, as the next turn of a chat does.
        self.conversation: Optional[tuple[list[int], Optional[str], Optional[str]]] = None

    # ------------------------------------------------------------------ one request
    def _choose_adapter(self, rng: random.Random) -> Optional[str]:
        pool: list[Optional[str]] = [None, *self.cfg.adapters, *self.cfg.cycling]
        return rng.choice(pool)

    def _body(self, rng: random.Random, kind: str, lora: Optional[str]) -> tuple[str, dict]:
        cfg = self.cfg
        n = rng.randint(*cfg.max_new_tokens)
        # Half the prompts start with a shared prefix, most of them with the same one (a popular
        # system prompt: some request using it is usually running, so its KV stays cached).
        shared = rng.random() < 0.5
        stem = 0 if rng.random() < 0.7 else rng.randrange(1, len(SHARED_IDS))
        salt = None if shared else rng.choice([None, None, "tenant-1", "tenant-2"])
        # A shared prefix replaces the start of a prompt: prompt lengths keep their distribution.
        if kind == "generate":
            length = rng.randint(*cfg.prompt_tokens)
            ids = [rng.randrange(3, cfg.vocab) for _ in range(length)]
            conv = self.conversation
            if conv is not None and rng.random() < 0.5 and len(conv[0]) < cfg.prompt_tokens[1]:
                ids, lora, salt = (conv[0] + ids[:8])[: cfg.prompt_tokens[1]], conv[1], conv[2]  # the next turn
            elif shared:
                ids = (SHARED_IDS[stem][: cfg.prompt_tokens[1] // 2] + ids)[:length]
            body: dict[str, Any] = {"input_ids": ids, "lora_path": lora, "cache_salt": salt,
                                    "sampling_params": {"max_new_tokens": n, "temperature": rng.choice([0, 0.8]),
                                                        "ignore_eos": rng.random() < 0.7}}
            if rng.random() < 0.3:
                body.update(return_logprob=True, logprob_start_len=rng.choice([-1, 0]), top_logprobs_num=2)
            if rng.random() < 0.1:
                body["sampling_params"]["n"] = 2  # two samples, one prompt: the second reuses its KV
            return "/generate", body
        length = rng.randint(*cfg.prompt_words)
        words = [rng.choice(WORDS) for _ in range(length)]
        if rng.random() < 0.05:
            words.append(LINE_BREAKERS)  # characters str.splitlines() splits at: the reader must not
        if shared:
            words = (SHARED_TEXTS[stem].split()[: cfg.prompt_words[1] // 2] + words)[:length]
        text = " ".join(words)
        model = cfg.model if lora is None else f"{cfg.model}:{lora}"
        common = {"model": model, "max_tokens": n, "temperature": rng.choice([0, 0.8]), "ignore_eos": True,
                  "cache_salt": salt}
        if kind == "completions":
            return "/v1/completions", {**common, "prompt": text, "logprobs": rng.choice([None, 2]),
                                       "echo": rng.random() < 0.2}
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": text}]}

    def one_request(self, rng: random.Random) -> None:
        kind = rng.choice(["generate", "generate", "completions", "chat"])
        lora = self._choose_adapter(rng)
        path, body = self._body(rng, kind, lora)
        mode = rng.choices(["plain", "stream", "stream_close", "plain_timeout", "rid_abort"],
                           weights=[35, 35, 15, 5, 10])[0]
        if mode == "rid_abort" and kind != "generate":
            mode = "stream_close"
        stream = mode in ("stream", "stream_close", "rid_abort")
        body["stream"] = stream
        rid = f"soak-{rng.getrandbits(48):x}"
        if mode == "rid_abort":
            body["sampling_params"].pop("n", None)  # one rid names one request
            body["rid"] = rid
            body["sampling_params"]["max_new_tokens"] = max(body["sampling_params"]["max_new_tokens"], 24)
        timeout = 0.3 + rng.random() if mode == "plain_timeout" else self.cfg.request_timeout
        label = f"{kind}/{mode}"
        t0, since = time.monotonic(), self.stats.ended
        try:
            r = requests.post(f"{self.cfg.url}{path}", json=body, stream=stream, timeout=timeout)
        except requests.exceptions.ReadTimeout:
            if mode == "plain_timeout":
                return self.stats.add("client_abort", label)
            return self.stats.add("failed", label, detail="read timeout")
        except requests.RequestException as e:
            return self.stats.add("failed", label, detail=repr(e))
        if r.status_code != 200:
            return self._refused(r, label, lora)
        if not stream:
            return self._check_reply(r, label, kind, t0, body, since)
        try:
            self._consume_stream(r, label, mode, rid, rng, t0, body, since)
        finally:
            r.close()

    def _refused(self, r: requests.Response, label: str, lora: Optional[str]) -> None:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text
        if r.status_code in (400, 404) and lora in self.cfg.cycling and f"not loaded: {lora}" in message:
            return self.stats.add("refused_unloaded_adapter", label)
        self.stats.add("failed", label, detail=f"HTTP {r.status_code}: {message}")

    def _check_reply(self, r: requests.Response, label: str, kind: str, t0: float, body: dict, since: int) -> None:
        out = r.json()
        if kind == "generate":
            outs = out if isinstance(out, list) else [out]  # n=2 gives a list
            reasons = [o["meta_info"]["finish_reason"] for o in outs]
        else:
            reasons = [c["finish_reason"] for c in out["choices"]]
        if not all(reasons) or any(isinstance(x, dict) and x.get("type") == "abort" for x in reasons):
            return self.stats.add("failed", label, detail=f"unfinished reply {str(out)[:300]}")
        if kind == "generate":
            self._remember(body, outs[0]["output_ids"])
        self.stats.add("ok", label, time.monotonic() - t0, since=since)

    def _remember(self, body: dict, output_ids: list[int]) -> None:
        if body["lora_path"] not in self.cfg.cycling:  # the cycling adapter may be gone next turn
            self.conversation = (body["input_ids"] + output_ids, body["lora_path"], body["cache_salt"])

    def _consume_stream(self, r: requests.Response, label: str, mode: str, rid: str, rng: random.Random,
                        t0: float, body: dict, since: int) -> None:
        close_after = rng.randint(1, 6) if mode == "stream_close" else None
        abort_after = rng.randint(1, 4) if mode == "rid_abort" else None
        events, done, finish, last = 0, False, None, {}
        try:
            for line in sse_lines(r):  # CR / LF / CRLF only, as the SSE standard splits lines
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    return self.stats.add("failed", label, detail=f"error event {event['error']}")
                events += 1
                finish = _finish_of(event) or finish
                last = event
                if close_after is not None and events >= close_after and finish is None:
                    return self.stats.add("client_abort", label)  # the caller closes the connection
                if abort_after is not None and events == abort_after and finish is None:
                    a = requests.post(f"{self.cfg.url}/abort_request", json={"rid": rid}, timeout=60)
                    if a.status_code != 200:
                        return self.stats.add("failed", label, detail=f"/abort_request: HTTP {a.status_code}")
        except requests.RequestException as e:
            return self.stats.add("failed", label, detail=f"the stream broke: {e!r}")
        if not done or finish is None:
            return self.stats.add("failed", label, detail=f"stream ended without [DONE] or a finish ({events} events)")
        if finish == "abort":
            return self.stats.add("rid_abort" if mode == "rid_abort" else "failed", label, detail="aborted")
        if "output_ids" in last:  # a native /generate stream: its last event holds every token
            self._remember(body, last["output_ids"])
        self.stats.add("ok", label, time.monotonic() - t0, since=since)

    # ------------------------------------------------------------------ threads
    def worker(self, k: int) -> None:
        rng = random.Random(self.cfg.seed * 1000 + k)
        while not self.stop.is_set():
            try:
                self.one_request(rng)
            except Exception as e:  # noqa: BLE001 - a bug of the soak itself, or a reply not JSON
                self.stats.add("failed", "worker", detail=repr(e))
            finally:
                self.stats.request_ended()

    def cycler(self) -> None:
        rng = random.Random(self.cfg.seed + 7)
        while not self.stop.is_set():
            for name, path in self.cfg.cycling.items():
                r = requests.post(f"{self.cfg.url}/load_lora_adapter", json={"lora_name": name, "lora_path": path},
                                  timeout=300)
                self.stats.add("adapter_load" if r.status_code == 200 else "failed", "load", detail=r.text)
                self.loaded.add(name)
                time.sleep(rng.uniform(0.3, 1.5))
                r = requests.post(f"{self.cfg.url}/unload_lora_adapter", json={"lora_name": name}, timeout=300)
                self.stats.add("adapter_unload" if r.status_code == 200 else "failed", "unload", detail=r.text)
                self.loaded.discard(name)
                time.sleep(rng.uniform(0.1, 0.8))

    def run(self) -> dict[str, Any]:
        threads = [threading.Thread(target=self.worker, args=(k,), daemon=True) for k in range(self.cfg.workers)]
        if self.cfg.cycling:
            threads.append(threading.Thread(target=self.cycler, daemon=True))
        t0 = time.monotonic()
        for t in threads:
            t.start()
        self.stop.wait(self.cfg.duration)
        self.stop.set()
        for t in threads:
            t.join(self.cfg.request_timeout + 60)
        hung = sum(t.is_alive() for t in threads)
        if hung:
            self.stats.add("failed", "thread", detail=f"{hung} client thread(s) never returned")
        lat = sorted(self.stats.latencies)
        meanwhile = sorted(self.stats.ended_meanwhile)
        return {
            "load_seconds": round(time.monotonic() - t0, 1),
            "counts": dict(sorted(self.stats.counts.items())),
            "latency_s": {"p50": _pct(lat, 0.5), "p99": _pct(lat, 0.99), "max": lat[-1] if lat else None},
            "requests_ended": self.stats.ended,
            "ended_meanwhile": {"p50": _pct(meanwhile, 0.5), "p99": _pct(meanwhile, 0.99),
                                "max": meanwhile[-1] if meanwhile else None},
            "failures": list(self.stats.failures),
        }


def _finish_of(event: dict) -> Optional[str]:
    if "meta_info" in event:  # native /generate
        reason = event["meta_info"]["finish_reason"]
        return None if reason is None else reason.get("type")
    for choice in event.get("choices") or []:
        if choice.get("finish_reason"):
            return choice["finish_reason"]
    return None


def _pct(values: list[float], q: float) -> Optional[float]:
    return round(values[min(len(values) - 1, int(q * len(values)))], 3) if values else None


def count_retractions(log: str) -> int:
    return sum(int(n) for n in re.findall(r"Retract requests\. #retracted-req: (\d+)", log))


def final_report(url: str, log: str, load: dict[str, Any], wait_idle: Callable[[str], dict]) -> dict[str, Any]:
    """Wait for idle and gather what the server says about itself."""
    info = wait_idle(url)
    return {
        **load,
        "retractions_in_log": count_retractions(log),
        "num_retractions": info["num_retractions"],
        "num_forward_failures": info["num_forward_failures"],
        "num_finished": info["num_finished"],
        "graph_stats": info["graph_stats"],
        "lora": {k: info["lora"][k] for k in ("num_adapter_loads", "num_evictions", "loaded_adapters", "pool_slots")},
        "scheduler_integrity": info["last_integrity_check"],
        "tokenizer_integrity": info["tokenizer_integrity_check"],
        "kv": {"free": info["kv_free_tokens"], "evictable": info["kv_evictable_tokens"],
               "total": info["max_total_num_tokens"]},
        "prefix_cache": info["prefix_cache"],
        "integrity_errors_in_log": log.count("integrity check failed"),
        "server_info": info,
    }


def write_report(report: dict[str, Any], default_path: Optional[str] = None) -> Optional[str]:
    path = os.environ.get("SGLANG_SOAK_REPORT") or default_path
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump({k: v for k, v in report.items() if k != "server_info"}, f, indent=2, default=str)
    return path
