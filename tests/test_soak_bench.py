"""`odma-bench soak` against a tiny odma-serve for a fraction of a minute: the JSON it writes has its series,
per-minute percentiles, outcome counts and targets, and every outcome is classified (nothing lost, the burst's
429s counted as refusals with Retry-After, the bad requests as 4xx)."""

from __future__ import annotations

import json
import os

import pytest

from odma.bench import cli, soak_probe
from odma.bench.soak_load import OUTCOMES
from odma.server.testing import tiny_server

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="the soak samples /proc (Linux)")


def test_a_short_soak_classifies_every_outcome(tiny_folder, tmp_path, capsys):
    out = tmp_path / "soak"
    with tiny_server(tiny_folder, max_queue=2, max_tokens_cap=32, default_max_tokens=16) as srv:
        assert soak_probe.listening_pid(int(srv.url.rsplit(":", 1)[1])) == os.getpid()
        # seed 54 draws a cut or cancel first, bad requests 5th and 7th and a long prompt among its first 12 requests
        cli.main(["soak", "--url", srv.url, "--pid", str(os.getpid()), "--minutes", "0.3", "--concurrency", "3",
                  "--think-s", "0", "--max-queue", "2", "--burst-size", "12", "--burst-every-s", "6",
                  "--pause-every-s", "7", "--pause-s", "1", "--sample-every-s", "1", "--trace", "nq",
                  "--max-tokens-cap", "32", "--long-prompt-tokens", "600", "--timeout", "60", "--seed", "54",
                  "--out", str(out), "--json"])
    printed = json.loads(capsys.readouterr().out)
    result = json.loads((out / "soak.json").read_text())
    assert printed["targets"] == result["targets"]

    # shape: series, idle points, per-minute rows, outcome counts, targets
    assert result["duration_s"] == pytest.approx(18.0)
    assert len(result["samples"]) >= 10
    for s in result["samples"]:
        assert {"t_s", "load1", "in_flight", "rss_mb", "fds", "threads", "queue_depth", "running",
                "kv_reserved_bytes"} <= s.keys()
    assert len(result["idle_samples"]) >= 2 and result["idle_samples"][-1]["final"]
    assert result["per_minute"] and {"minute", "requests", "latency_p50_s", "latency_p99_s", "ttft_p99_s"} <= \
        result["per_minute"][0].keys()
    assert len(result["bursts"]) >= 2
    for target in result["targets"].values():
        assert {"target", "measured", "pass"} <= target.keys()
    lines = (out / "requests.jsonl").read_text().splitlines()
    counts = result["outcomes"]
    assert len(lines) == counts["total"] == sum(counts[k] for k in OUTCOMES)
    assert (out / "soak.png").stat().st_size > 10_000

    # classification: nothing lost or failed; the bursts past --max-queue refused with Retry-After; bad requests 4xx
    assert counts["lost"] == counts["server_error"] == counts["bad_accepted"] == counts["unexpected_4xx"] == 0
    assert counts["refused"] >= 1 and counts["refused_with_retry_after"] == counts["refused"]
    assert counts["by_kind"]["burst"].get("refused", 0) >= 1
    # a bad request is refused 4xx (or 429 first, when it meets a full queue: the door comes before validation)
    assert set(counts["by_kind"]["bad"]) <= {"rejected", "refused"}
    assert counts["by_kind"]["bad"]["rejected"] == counts["rejected"] >= 1
    assert all(r.startswith("4") for r in counts["reasons"])
    assert counts["full"] >= 5 and counts["cut"] + counts["cancelled"] >= 1
    for target in ("lost", "server_errors", "other_failures", "refusals_say_retry_after", "gauges_zero_at_pauses"):
        assert result["targets"][target]["pass"], (target, result["targets"][target])
    assert result["targets"]["gauges_zero_at_pauses"]["measured"]["idle_points"] == len(result["idle_samples"])


def test_gauges_sum_labelled_series_and_read_vllm_names():
    text = ("# HELP x\nodma_queue_depth 3\nodma_device_waiting_requests{device=\"cpu:0\"} 1\n"
            "odma_device_waiting_requests{device=\"cpu:1\"} 2\nodma_kv_reserved_bytes 4096.0\n")
    assert soak_probe.gauges(text) == {"queue_depth": 3.0, "device_waiting": 3.0, "kv_reserved_bytes": 4096.0}
    vllm = 'vllm:num_requests_running{model_name="m"} 2.0\nvllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
    assert soak_probe.gauges(vllm, soak_probe.VLLM_GAUGES) == {"running": 2.0, "kv_usage": 0.25}


def test_the_targets_fail_on_a_leak_a_stuck_gauge_and_a_lost_request():
    from odma.bench.soak_report import evaluate

    idle = [{"t_s": t, "rss_mb": 1000 + 10 * t, "fds": 20 + t // 60, "threads": 12, "queue_depth": 0,
             "running": 1 if t == 600 else 0} for t in (120, 300, 600)]
    outcomes = [{"kind": "chat", "outcome": "full", "start_s": 1, "end_s": 2, "latency_s": 1.0},
                {"kind": "chat", "outcome": "lost", "start_s": 550, "end_s": 560, "latency_s": 10.0},
                {"kind": "chat", "outcome": "full", "start_s": 560, "end_s": 562, "latency_s": 2.0}]
    t = evaluate(idle, idle, outcomes, 600.0)
    assert not t["rss_growth"]["pass"] and not t["fds_flat"]["pass"] and t["threads_flat"]["pass"]
    assert not t["gauges_zero_at_pauses"]["pass"] and t["gauges_zero_at_pauses"]["measured"]["nonzero"][0]["t_s"] == 600
    assert t["lost"]["measured"] == 1 and not t["lost"]["pass"]
    assert t["p99_drift"]["measured"] == pytest.approx(1.0) and not t["p99_drift"]["pass"]
