"""`--schedule-policy lpm` measured against `fcfs` (CPU, tiny model): `bench_serving`'s generated
shared-prefix load (groups of requests sharing a system prompt, order shuffled) on a KV pool too
small to keep every group's prompt cached. FCFS takes the groups in arrival order and evicts a
prompt before the next request of its group comes; LPM runs the requests whose prompt is cached
first. Both servers get the same requests; the test reports the hit rate and the throughput of
each, and LPM must reuse clearly more of the cache."""

from __future__ import annotations

from server_helpers import kill_servers, launch_servers, tiny_checkpoint
from sglang.bench_serving import main as bench_main

# 16 groups x 4 requests; a 96-token system prompt each (1,536 tokens in all), against a
# 500-token pool of which 4 running requests hold about 430.
SERVER = ["--device", "cpu", "--max-total-tokens", "500", "--max-running-requests", "4"]
LOAD = ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "16", "--gsp-prompts-per-group", "4",
        "--gsp-system-prompt-len", "96", "--gsp-question-len", "6", "--gsp-output-len", "4",
        "--max-concurrency", "64", "--seed", "3", "--disable-tqdm"]


def test_lpm_reuses_more_of_a_small_cache_than_fcfs(capsys):
    # Both servers start side by side (each start keeps about one core busy); each then serves the
    # load alone, the other idle.
    servers = launch_servers(*[dict(model=tiny_checkpoint("llama"), other_args=[*SERVER, "--schedule-policy", policy])
                               for policy in ("fcfs", "lpm")])
    try:
        fcfs, lpm = (bench_main(["--base-url", url, *LOAD]) for _, url in servers)
    finally:
        kill_servers([proc for proc, _ in servers])
    for res in (fcfs, lpm):
        assert res["completed"] == 64 and res["failed"] == 0, res["errors"]
    with capsys.disabled():
        print(f"\n[lpm] cache hit rate fcfs {fcfs['cache_hit_rate']:.3f}, lpm {lpm['cache_hit_rate']:.3f}; "
              f"req/s fcfs {fcfs['request_throughput']:.2f}, lpm {lpm['request_throughput']:.2f}")
    assert lpm["cache_hit_rate"] > fcfs["cache_hit_rate"] + 0.15, (fcfs["cache_hit_rate"], lpm["cache_hit_rate"])
