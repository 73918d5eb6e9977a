"""Prometheus metrics: `--enable-metrics` serves them at /metrics (prometheus_client's text format).

The core series keep SGLang's names, types and units, as its production-metrics page documents
them (https://docs.sglang.io/references/production_metrics.html), every one labelled with
`model_name`. The series only this engine has use the same `sglang:` prefix: traffic per adapter
(`lora_name`, "" for the base model), the adapter slot pool, and forward batches by path with the
reason a batch ran eagerly. `sglang:lora_requests_info` has the shape that the Kubernetes Gateway
API Inference Extension's endpoint picker reads (vLLM's `vllm:lora_requests_info`): labels
`max_lora`, `running_lora_adapters`, `waiting_lora_adapters`, value the time of the update.

Where the numbers come from (processes as in docs/architecture.md):
  * per-request series (latencies, token counters, per-adapter traffic) are observed in the main
    process, which sees every token of every request arrive: one registry, no multiprocess mode;
  * scheduler-side series (queue, running requests, KV use, cache hit rate, throughput, forward
    paths, adapter slots) are read from the scheduler's live info when /metrics is scraped (one
    request to the scheduler per scrape), so they are exact at that moment. Under tensor
    parallelism every rank runs the same scheduler on the same batches: these values are the same
    on every rank, rank 0's are exported, and no series needs a `tp_rank` label.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

if TYPE_CHECKING:
    from sglang.srt.managers.req_state import ReqState

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                15.0, 20.0, 25.0, 30.0, 40.0, 50.0, 60.0, 100.0, 200.0, 400.0)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08, 0.1, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.0, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 90.0, 120.0,
               180.0, 240.0, 300.0, 600.0, 1200.0)


class ServerMetrics:
    """The registry behind /metrics, fed by the tokenizer manager (`on_tokens`, `on_finished`) and,
    at each scrape, by the scheduler's live info (`render`)."""

    def __init__(self, model_name: str) -> None:
        disable_created_metrics()  # no `_created` series beside each counter (SGLang shows none)
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        # SGLang's core series (prometheus_client appends `_total` to counters).
        self.prompt_tokens = Counter("sglang:prompt_tokens", "Number of prefill tokens processed.", m, registry=r)
        self.generation_tokens = Counter("sglang:generation_tokens", "Number of generation tokens processed.", m,
                                         registry=r)
        self.cached_tokens = Counter("sglang:cached_tokens", "Number of prompt tokens served from the prefix cache.",
                                     m, registry=r)
        self.requests = Counter("sglang:num_requests", "Number of requests processed.", m, registry=r)
        self.aborted = Counter("sglang:num_aborted_requests", "Number of requests aborted.", m, registry=r)
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              m, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             m, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds",
                             "Histogram of end-to-end request latency in seconds.", m, buckets=E2E_BUCKETS, registry=r)
        # This engine's own: traffic per adapter ("" is the base model).
        lm = ["model_name", "lora_name"]
        self.lora_requests = Counter("sglang:lora_requests", "Requests processed, per adapter.", lm, registry=r)
        self.lora_prompt_tokens = Counter("sglang:lora_prompt_tokens", "Prompt tokens processed, per adapter.", lm,
                                          registry=r)
        self.lora_generation_tokens = Counter("sglang:lora_generation_tokens",
                                              "Generation tokens processed, per adapter.", lm, registry=r)
        # The model's series, looked up once (every core series shows from the first scrape, at 0;
        # `.labels()` takes a lock per call, and the request path observes per token).
        (self._prompt_tokens, self._generation_tokens, self._cached_tokens, self._requests, self._aborted,
         self._ttft, self._itl, self._e2e) = (
            metric.labels(model_name) for metric in (self.prompt_tokens, self.generation_tokens, self.cached_tokens,
                                                     self.requests, self.aborted, self.ttft, self.itl, self.e2e))
        self._live: dict[str, Any] = {}
        self.registry.register(_SchedulerCollector(self))

    # ------------------------------------------------------------------ per request
    def on_tokens(self, state: "ReqState", new_tokens: int, now: float, first_token_time: Optional[float]) -> None:
        """`new_tokens` output tokens of `state` arrived at `now` (time.time()); the scheduler
        produced the request's first one at `first_token_time`. A streaming request's tokens
        arrive step by step; a non-streaming one's all at once when it finishes, so its TTFT is
        the scheduler's first-token time, and its later tokens share the time since evenly."""
        if new_tokens <= 0:
            return
        since = state.last_token_time
        if since is None:
            first = first_token_time if first_token_time is not None else now
            self._ttft.observe(first - state.created)
            new_tokens -= 1  # the first token's latency is the TTFT, not an inter-token gap
            since = first
        if new_tokens:
            gap = max(now - since, 0.0) / new_tokens
            for _ in range(new_tokens):
                self._itl.observe(gap)
        state.last_token_time = now

    def on_finished(self, state: "ReqState", now: float) -> None:
        name = self.model_name
        lora = (state.req.lora_name or "") if state.lora_id is not None else ""
        self._requests.inc()
        self._prompt_tokens.inc(state.prompt_tokens)
        self._generation_tokens.inc(state.completion_tokens)
        self._cached_tokens.inc(state.cached_tokens)
        self._e2e.observe(now - state.created)
        if (state.finished_reason or {}).get("type") == "abort":
            self._aborted.inc()
        self.lora_requests.labels(name, lora).inc()
        self.lora_prompt_tokens.labels(name, lora).inc(state.prompt_tokens)
        self.lora_generation_tokens.labels(name, lora).inc(state.completion_tokens)

    def forget_adapter(self, lora_name: str) -> None:
        """Drop an unloaded adapter's series: a server that loads and unloads many names would
        otherwise export every name it ever served, forever (a reload starts them from 0, which
        Prometheus reads as a counter reset)."""
        for counter in (self.lora_requests, self.lora_prompt_tokens, self.lora_generation_tokens):
            try:
                counter.remove(self.model_name, lora_name)
            except KeyError:
                pass  # it served no request

    # ------------------------------------------------------------------ a scrape
    def render(self, live_info: dict[str, Any]) -> bytes:
        """The text exposition, with the scheduler-side series taken from `live_info`."""
        self._live = live_info
        return generate_latest(self.registry)


class _SchedulerCollector:
    """The series read from the scheduler's live info at scrape time (see the module docstring)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> list:
        return []  # no fixed set of series: prometheus_client then does not call collect() at registration

    def collect(self) -> Iterator[Any]:
        info, name = self.metrics._live, self.metrics.model_name
        if not info:
            return
        total = max(int(info.get("max_total_num_tokens") or 0), 1)
        cache = info.get("prefix_cache") or {}
        for metric, help_text, value in (
            ("sglang:num_running_reqs", "The number of running requests.", info.get("num_running_reqs", 0)),
            ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", info.get("num_waiting_reqs", 0)),
            ("sglang:token_usage", "The token usage: KV cache slots in use over the pool's.",
             info.get("kv_used_tokens", 0) / total),
            ("sglang:cache_hit_rate", "The prefix cache hit rate (prompt tokens reused over looked up).",
             cache.get("hit_rate", 0.0)),
            ("sglang:gen_throughput", "The generation throughput (token/s) of the last decode log interval.",
             info.get("last_gen_throughput", 0.0)),
        ):
            yield _gauge(metric, help_text, ["model_name"], [name], value)
        paths = CounterMetricFamily("sglang:forward_batches", "Forward batches by path; reason: why a batch ran "
                                    "eagerly.", labels=["model_name", "mode", "path", "reason"])
        for mode, path, reason, count in (info.get("graph_stats") or {}).get("forward_paths", []):
            paths.add_metric([name, mode, path, reason], count)
        yield paths
        timed = info.get("forward_seconds")  # SGLANG_FORWARD_TIMES=1 (model_executor/forward_clock.py)
        if timed:
            seconds = CounterMetricFamily("sglang:forward_seconds", "Seconds the forwards took on their stream, by "
                                          "mode (SGLANG_FORWARD_TIMES=1).", labels=["model_name", "mode"])
            for mode in ("prefill", "decode"):
                seconds.add_metric([name, mode], timed.get(f"{mode}_s", 0.0))
            yield seconds
        lora = info.get("lora")
        if lora:
            yield from _lora_families(name, lora)


def _gauge(metric: str, help_text: str, labels: list[str], values: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(metric, help_text, labels=labels)
    family.add_metric(values, value)
    return family


def _lora_families(name: str, lora: dict[str, Any]) -> Iterator[Any]:
    yield _gauge("sglang:lora_resident_adapters", "Adapters resident in the pool's GPU slots.", ["model_name"],
                 [name], len(lora.get("resident_adapters", [])))
    for metric, help_text, key in (
        ("sglang:lora_slot_loads", "Adapters copied into a GPU slot.", "num_adapter_loads"),
        ("sglang:lora_slot_evictions", "Adapters evicted from a GPU slot.", "num_evictions"),
    ):
        family = CounterMetricFamily(metric, help_text, labels=["model_name"])
        family.add_metric([name], lora.get(key, 0))
        yield family
    hist = lora.get("slot_load_seconds")
    if hist:
        family = HistogramMetricFamily("sglang:lora_slot_load_seconds", "Host seconds per adapter slot load.",
                                       labels=["model_name"])
        family.add_metric([name], [(str(le), count) for le, count in hist["buckets"]], hist["sum"])
        yield family
    info = GaugeMetricFamily(
        "sglang:lora_requests_info",
        "Adapters of the running and the waiting requests (value: when it was read), as the Gateway API "
        "Inference Extension's endpoint picker reads vLLM's vllm:lora_requests_info.",
        labels=["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
    )
    info.add_metric([name, str(lora.get("max_loras_per_batch", 0)), ",".join(lora.get("running_adapters", [])),
                     ",".join(lora.get("waiting_adapters", []))], time.time())
    yield info
