"""odma-analyze replay: answers known by hand, conservation, determinism, and the real pool underneath."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from odma.kv import ContiguousKV, KVPool
from odma.analyze.experiment import ExperimentSpec, run_experiment
from odma.analyze.policies import BuildContext, build_manager, parse_policy
from odma.analyze.predictions import oracle_predictions
from odma.analyze.profiles import PROFILES, CostModel
from odma.analyze.replay import EngineSpec, EventReplay
from odma.analyze.workload import WorkloadSpec, build_workload
from odma.errors import ConfigError
from odma.traces import Trace, TraceRecord

FIXTURE = Path(__file__).resolve().parent.parent / "datasets" / "fixtures" / "analyze_trace.jsonl"
ALL = "static,s3,odma-published,odma,oracle,oracle-bucketed,paged,grow32,grow-buckets"


def equal_trace(n=40, prompt=10, output=22) -> Trace:
    return Trace("equal", [TraceRecord(f"r{i}", None, prompt, output) for i in range(n)], "source")


def run(trace, policies=ALL, budget=4096, predictor="oracle", **workload) -> dict:
    spec = ExperimentSpec(
        trace=trace.name if isinstance(trace, Trace) else str(trace),
        policies=policies,
        predictor=predictor,
        budget_tokens=budget,
        buckets=4,
        workload=WorkloadSpec(**{"max_new_tokens": 64, "max_model_len": 1024, **workload}),
    )
    return run_experiment(spec, trace=trace if isinstance(trace, Trace) else None)


def test_equal_lengths_give_efficiencies_computable_by_hand():
    # prompt 10 + output 22 = 32 tokens; blocks are 16-token aligned; max_new_tokens 64, K = 4.
    # 100 requests: enough history (>= min_samples 64) for the dynamic buckets to leave their defaults.
    res = run(equal_trace(100))["policies"]
    assert res["oracle"]["reservation_efficiency"] == 1.0  # 32 / align(32)
    assert res["paged"]["reservation_efficiency"] == 1.0  # two full 16-token pages
    assert res["static"]["reservation_efficiency"] == pytest.approx(32 / 80)  # align(10 + 64)
    # s3: equal-width bounds (16, 32, 48, 64) → the 32 bucket → align(10 + 32) = 48
    assert res["s3"]["reservation_efficiency"] == pytest.approx(32 / 48)
    # dynamic buckets learn that every length is 22 → bound align(22) = 32 → again 48
    assert res["odma"]["reservation_efficiency"] == pytest.approx(32 / 48)
    assert res["oracle-bucketed"]["reservation_efficiency"] == pytest.approx(32 / 48)
    for name, r in res.items():
        assert r["completed"] == 100 and r["lost"] == 0, name
        assert r["migrations"] == 0 or name in ("grow32", "grow-buckets"), name


def test_equal_lengths_concurrency_is_the_budget_over_the_block():
    # 4096 tokens / 80-token static blocks = 51 requests at once; all 40 fit: no one waits.
    res = run(equal_trace(), budget=4096)["policies"]
    assert res["static"]["waited_for_memory"] == 0
    # 800 tokens hold 10 static blocks: the other 30 must wait, and nothing is lost
    res = run(equal_trace(), budget=800, policies="static,oracle,paged")["policies"]
    assert res["static"]["waited_for_memory"] == 30
    assert res["oracle"]["waited_for_memory"] == 40 - 800 // 32
    assert all(r["lost"] == 0 and r["completed"] == 40 for r in res.values())


def test_every_arrival_completes_or_is_refused_under_pressure():
    trace_records = [TraceRecord(f"q{i}", None, 5 + (i * 37) % 90, 1 + (i * 53) % 300) for i in range(200)]
    trace_records.append(TraceRecord("huge", None, 2000, 10))  # prompt + max_new over max_model_len
    trace_records.append(TraceRecord("zero", None, 7, 0))  # counted as one token
    trace_records.append(TraceRecord("long", None, 7, 5000))  # clipped to max_new_tokens
    trace = Trace("mixed", trace_records, "source")
    result = run(trace, budget=1024, predictor="noisy-oracle:0.8", max_new_tokens=320)
    w = result["workload"]
    assert (w["arrivals"], w["refused_too_large"]) == (203, 1)
    assert w["zero_outputs_raised_to_one"] == 1 and w["clipped_to_max_new_tokens"] == 1
    for name, r in result["policies"].items():
        assert r["completed"] + r["refused_admissions"] == 203, name
        assert r["lost"] == 0, name


def test_growth_deadlock_is_broken_by_preemption_and_nothing_is_lost():
    # 256 tokens; grow32 reserves 16 + 32, so 5 requests start; they all need to grow at once.
    trace = Trace("tight", [TraceRecord(f"t{i}", None, 16, 100) for i in range(8)], "source")
    res = run(trace, policies="grow32,paged", budget=256, max_new_tokens=128)["policies"]
    assert res["grow32"]["preemptions"] > 0 and res["grow32"]["stall_steps"] > 0
    assert res["grow32"]["recomputed_tokens"] > 0
    for r in res.values():
        assert r["completed"] == 8 and r["lost"] == 0


def test_same_seed_same_json():
    a = run(FIXTURE, predictor="noisy-oracle:0.5", budget=3000, requests=150, arrivals="poisson", rate=20.0, seed=3)
    b = run(FIXTURE, predictor="noisy-oracle:0.5", budget=3000, requests=150, arrivals="poisson", rate=20.0, seed=3)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    c = run(FIXTURE, predictor="noisy-oracle:0.5", budget=3000, requests=150, arrivals="poisson", rate=20.0, seed=4)
    assert json.dumps(a, sort_keys=True) != json.dumps(c, sort_keys=True)


def test_replay_drives_the_real_pool():
    trace = Trace("f", [TraceRecord(f"r{i}", None, 20, 5 + 7 * i) for i in range(30)], "source")
    workload = build_workload(trace, WorkloadSpec(max_new_tokens=256, max_model_len=1024))
    ctx = BuildContext(total_tokens=2048, max_new_tokens=256, buckets=4, bootstrap=workload.bootstrap_lengths)
    spec = parse_policy("odma/scale=0.5")  # reserve half the prediction: growth by migration must happen
    manager = build_manager(spec, ctx)
    assert isinstance(manager, ContiguousKV) and isinstance(manager.pool, KVPool)
    result = EventReplay(workload, spec, manager, CostModel(PROFILES["mlu370-qwen7b"]), oracle_predictions(workload)).run()
    stats = manager.pool.stats()
    assert stats.releases == 30 + result["preemptions"] and stats.live_blocks == 0 and stats.reserved_tokens == 0
    assert stats.migrations == result["migrations"] > 0
    assert stats.reservations == 30 + result["preemptions"]
    manager.pool.check_invariants()


def test_trace_arrivals_are_kept_and_latencies_are_positive():
    result = run(FIXTURE, policies="odma,paged", predictor="noisy-oracle:0.8", arrivals="trace", budget=100_000)
    for r in result["policies"].values():
        assert r["completed"] == 60 and r["lost"] == 0
        assert r["ttft_p50_s"] > 0 and r["tpot_p50_s"] > 0
        assert r["live_utilization"] is None  # plenty of memory: never memory-bound


def test_a_policy_needing_a_predictor_says_so():
    with pytest.raises(ConfigError, match="predictor"):
        run(equal_trace(), policies="odma", predictor=None)


def test_request_larger_than_any_block_is_rejected_up_front():
    with pytest.raises(ConfigError, match="largest block"):
        run(equal_trace(), policies="static", budget=64, max_model_len=1024)


def test_engine_spec_validates():
    with pytest.raises(ConfigError):
        EngineSpec(max_prefill_tokens=0)


def test_preempt_mode_frees_memory_at_once_and_nothing_is_lost():
    trace = Trace("tight", [TraceRecord(f"t{i}", None, 16, 100) for i in range(8)], "source")
    spec = ExperimentSpec(trace="tight", policies="grow32,paged,odma/scale=0.3", predictor="oracle",
                          budget_tokens=256, engine=EngineSpec(on_full="preempt"),
                          workload=WorkloadSpec(max_new_tokens=128, max_model_len=1024))
    res = run_experiment(spec, trace=trace)["policies"]
    assert res["grow32"]["preemptions"] > 0 and res["grow32"]["stall_steps"] == 0
    for r in res.values():
        assert r["completed"] == 8 and r["lost"] == 0


def test_a_per_policy_batch_cap_limits_concurrency():
    res = run(equal_trace(100), policies="paged,paged/batch=5", budget=100_000)["policies"]
    assert res["paged/batch=5"]["mean_concurrency"] <= 5 < res["paged"]["mean_concurrency"]
    assert res["paged/batch=5"]["lost"] == 0


def test_tiling_keeps_ids_unique_and_remembers_the_source():
    w = build_workload(equal_trace(3), WorkloadSpec(requests=7, max_new_tokens=64, max_model_len=1024))
    assert [i.request_id for i in w.items] == ["r0", "r1", "r2", "r0#1", "r1#1", "r2#1", "r0#2"]
    assert [i.source_index for i in w.items] == [0, 1, 2, 0, 1, 2, 0]


def test_test_split_replays_only_held_out_requests_and_json_is_strict():
    result = run(FIXTURE, policies="odma,oracle,paged", predictor="noisy-oracle:0.8", split="test", requests=50)
    assert result["workload"]["name"].endswith(":test") and result["workload"]["arrivals"] == 50
    json.dumps(result, allow_nan=False)  # no Infinity / NaN: the files must load anywhere


def run_engine(trace, policies, budget, **workload) -> dict:
    spec = ExperimentSpec(trace=trace.name if isinstance(trace, Trace) else str(trace), policies=policies,
                          predictor="oracle", budget_tokens=budget, buckets=4, engine=EngineSpec(scheduler="engine"),
                          workload=WorkloadSpec(**{"max_new_tokens": 64, "max_model_len": 1024, **workload}))
    return run_experiment(spec, trace=trace if isinstance(trace, Trace) else None)


def test_the_engine_scheduler_replays_every_policy_without_loss():
    """--scheduler engine: the server's own Scheduler through the simulation driver, on the same memory."""
    res = run_engine(FIXTURE, "static,s3,odma,oracle,paged,grow32", budget=1024)
    out_tokens = None
    for name, r in res["policies"].items():
        assert r["scheduler"] == "engine", name
        assert r["completed"] == r["arrivals"] - r["refused_admissions"] and r["lost"] == 0, name
        assert r["latency_p99_s"] >= r["ttft_p99_s"] > 0, name  # a request ends after its first token
        tokens = r["throughput_tps"] * r["makespan_s"]
        out_tokens = tokens if out_tokens is None else out_tokens
        assert tokens == pytest.approx(out_tokens, rel=1e-4), name  # the same work in every policy
    p = res["policies"]
    assert p["static"]["migrations"] == 0 and p["grow32"]["migrations"] > 0
    assert p["grow32"]["copied_tokens"] > 0 and p["paged"]["copied_tokens"] == 0
    # 1,024 tokens hold few worst-case blocks: reserving what is needed serves more at once, so finishes sooner
    assert p["oracle"]["throughput_tps"] > p["static"]["throughput_tps"]
    assert p["oracle"]["mean_concurrency"] > p["static"]["mean_concurrency"]


def test_the_engine_scheduler_charges_migrations_to_the_clock():
    """The same equal-length work twice: reserving 32 tokens and growing by copies costs steps of copying that
    exact reservation does not."""
    res = run_engine(equal_trace(40, prompt=10, output=60), "oracle,grow32", budget=8192)["policies"]
    assert res["grow32"]["migrations"] == 40 and res["oracle"]["migrations"] == 0
    assert res["grow32"]["makespan_s"] > res["oracle"]["makespan_s"]


def test_admission_by_predicted_demand_admits_what_memory_can_finish():
    """40 equal requests (10 + 60 tokens) in 700 slots, reserving a quarter of L̂ and growing bucket by bucket: the
    pool alone admits more than it can grow (21 at once, 3,441 stalled request-steps); admitting by predicted demand
    (oracle L̂, unscaled as the engine keeps it: 70 tokens each) runs at most 10 at once, hardly stalls (blocks round
    up to bucket bounds) and finishes sooner. Both finish everything."""
    policy = "odma/bounds=equal-width/scale=0.25"
    res = run_engine(equal_trace(40, prompt=10, output=60), f"{policy},{policy}/demand=1.0", budget=700)["policies"]
    pool_only, demand = res[policy], res[f"{policy}/demand=1.0"]
    assert pool_only["peak_running"] > 10 and demand["peak_running"] <= 10 and demand["demand_refusals"] > 0
    assert demand["stall_steps"] * 10 < pool_only["stall_steps"]
    assert demand["makespan_s"] < pool_only["makespan_s"]
    for r in (pool_only, demand):
        assert r["completed"] == 40 and r["lost"] == 0
    with pytest.raises(ConfigError, match="--scheduler engine"):
        run(equal_trace(4, prompt=10, output=60), f"{policy}/demand=1.0", budget=700)


def test_a_growth_hint_makes_one_growth_of_several():
    """Equal 60-token outputs reserved for a guess of 8 in equal-width buckets (16/32/48/64): without a hint a
    request climbs bucket by bucket (3 growths); hinted with its realized length it grows once."""
    names = [f"odma/predict=8/bounds=equal-width{h}" for h in ("", "/hint=oracle", "/hint=pred")]
    res = run(equal_trace(100, prompt=10, output=60), ",".join(names), budget=8192)["policies"]
    plain, oracle, pred = (res[n] for n in names)
    assert plain["migrations"] == 300 and oracle["migrations"] == 100
    assert pred["migrations"] == plain["migrations"]  # a hint no larger than what is needed changes nothing
    for r in (plain, oracle, pred):
        assert r["completed"] == 100 and r["lost"] == 0


def test_the_engine_scheduler_replays_chunked_prefill_and_the_event_approximation_refuses_it():
    """Prompts of 300 tokens under a 64-token step budget: chunked, each takes several steps beside the running
    decodes (so the first tokens come later than with whole prompts, and the steps are more), nothing lost."""
    with pytest.raises(ConfigError, match="engine scheduler"):
        EngineSpec(chunked_prefill=True)
    trace = Trace("long", [TraceRecord(f"l{i}", None, 300, 20) for i in range(6)], "source")
    rows = {}
    for chunked in (False, True):
        spec = ExperimentSpec(trace="long", policies="oracle", predictor="oracle", budget_tokens=8192, buckets=4,
                              engine=EngineSpec(scheduler="engine", max_prefill_tokens=64, chunked_prefill=chunked),
                              workload=WorkloadSpec(max_new_tokens=64, max_model_len=1024))
        rows[chunked] = run_experiment(spec, trace=trace)["policies"]["oracle"]
        assert rows[chunked]["completed"] == 6 and rows[chunked]["lost"] == 0
    assert rows[True]["steps"] > rows[False]["steps"]
    assert rows[True]["ttft_p50_s"] > rows[False]["ttft_p50_s"]
