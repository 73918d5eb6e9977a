"""bench_one_batch runs a static batch end to end and reports one JSON line (no timing asserts:
speed is measured by benchmarks, not tests)."""

from __future__ import annotations

import json

import pytest

from sglang import bench_one_batch
from sglang.srt.tools.make_checkpoint import make_checkpoint


def test_bench_one_batch_reports_one_json_line(tmp_path, capsys) -> None:
    path = make_checkpoint(str(tmp_path / "cfg"), arch="qwen3", with_weights=False)
    argv = ["--model-path", path, "--load-format", "dummy", "--batch-size", "3", "--input-len", "16",
            "--output-len", "4", "--warmup", "1", "--repeats", "2", "--max-total-tokens", "256",
            "--max-running-requests", "4"]
    result = bench_one_batch.main(argv)
    lines = capsys.readouterr().out.strip().splitlines()
    assert json.loads(lines[-1]) == result
    assert result["batch_size"] == 3 and result["input_len"] == 16 and result["output_len"] == 4
    assert result["prefill_ms"] > 0 and result["decode_median_ms"] > 0
    assert result["prefill_tok_s"] > 0 and result["decode_tok_s"] > 0
    assert result["prefill_cuda_graph"] is False
    with pytest.raises(ValueError, match="does not fit"):
        bench_one_batch.main(argv[:-4] + ["--max-total-tokens", "32", "--max-running-requests", "4"])
