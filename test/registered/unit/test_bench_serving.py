"""bench_serving's adapter picks (`--lora-name`, `--lora-distribution`, `--lora-zipf-alpha`): the
weights, determinism under `--seed`, and the skew they give."""

from collections import Counter

import pytest

from sglang.bench_serving import parse_args
from sglang.bench_workload import lora_weights, pick_adapters

NAMES = [f"lora{i}" for i in range(8)]


def test_weights() -> None:
    assert lora_weights(3, "uniform", 1.0) == [1.0, 1.0, 1.0]
    assert lora_weights(4, "zipf", 1.0) == pytest.approx([1.0, 1 / 2, 1 / 3, 1 / 4])
    assert lora_weights(3, "zipf", 2.0) == pytest.approx([1.0, 1 / 4, 1 / 9])


def test_picks_depend_on_the_seed_only() -> None:
    a = pick_adapters(NAMES, 256, "zipf", 1.1, seed=1)
    assert a == pick_adapters(NAMES, 256, "zipf", 1.1, seed=1)
    assert a != pick_adapters(NAMES, 256, "zipf", 1.1, seed=2)
    # The picks of the first requests do not change when more are asked for.
    assert pick_adapters(NAMES, 300, "zipf", 1.1, seed=1)[:256] == a


def test_zipf_is_skewed_and_uniform_is_not() -> None:
    zipf = Counter(pick_adapters(NAMES, 4000, "zipf", 1.0, seed=0))
    # Expected shares 1/H8 = 0.368 for the first, 0.046 for the last.
    assert zipf["lora0"] > 0.33 * 4000 and zipf["lora7"] < 0.07 * 4000
    assert zipf["lora0"] > zipf["lora1"] > zipf["lora3"] > zipf["lora7"]
    uniform = Counter(pick_adapters(NAMES, 4000, "uniform", 1.0, seed=0))
    assert all(0.10 * 4000 < uniform[n] < 0.15 * 4000 for n in NAMES)


def test_cli_flags() -> None:
    args = parse_args(["--lora-name", "a", "b", "--lora-distribution", "zipf", "--lora-zipf-alpha", "1.2"])
    assert args.lora_name == ["a", "b"] and args.lora_distribution == "zipf" and args.lora_zipf_alpha == 1.2
    assert parse_args([]).lora_distribution == "uniform"
    with pytest.raises(SystemExit):
        parse_args(["--lora-zipf-alpha", "0"])


def test_summary_is_strict_json_with_the_default_unlimited_rate() -> None:
    """The JSON line must parse with strict parsers: the default --request-rate (inf) is null."""
    import json

    from sglang.bench_serving import RequestResult, summarize

    args = parse_args([])
    assert args.request_rate == float("inf")
    done = RequestResult()
    done.ok, done.ttft, done.latency, done.itls = True, 0.01, 0.05, [0.01]
    res = summarize([done, RequestResult()], 0.5, args, "threads")
    line = json.dumps(res, allow_nan=False)
    assert json.loads(line)["request_rate"] is None and "Infinity" not in line


def test_summary_reports_ttft_per_adapter() -> None:
    """Starvation must be visible: each adapter's TTFT is summarised on its own, and the worst p99."""
    from sglang.bench_serving import RequestResult, summarize
    from sglang.bench_workload import RequestSpec

    args = parse_args(["--lora-name", "a", "b", "c"])
    specs, results = [], []
    for i, (name, ttft) in enumerate([("a", 0.01), ("b", 0.02), ("a", 0.03), ("b", 0.5), ("c", 9.0)]):
        specs.append(RequestSpec({"input_ids": [1], "lora_path": name}, 1))
        r = RequestResult()
        r.ok, r.ttft, r.latency = i != 4, ttft, ttft  # c's only request failed
        results.append(r)
    res = summarize(results, 1.0, args, "threads", specs)
    assert set(res["lora_ttft_ms"]) == {"a", "b"}  # no completed request of c: no TTFT to report
    assert res["lora_ttft_ms"]["a"]["mean"] == pytest.approx(20.0)
    assert res["lora_ttft_ms"]["b"]["p99"] == pytest.approx(500.0)
    assert res["worst_adapter_p99_ttft_ms"] == pytest.approx(500.0)
    assert res["lora_requests"] == {"a": 2, "b": 2, "c": 1}
