"""A checkpoint whose context length (max_position_embeddings 256) is below the top prefill bucket
(1024 here) starts and serves with CUDA graphs on (GPU only).

Before the fix its capture batches used positions 0 .. bucket-1, past the 256-row rotary table, and
the server crashed at start. Now a bucket above the context is captured as several requests of at
most 256 tokens. A LoRA server (csgmv) captures both graph sets; a batch of three 200-token
requests (600 tokens, above the context length) may then replay the 640 bucket.
"""

from __future__ import annotations

import os
import re
import tempfile

import pytest
import requests

from helpers import hf_model
from lora_testlib import write_peft_adapter
from server_helpers import kill_server, popen_launch_server, read_log, tiny_checkpoint

pytestmark = pytest.mark.gpu

CONTEXT = 256


def test_small_context_checkpoint_starts_and_serves_with_graphs():
    ckpt = tiny_checkpoint("qwen3", max_position_embeddings=CONTEXT)
    adapter = write_peft_adapter(os.path.join(tempfile.mkdtemp(prefix="sglang-small-ctx-"), "a"), r=8,
                                 base_model=hf_model(ckpt), seed=41, b_std=0.2)
    proc, url = popen_launch_server(ckpt, [
        "--dtype", "bfloat16", "--attention-backend", "triton", "--chunked-prefill-size", "1024",
        "--cuda-graph-max-bs-decode", "4", "--lora-paths", f"a={adapter}", "--lora-backend", "csgmv",
        "--max-loras-per-batch", "2", "--max-total-tokens", "8192",
    ], timeout=600)
    try:
        info = requests.get(f"{url}/get_server_info", timeout=30).json()
        assert info["context_len"] == CONTEXT  # scheduler_info's start-up facts
        assert info["graph_stats"]["num_graphs"] > 0, info["graph_stats"]
        ids = [[(7 * i + 13 * k) % 400 + 3 for i in range(200)] for k in range(3)]
        for lora in ("a", None):
            r = requests.post(f"{url}/generate", json={"input_ids": ids[0], "lora_path": lora,
                                                       "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}},
                              timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["meta_info"]["completion_tokens"] == 8
        r = requests.post(f"{url}/generate", json={"input_ids": ids, "lora_path": ["a", None, "a"],
                                                   "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}},
                          timeout=120)
        assert r.status_code == 200 and len(r.json()) == 3, r.text
        stats = requests.get(f"{url}/get_server_info", timeout=30).json()["graph_stats"]
        assert stats["prefill_graph_replays"] > 0 and stats["decode_graph_replays"] > 0, stats
        log = read_log(proc)
        wide = [int(n) for n, used in re.findall(r"#new-token: (\d+),.*cuda graph: (True)", log) if int(n) > CONTEXT]
        print(f"graph stats {stats}; prefill batches above the context that replayed: {wide}")
    finally:
        assert kill_server(proc) == 0, read_log(proc)[-3000:]
