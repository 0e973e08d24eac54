"""One replay experiment: a trace, a set of policies, the same budget and arrivals for all → one JSON."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace

from odma.analyze.engine_replay import run_with_engine
from odma.analyze.policies import DEFAULT_POLICIES, BuildContext, build_manager, parse_policies
from odma.analyze.predictions import Predictions, oracle_predictions, predict
from odma.analyze.profiles import CostModel, load_profile
from odma.analyze.replay import EngineSpec, EventReplay
from odma.analyze.workload import Workload, WorkloadSpec, build_workload
from odma.traces import Trace, load_trace


@dataclass(frozen=True, slots=True)
class ExperimentSpec:
    trace: str
    policies: str = ",".join(DEFAULT_POLICIES)
    predictor: str | None = "noisy-oracle:0.8"  # any spec predictor.load_predictor accepts
    profile: str = "mlu370-qwen7b"
    random_access_ratio: float | None = None  # overrides the profile's B_rand / B_seq
    budget_tokens: int | None = None  # overrides the profile's KV budget (tests, what-ifs)
    decode_compute_bound: bool = True  # False: decode steps cost memory traffic only (no compute roof)
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    engine: EngineSpec = field(default_factory=EngineSpec)
    buckets: int = 8
    window: int = 2000
    refresh_every_n: int = 256
    cold_start: bool = False  # dynamic buckets start from default bounds instead of the trace's history


def run_experiment(spec: ExperimentSpec, trace: Trace | None = None, progress: bool = False,
                   timings: dict | None = None) -> dict:
    """Replay every policy of `spec`; returns a JSON-ready dict (deterministic: no wall-clock values;
    per-policy seconds go to `timings` when given)."""
    profile = load_profile(spec.profile).with_overrides(random_access_ratio=spec.random_access_ratio)
    profile = replace(profile, decode_compute_bound=spec.decode_compute_bound)
    trace = trace if trace is not None else load_trace(spec.trace)
    workload = build_workload(trace, spec.workload)
    policies = parse_policies(spec.policies)
    predictions = predictions_for(workload, spec.predictor, policies)
    total_tokens = spec.budget_tokens or profile.kv_budget_tokens
    ctx = build_context(workload, predictions, total_tokens, buckets=spec.buckets, window=spec.window,
                        refresh_every_n=spec.refresh_every_n, cold_start=spec.cold_start)
    results = {}
    for policy in policies:
        started = time.perf_counter()
        manager = build_manager(policy, ctx)
        cost = CostModel(profile, paged=policy.kind == "paged")
        if spec.engine.scheduler == "engine":
            results[policy.name] = run_with_engine(workload, policy, manager, cost, predictions, spec.engine)
        else:
            results[policy.name] = EventReplay(workload, policy, manager, cost, predictions, spec.engine, progress).run()
        if timings is not None:
            timings[policy.name] = time.perf_counter() - started
    _add_relative(results)
    return {
        "experiment": _spec_json(spec),
        "profile": profile.to_json(),
        "kv_budget_tokens": total_tokens,
        "workload": workload.summary(),
        "predictor": predictions.summary(workload) if predictions else None,
        "policies": results,
    }


def predictions_for(workload: Workload, predictor: str | None, policies) -> Predictions | None:
    """The predictor's predictions for the workload, when one of the policies reserves by them."""
    if not any(p.predict == "predictor" for p in policies):
        return None
    if predictor is None:
        return None  # Replay raises a clear error for the policy that needs one
    if predictor == "oracle":
        return oracle_predictions(workload)
    return predict(workload, predictor)


def build_context(workload: Workload, predictions: Predictions | None, total_tokens: int, *, buckets: int = 8,
                  window: int = 2000, refresh_every_n: int = 256, cold_start: bool = False) -> BuildContext:
    """What every policy's manager is built from: the budget, the buckets' window (bootstrapped from the trace's
    history unless cold) and the predictor's calibration."""
    return BuildContext(
        total_tokens=total_tokens,
        max_new_tokens=workload.max_new_tokens,
        buckets=buckets,
        window=window,
        refresh_every_n=refresh_every_n,
        bootstrap=() if cold_start else workload.bootstrap_lengths[:window],
        predictor_alpha=predictions.alpha if predictions else None,
        predictor_tau=predictions.tau if predictions else None,
        predictor_ceiling=predictions.ceiling if predictions else None,
        predictor_table=predictions.table if predictions else None,
    )


def _add_relative(results: dict) -> None:
    """Throughput relative to exact reservation and to paged, when those rows exist."""
    for ref in ("oracle", "paged"):
        base = results.get(ref, {}).get("throughput_tps")
        if not base:
            continue
        for r in results.values():
            r[f"tps_vs_{ref}"] = float(f"{r['throughput_tps'] / base:.4g}")


def _spec_json(spec: ExperimentSpec) -> dict:
    d = asdict(spec)
    return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in d.items()}
