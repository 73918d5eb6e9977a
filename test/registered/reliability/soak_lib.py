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

WORDS = ("the quick brown fox jumps over a lazy dog while seven bright engines hum softly under "
         "pale winter skies and small adapters learn new tricks every single morning").split()


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
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: str, kind: str, latency: Optional[float] = None, detail: str = "") -> None:
        with self.lock:
            self.counts[outcome] += 1
            self.counts[f"{outcome}:{kind}"] += 1
            if latency is not None:
                self.latencies.append(latency)
            if outcome == "failed" and len(self.failures) < 50:
                self.failures.append(f"{kind}: {detail[:400]}")


class Soak:
    def __init__(self, cfg: SoakConfig) -> None:
        self.cfg = cfg
        self.stats = SoakStats()
        self.stop = threading.Event()
        self.loaded: set[str] = set()  # cycling adapters currently loaded

    # ------------------------------------------------------------------ one request
    def _choose_adapter(self, rng: random.Random) -> Optional[str]:
        pool: list[Optional[str]] = [None, *self.cfg.adapters, *self.cfg.cycling]
        return rng.choice(pool)

    def _body(self, rng: random.Random, kind: str, lora: Optional[str]) -> tuple[str, dict]:
        cfg = self.cfg
        n = rng.randint(*cfg.max_new_tokens)
        if kind == "generate":
            ids = [rng.randrange(3, cfg.vocab) for _ in range(rng.randint(*cfg.prompt_tokens))]
            body: dict[str, Any] = {"input_ids": ids, "lora_path": lora,
                                    "sampling_params": {"max_new_tokens": n, "temperature": rng.choice([0, 0.8]),
                                                        "ignore_eos": rng.random() < 0.7}}
            if rng.random() < 0.3:
                body.update(return_logprob=True, logprob_start_len=rng.choice([-1, 0]), top_logprobs_num=2)
            return "/generate", body
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*cfg.prompt_words)))
        model = cfg.model if lora is None else f"{cfg.model}:{lora}"
        common = {"model": model, "max_tokens": n, "temperature": rng.choice([0, 0.8]), "ignore_eos": True}
        if kind == "completions":
            return "/v1/completions", {**common, "prompt": text, "logprobs": rng.choice([None, 2])}
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
            body["rid"] = rid
            body["sampling_params"]["max_new_tokens"] = max(body["sampling_params"]["max_new_tokens"], 24)
        timeout = 0.3 + rng.random() if mode == "plain_timeout" else self.cfg.request_timeout
        label = f"{kind}/{mode}"
        t0 = time.monotonic()
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
            return self._check_reply(r, label, kind, t0)
        try:
            self._consume_stream(r, label, mode, rid, rng, t0)
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

    def _check_reply(self, r: requests.Response, label: str, kind: str, t0: float) -> None:
        out = r.json()
        if kind == "generate":
            reason = out["meta_info"]["finish_reason"]
        else:
            reason = out["choices"][0]["finish_reason"]
        if not reason or (isinstance(reason, dict) and reason.get("type") == "abort"):
            return self.stats.add("failed", label, detail=f"unfinished reply {str(out)[:300]}")
        self.stats.add("ok", label, time.monotonic() - t0)

    def _consume_stream(self, r: requests.Response, label: str, mode: str, rid: str, rng: random.Random,
                        t0: float) -> None:
        close_after = rng.randint(1, 6) if mode == "stream_close" else None
        abort_after = rng.randint(1, 4) if mode == "rid_abort" else None
        events, done, finish = 0, False, None
        try:
            for line in r.iter_lines(decode_unicode=True):
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
        self.stats.add("ok", label, time.monotonic() - t0)

    # ------------------------------------------------------------------ threads
    def worker(self, k: int) -> None:
        rng = random.Random(self.cfg.seed * 1000 + k)
        while not self.stop.is_set():
            try:
                self.one_request(rng)
            except Exception as e:  # noqa: BLE001 - a bug of the soak itself, or a reply not JSON
                self.stats.add("failed", "worker", detail=repr(e))

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
        return {
            "load_seconds": round(time.monotonic() - t0, 1),
            "counts": dict(sorted(self.stats.counts.items())),
            "latency_s": {"p50": _pct(lat, 0.5), "p99": _pct(lat, 0.99), "max": lat[-1] if lat else None},
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
        "kv": {"free": info["kv_free_tokens"], "total": info["max_total_num_tokens"]},
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
