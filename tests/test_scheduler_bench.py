"""`odma-bench scheduler`: the engine's Scheduler and KVPool on a trace, without a model."""

from __future__ import annotations

import argparse

import pytest

from odma.analyze.profiles import StepWork
from odma.analyze.simulate import TableStepModel, parse_step_table
from odma.bench import scheduler_bench


def _args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    scheduler_bench.add_arguments(p)
    return p.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


def test_every_policy_completes_the_same_tokens_and_static_never_grows():
    result = scheduler_bench.run(_args(num=40, kv_budget="32MiB", predictor="oracle"))
    runs = {(r["policy"], r["preempt"]): r for r in result["runs"]}
    assert set(runs) == {("static", "wait"), ("odma", "wait"), ("odma", "recompute"), ("odma", "swap"),
                         ("s3", "wait"), ("s3", "recompute"), ("s3", "swap")}
    tokens = {r["completion_tokens"] for r in runs.values()}
    assert len(tokens) == 1  # nothing lost, nothing cut short
    static = runs["static", "wait"]
    assert static["migrations"] == static["preemptions"] == static["stalls"] == 0
    # static reserves prompt + 512 per request: 32 MiB (720 tokens) holds one at a time
    assert static["peak_running"] == 1
    assert runs["odma", "wait"]["peak_running"] > 1


def test_step_time_table_is_interpolated():
    table = parse_step_table("1:10,11:110")
    assert table == ([0.0, 1.0, 11.0], [0.0, 0.01, 0.11])
    model = TableStepModel(table, prefill_ms_per_token=2.0)
    assert model.step_seconds(StepWork(6, 0, 0)) == pytest.approx(0.06)  # between 1 (10 ms) and 11 (110 ms)
    assert model.step_seconds(StepWork(1, 0, 30, prefill_chunks=((0, 10), (0, 20)))) == pytest.approx(0.07)


def test_swap_keeps_the_cached_tokens_instead_of_recomputing_them():
    result = scheduler_bench.run(_args(num=40, kv_budget="32MiB", predictor="oracle", policies="odma",
                                       preempt="recompute,swap"))
    runs = {r["preempt"]: r for r in result["runs"]}
    assert runs["swap"]["completion_tokens"] == runs["recompute"]["completion_tokens"]
    swap = runs["swap"]
    assert swap["preemptions"] > 0 and swap["swap_outs"] == swap["preemptions"]
    assert swap["swapped_bytes"] > 0 and swap["peak_host_bytes"] > 0
    # recomputation re-prefills what swapping copies back: strictly fewer prefill tokens with swap
    assert swap["prefill_tokens"] < runs["recompute"]["prefill_tokens"]
