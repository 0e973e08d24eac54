"""scripts/gpu_check.sh's CPU dry run (tiny shapes, Triton's interpreter): the tests stage and every part of
`odma-bench gpu` run and report what a GPU run would, so the one command a lent GPU gets cannot rot unnoticed; and a
failure in one policy, or a part's time cap, loses nothing else. Timings here mean nothing."""

from __future__ import annotations

import json
import os
import re
from functools import partial
from pathlib import Path

import pytest
from early_jobs import Command

from odma.bench.gpu_work import TINY_MAX_TOKENS

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent


DRY_RUN = "gpu_check.sh --cpu"


def _dry_run(tmp_path_factory) -> Command:
    out = tmp_path_factory.mktemp("gpu_check")
    # every part of the bench (the GPU plan runs only the engine; the others stay available and must not rot)
    env = dict(os.environ, BENCH_PARTS="kernels,runs,vmm,step,engine,http,peer")
    return Command(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu", str(out)], env, 4800, out)


def start_early(tmp_path_factory) -> dict:
    """The dry run starts with the session (tests/early_jobs.py)."""
    return {DRY_RUN: ("dry_run", partial(_dry_run, tmp_path_factory))}


@pytest.fixture(scope="module")
def dry_run(early_jobs, tmp_path_factory):
    done = early_jobs.result(DRY_RUN, partial(_dry_run, tmp_path_factory))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((done.command.out / "gpu_check.json").read_text())
    result["_stdout"] = done.stdout
    result["_out"] = done.command.out
    return result


def test_the_dry_run_covers_every_part(dry_run):
    result = dry_run
    assert result["tiny"] and result["interpreted"]
    summary = result["tests"]["summary"]
    assert re.match(r"\d+ passed", summary) and "failed" not in summary and "error" not in summary, summary
    kernels = result["kernels"]
    rows = [r["result"] for r in kernels["rows"]]
    assert [(r["context"], r["batch"]) for r in kernels["rows"]] == [(64, 1), (64, 4), (256, 1), (256, 4)]
    for r in rows:  # every reader computes SDPA's attention over the same K/V (fp32 here): pieces too
        assert r["contiguous_error_vs_sdpa"] < 1e-4 and r["paged_error_vs_sdpa"] < 1e-4, r
        assert r["pieces_error_vs_sdpa"] < 1e-4 and r["contiguous_vs_pieces"] > 0, r
        assert r["contiguous_us"] > 0 and r["paged_us"] > 0
    assert any(r["splits"] > 1 for r in rows)
    runs = result["runs"]  # odma's vLLM backend on an accelerator: one-run and scattered blocks, the same K/V
    assert [(r["context"], r["batch"]) for r in runs["rows"]] == [(64, 1), (64, 4), (256, 1), (256, 4)]
    for r in (row["result"] for row in runs["rows"]):
        assert r["runs_error_vs_sdpa"] < 1e-4 and r["paged_error_vs_sdpa"] < 1e-4, r
        assert r["runs_us"] > 0 and r["paged_us"] > 0 and r["sdpa_dense_us"] > 0
    vmm = result["vmm"]["rows"]  # the host's virtual memory stands in for CUDA's
    assert [r["block_bytes"] for r in vmm] == [1 << 20, 4 << 20]
    assert all(r["result"]["map_step_ms"] > 0 and r["result"]["copy_block_ms"] > 0 for r in vmm)
    modes = result["step"]["modes"]
    assert modes["capture"]["graph_steps"] == modes["capture"]["steps_timed"] > 0  # every timed step a static batch
    assert modes["off"]["graph_steps"] == 0 and modes["off"]["graphs"] is None
    runs = result["engine"]["runs"]
    staged = str(result["_out"] / "stage")
    sharegpt, azure = f"{staged}/traces/sharegpt.jsonl", "azure-conv"
    assert list(runs) == [sharegpt, azure]  # both traces, one model, results keyed by trace
    learned = f"odma:{staged}/predictor/default"  # the staged, self-contained learned predictor
    assert list(runs[sharegpt]["policies"]) == [learned, "odma:median", "odma:oracle", "paged", "static",
                                                "odma-pieces:median"]
    assert list(runs[azure]["policies"]) == ["odma", "paged", "odma-continue"]
    assert runs[sharegpt]["work"]["texts"] == runs[sharegpt]["work"]["requests"] == 8  # ShareGPT carries text
    assert runs[azure]["work"]["texts"] == 0  # Azure's trace has lengths only
    for run in runs.values():
        work = run["work"]
        assert run["skipped"] == []
        for policy, r in run["policies"].items():
            assert r["errors"] == 0 and r["short"] == 0 and not r["cut_at_cap"], policy
            assert r["output_tokens"] == work["forced_output_tokens"] and r["completed"] == r["requests"], policy
            assert r["steps_timed"] == r["steps"] and r["host_ms_p50"] > 0, policy
            assert r["prediction"]["tagged"] == work["requests"] and r["predictor_fallback"] is None, policy
            for key in ("preemptions", "migrations", "migrated_tokens", "swap_outs", "mean_running", "peak_running"):
                assert key in r, (policy, key)
            # every request tagged by the worker, inside the burst's clock, before its first token
            assert r["tagging"] == "ahead" and r["tag_timeouts"] == 0 and r["tagging_s"] >= 0, policy
            assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] <= r["seconds"], policy
    text = runs[sharegpt]["policies"]
    assert text[learned]["predictor"] == "encoder:default" and text[learned]["schedule"] == "fcfs"  # not its fallback
    pieces = text["odma-pieces:median"]  # shared prefixes read in place, blocks continued elsewhere
    assert pieces["prefix_reads"] and pieces["continue_growth"]
    assert not text["odma:median"]["prefix_reads"] and not text["odma:median"]["continue_growth"]
    assert text[learned]["tagging_s"] > 0  # the encoder's host time, measured
    assert text["odma:median"]["predictor"] == "running-median"
    assert text["odma:oracle"]["prediction"]["median_abs_error"] == 0  # exact lengths, handed over upstream
    assert text["odma:oracle"]["prediction"]["under_share"] == 0
    assert text["odma:median"]["prediction"]["mean_predicted"] == TINY_MAX_TOKENS  # the prior 128, cut to max_tokens
    for variant in (learned, "odma:median", "odma:oracle", "odma-pieces:median"):  # both baselines
        assert runs[sharegpt][f"{variant}_vs_paged"] > 0 and runs[sharegpt][f"{variant}_vs_static"] > 0
    assert runs[azure]["odma_vs_paged"] > 0 and runs[azure]["odma-continue_vs_paged"] > 0
    assert runs[azure]["policies"]["odma-continue"]["continue_growth"]
    assert not runs[azure]["policies"]["odma"]["continue_growth"]
    static, odma = text["static"], text["odma:median"]
    assert static["peak_running"] <= static["worst_case_fit"]  # static holds every request's worst case
    assert odma["peak_running"] >= static["peak_running"]
    assert "staged in" in result["_stdout"]
    # the summary printed after the bench: every burst of both traces, with its ratio to paged
    summary = (result["_out"] / "summary.txt").read_text()
    assert summary in result["_stdout"] and f"engine {sharegpt} (8 requests):" in summary
    ratios = {p: runs[sharegpt][f"{p}_vs_paged"] for p in runs[sharegpt]["policies"] if f"{p}_vs_paged" in runs[sharegpt]}
    assert len(ratios) == 4  # every odma variant
    for policy, ratio in [*ratios.items(), ("paged", 1.0)]:
        line = next(x for x in summary.splitlines() if x.split() and x.split()[0] == policy)
        assert line.split()[2] == f"{ratio:.3f}", line
    # the kernels' warm-up before any burst: a number of seconds, not an error
    assert isinstance(result["engine"]["kernels_warmed_s"], float), result["engine"]["kernels_warmed_s"]
    http = result["http"]  # odma-serve on the CPU (the tiny random model) against the engine alone, one burst
    for run in ("engine", "server", "server_b"):  # server_b: the same server with its engine in a process of its own
        r = http[run]
        assert r["requests_ok"] == http["requests"] and r["requests_failed"] == 0 and not r["cut_at_cap"], (run, r)
        assert r["output_tokens"] == http["forced_output_tokens"] and r["ttft_p50_s"] > 0, (run, r)
    assert http["tokens_equal"] and http["http_vs_engine"] > 0 and http["server"]["exit_code"] == 0
    assert http["server_b_flags"] == ["--engine-process"] and http["tokens_equal_b"] and http["http_b_vs_engine"] > 0
    peer = result["peer"]  # transformers' continuous batching on the first engine run's burst (ShareGPT's)
    if "skipped" not in peer:
        assert peer["trace"] == sharegpt and peer["requests"] == runs[sharegpt]["work"]["requests"], peer
        assert peer["output_tokens"] == peer["forced_output_tokens"] == runs[sharegpt]["work"]["forced_output_tokens"]
    assert [line.split()[0] for line in (result["_out"] / "parts.txt").read_text().splitlines()] == ["tests", "bench"]


@pytest.mark.parametrize("tagging, policies", [("ahead", "odma,odma-map,paged,static"), ("loop", "odma,odma*0.25")])
def test_every_policy_reports_its_tagging_time_and_first_token_times(tmp_path, tagging, policies):
    from odma.bench import gpu_bench

    result = gpu_bench.run(_args(tmp_path, parts="engine", policies=policies, tagging=tagging))
    run = result["engine"]["runs"]["azure-conv"]
    assert list(run["policies"]) == policies.split(",")
    for policy, r in run["policies"].items():
        assert r["tagging"] == tagging and r["tag_timeouts"] == 0, policy
        assert r["prediction"]["tagged"] == r["requests"] == r["completed"], policy  # tagged, none lost
        assert r["tagging_s"] > 0 and r["tagging_s"] < r["seconds"], policy  # the running median's calls
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] <= r["seconds"], policy
    if "odma*0.25" in run["policies"]:  # a policy's own share of each prediction reaches its engine's pool
        assert run["policies"]["odma*0.25"]["reserve_scale"] == 0.25
        assert run["policies"]["odma"]["reserve_scale"] == 0.5
    if "odma-map" in run["policies"]:  # growth by mapping runs in the engine part (the host's VM on a CPU)
        assert run["policies"]["odma-map"]["growth"] == "map" and run["policies"]["odma"]["growth"] == "copy"


def _args(tmp_path, **overrides):
    import argparse

    from odma.bench import gpu_bench

    parser = argparse.ArgumentParser()
    gpu_bench.add_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--tiny", "--rounds", "1", "--out", str(tmp_path / "r.json")])
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


def test_a_failing_policy_leaves_the_others_numbers(tmp_path, monkeypatch):
    from odma.bench import gpu_bench
    from odma.engine import llm_engine

    real = llm_engine.LLMEngine.__init__

    def broken_paged(self, config, *a, **kw):
        if config.policy == "paged":
            raise RuntimeError("injected: the paged pool failed to start")
        real(self, config, *a, **kw)

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", broken_paged)
    gpu_bench.run(_args(tmp_path, parts="engine", policies="static,paged,odma"))
    saved = json.loads((tmp_path / "r.json").read_text())["engine"]["runs"]["azure-conv"]["policies"]
    assert saved["paged"] == {"error": "RuntimeError: injected: the paged pool failed to start"}
    assert saved["static"]["output_tokens"] > 0 and saved["odma"]["output_tokens"] > 0


def test_a_part_at_its_cap_says_what_it_skipped_and_the_next_part_runs(tmp_path):
    from odma.bench import gpu_bench

    result = gpu_bench.run(_args(tmp_path, parts="kernels,vmm", caps="kernels=0"))
    assert result["kernels"]["rows"] == [] and len(result["kernels"]["skipped"]) == 4
    assert len(result["vmm"]["rows"]) == 2
    assert json.loads((tmp_path / "r.json").read_text())["vmm"] == result["vmm"]


def test_a_part_that_fails_midway_keeps_its_measured_rows(tmp_path, monkeypatch):
    from odma.bench import gpu_bench, gpu_kernels

    real = gpu_kernels._kernel_row
    calls = []

    def second_row_breaks_the_part(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("injected")
        return real(*a, **kw)

    monkeypatch.setattr(gpu_kernels, "_kernel_row", second_row_breaks_the_part)
    result = gpu_bench.run(_args(tmp_path, parts="kernels", contexts="64", batches="1,2,4"))
    rows = result["kernels"]["rows"]
    assert "contiguous_us" in rows[0]["result"] and rows[1]["result"] == {"error": "MemoryError: injected"}
    assert "contiguous_us" in rows[2]["result"]
