"""`odma-bench balloon` (step-time model): ballooning off and on complete the same work at the same memory."""

from __future__ import annotations

import argparse

from odma.bench import balloon_bench


def _args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    balloon_bench.add_arguments(p)
    return p.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


def test_ballooning_lends_the_reserve_and_loses_nothing():
    # 4 long prompts of 1-2K tokens among 40 short ones; the reserve (a 2K prefill) is ~60 % of the KV pool
    args = _args(num_short=40, num_long=4, long_min=1024, long_max=2048, max_prefill_tokens=2048,
                 kv_budget="112MiB", max_tokens=256, segment_tokens=256, keep_tokens=256, predictor="oracle")
    result = balloon_bench.run(args)
    off, on = result["runs"]
    assert off["completed"] == on["completed"] == 44  # every request finished in both runs
    assert "lends" not in off and on["lends"] > 0 and on["peak_lent_bytes"] > 0
    assert on["peak_lent_bytes"] <= result["activation_reserve_bytes"]
    assert result["total_memory_bytes"] == result["kv_budget_bytes"] + result["activation_reserve_bytes"]


def test_workload_mixes_long_prompts_into_poisson_arrivals():
    jobs = balloon_bench.workload(_args(num_short=20, num_long=5, long_min=3000, long_max=4000, rate=2))
    longs = [j for j in jobs if j.long]
    assert len(jobs) == 25 and len(longs) == 5
    assert all(3000 <= j.prompt_tokens <= 4000 and j.prompt is None for j in longs)
    arrivals = [j.arrival_s for j in jobs]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0


def test_chunked_prefill_and_window_clearing_lose_nothing():
    # the 192-short workload of docs/BENCHMARKS.md, scaled down: long prompts hold the queue while lent
    # segments hold short requests, so windows are cleared and long prompts prefilled in chunks
    p = argparse.ArgumentParser()
    balloon_bench.add_arguments(p)
    args = p.parse_args(["--num-short", "96", "--num-long", "4", "--rate", "8", "--seed", "1", "--max-num-seqs", "256",
                         "--predictor", "oracle", "--chunked-prefill", "--clear-window"])
    result = balloon_bench.run(args)  # every step checks lent bytes + the step's activation peak <= the reserve
    off, on = result["runs"]
    assert off["completed"] == on["completed"] == 100
    assert off["prefill_chunks"] == 0 and on["prefill_chunks"] > 0  # only lent room makes a prompt chunked
    assert on["window_clears"] > 0 and on["window_moves"] > 0
    assert on["activation_refusals"] == 0
