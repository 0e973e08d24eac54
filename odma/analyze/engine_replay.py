"""`odma-analyze replay --scheduler engine`: a replay workload through the serving engine's own `Scheduler`
(`odma.analyze.simulate`) on a profile's cost model, instead of the replay's event-driven loop.

Slower (every running request advances every step, as in the server), but it is the scheduling the server runs:
its admission order and starvation guard, its preemption, window clearing and length-aware ordering. The KV
memory is the same `KVManager` the event-driven replay builds for the policy.
"""

from __future__ import annotations

from odma.analyze.metrics import _pct, _r
from odma.analyze.policies import PolicySpec, hint_for, predicted_for
from odma.analyze.predictions import Predictions
from odma.analyze.profiles import CostModel
from odma.analyze.simulate import SimJob, simulate
from odma.analyze.workload import Workload
from odma.errors import ConfigError
from odma.kv import KVManager


def jobs_for(workload: Workload, spec: PolicySpec, predictions: Predictions | None) -> list[SimJob]:
    """One job per workload item, tagged with the L̂ the policy hands the pool (and u from the predictor)."""
    jobs = []
    for i, it in enumerate(workload.items):
        length = predicted_for(spec, predictions.lengths[i] if predictions else 0.0, it.output_tokens)
        u = predictions.uncertainties[i] if predictions and spec.predict == "predictor" else 0.0
        hint = hint_for(spec, predictions.lengths[i] if predictions else 0.0, u, it.output_tokens,
                        predictions.calibrated if predictions else None)
        # admission by demand reads L̂ unscaled, as the engine keeps it (only then: the other replays stay as recorded)
        raw = length / spec.scale if spec.demand is not None and length is not None else None
        jobs.append(SimJob(it.request_id, it.arrival_s, it.prompt_tokens, it.output_tokens, it.max_new_tokens,
                           None if length is None else (length, u), hint, raw))
    return jobs


def run_with_engine(workload: Workload, spec: PolicySpec, manager: KVManager, cost: CostModel,
                    predictions: Predictions | None, engine) -> dict:
    """Replay one policy through the engine's scheduler; the replay's JSON keys where they mean the same."""
    from odma.engine.prefill_cost import PLAIN_TOKENS
    from odma.engine.scheduler import Scheduler
    from odma.engine.scheduler_config import SchedulerConfig

    if spec.predict == "predictor" and predictions is None:
        raise ConfigError(f"policy {spec.name} needs a predictor (--predictor)")
    worst = max((i.prompt_tokens + i.max_new_tokens for i in workload.items), default=0)
    if worst > manager.max_request_tokens:
        raise ConfigError(f"policy {spec.name}: a request may need {worst} tokens but the largest block holds "
                          f"{manager.max_request_tokens}; lower --max-model-len or enlarge the budget")
    on_full = spec.on_full or engine.on_full
    preempt = "recompute" if on_full == "preempt" or (on_full == "auto" and spec.kind == "paged") else "wait"
    max_batch = spec.max_batch if spec.max_batch is not None else engine.max_batch
    config = SchedulerConfig(
        max_num_seqs=max_batch or max(1, len(workload.items)),
        max_prefill_tokens=engine.max_prefill_tokens,
        # a profile's cost model prices a step, but knows no model shape to price a chunk's attention by
        prefill_cost=PLAIN_TOKENS,
        preempt=preempt,
        order=engine.schedule,
        aging_rounds=engine.sjf_aging_rounds,
        chunk_prefills=engine.chunked_prefill,
        admission_demand=spec.demand,
    )
    scheduler = Scheduler(manager, config)
    jobs = jobs_for(workload, spec, predictions)
    sim = simulate(jobs, scheduler, cost)  # a ContiguousKV refreshes its bucket bounds on release
    records = list(sim.records.values())
    first = min((j.arrival_s for j in jobs), default=0.0)
    makespan = max(sim.clock - first, 1e-12)
    tpot = [(r.finish_s - r.first_token_s) / (r.job.output_tokens - 1) for r in records if r.job.output_tokens > 1]
    latency = [r.latency_s for r in records]
    c = scheduler.counters
    return {
        "policy": spec.name,
        "kind": spec.kind,
        "scheduler": "engine",
        "schedule": engine.schedule,
        "predictor": predictions.source if predictions and spec.predict == "predictor" else spec.predict,
        "arrivals": workload.arrivals,
        "completed": sim.completed,
        "refused_admissions": workload.refused,
        "lost": workload.arrivals - sim.completed - workload.refused,
        "throughput_tps": _r(sum(j.output_tokens for j in jobs) / makespan),
        "mean_concurrency": _r(sim.running_time / max(sim.clock, 1e-12)),
        "peak_running": sim.peak_running,
        "ttft_p50_s": _r(_pct([r.ttft_s for r in records], 0.5)),
        "ttft_p99_s": _r(_pct([r.ttft_s for r in records], 0.99)),
        "tpot_p50_s": _r(_pct(tpot, 0.5)),
        "tpot_p99_s": _r(_pct(tpot, 0.99)),
        "latency_mean_s": _r(sum(latency) / len(latency)) if latency else 0.0,
        "latency_p99_s": _r(_pct(latency, 0.99)),
        "migrations": c.migrations,
        "copied_tokens": manager.copied_tokens,
        "stall_steps": c.stalls,
        "preemptions": c.preemptions,
        "admission_refusals": c.admission_refusals,
        "demand_refusals": c.demand_refusals,
        "makespan_s": _r(makespan),
        "steps": sim.steps,
        **manager.counters(),
    }
