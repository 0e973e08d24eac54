"""Several engines behind one router, without a model: `odma-serve --ray`'s placement replayed on a profile's cost
model, to compare routers at replica counts this machine cannot run.

Each replica is the engine's own `Scheduler` over its own `KVManager` (a policy's manager, as `odma-analyze replay
--scheduler engine` builds it, with a share of the budget) and keeps its own clock: it plans a step, the step takes
the cost model's time, then its tokens advance as in `odma.analyze.simulate`. A request is routed when it arrives:
- `pow2`: Ray Serve's default, two replicas drawn at random, the one with fewer requests (running + waiting);
- `jsq`: the replica with the fewest requests of all (the control: all of `odma`'s information, none of its memory);
- `odma`: `odma.serve_ray.scoring`, the memory-aware router, on every replica's load at that instant (reports that
  are never stale: the best case for it), with its rule for no room anywhere (the replica closest to room);
- `odma-typical`: the same router sizing every request by the replicas' typical need instead of its own (what it
  can do when the engines are the ingress and Ray's proxy does not read the request).
Modelled apart from the deployment: bucket bounds are per replica (the deployment shares them), nothing is held at
the router (its default), no Ray hop.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Sequence

from odma.analyze.simulate import SimJob, StepModel, advance, sim_sequence, step_work
from odma.serve_ray.scoring import Candidate, ReplicaLoad, load_of, rank_replicas, typical_need

ROUTERS = ("pow2", "jsq", "odma", "odma-typical")


@dataclass(slots=True)
class _Replica:
    scheduler: object
    busy_until: float = math.inf  # the end of the step in flight; inf: idle
    work: list = field(default_factory=list)
    steps: int = 0
    routed: int = 0


def replica_load(scheduler, max_num_seqs: int, now: float) -> ReplicaLoad:
    """What a replica of one device reports (`odma.serve_ray.replica.replica_load`)."""
    return load_of([scheduler], waiting=len(scheduler.waiting), max_num_seqs=max_num_seqs,
                   max_request_tokens=scheduler.kv.max_request_tokens, at=now)


def replay_cluster(jobs: Sequence[SimJob], schedulers: list, step_model: StepModel, router: str, *,
                   max_num_seqs: int, seed: int = 0, w_memory: float = 1.0, w_compute: float = 1.0) -> dict:
    """Run every job to completion over `schedulers` (one per replica) behind `router`; latency and throughput."""
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    rng = random.Random(seed)
    replicas = [_Replica(s) for s in schedulers]
    pending = sorted(jobs, key=lambda j: j.arrival_s)
    target = {j.request_id: j.output_tokens for j in jobs}
    first: dict[str, float] = {}
    finish: dict[str, float] = {}
    i = 0

    def start(r: _Replica, now: float) -> None:
        """Plan r's next step at `now` (a round without work preempts as the engine does; bounded retries)."""
        kv = r.scheduler.kv
        before = kv.copied_tokens
        for _ in range(len(r.scheduler.running) + 3):
            work = r.scheduler.schedule()
            if work or not r.scheduler.has_work():
                break
        if not work:
            r.busy_until, r.work = math.inf, []
            return
        r.work = work
        r.busy_until = now + step_model.step_seconds(step_work(work, kv.copied_tokens - before))

    def queue(r: _Replica) -> int:
        return len(r.scheduler.running) + len(r.scheduler.waiting)

    def choose(seq) -> _Replica:
        if router == "jsq":
            return min(replicas, key=queue)
        if router == "pow2" or len(replicas) == 1:
            a, b = rng.sample(replicas, 2) if len(replicas) > 1 else (replicas[0], replicas[0])
            return a if queue(a) <= queue(b) else b
        candidates = [Candidate(k, replica_load(r.scheduler, max_num_seqs, now)) for k, r in enumerate(replicas)]
        if router == "odma-typical":
            need = typical_need(c.load for c in candidates)
        else:
            need = schedulers[0].kv.initial_tokens(seq)
        fitting, short = rank_replicas(candidates, need, w_memory=w_memory, w_compute=w_compute)
        return replicas[(fitting or short)[0]]

    now = 0.0
    while len(finish) < len(jobs):
        next_done = min(r.busy_until for r in replicas)
        next_arrival = pending[i].arrival_s if i < len(pending) else math.inf
        if next_arrival <= next_done:
            if next_arrival == math.inf:
                raise RuntimeError(f"requests remain but no replica can step: {len(finish)} of {len(jobs)} done")
            now = next_arrival
            seq = sim_sequence(pending[i])
            r = choose(seq)
            r.scheduler.add(seq)
            r.routed += 1
            i += 1
            if r.busy_until == math.inf:
                start(r, now)
            continue
        r = min(replicas, key=lambda x: x.busy_until)
        now = r.busy_until
        for w in r.work:
            if w.seq.num_generated == 0 and w.start + w.q_len == w.seq.num_tokens:
                first[w.seq.request_id] = now
        for seq in advance(r.scheduler, r.work, None, target):  # a ContiguousKV refreshes its bounds on release
            finish[seq.request_id] = now
        r.steps += 1
        if r.steps % 100 == 0:  # the memory's invariants, as simulate() checks them
            r.scheduler.kv.check()
        start(r, now)
    for r in replicas:
        r.scheduler.kv.check()
    arrival = {j.request_id: j.arrival_s for j in jobs}
    latency = sorted(finish[k] - arrival[k] for k in finish)
    ttft = sorted(first[k] - arrival[k] for k in first)
    makespan = max(finish.values()) - min(arrival.values()) if finish else 0.0

    def pct(xs: list[float], q: float) -> float:
        return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))] if xs else float("nan")

    return {
        "router": router, "replicas": len(replicas), "completed": len(finish),
        "throughput_tps": sum(j.output_tokens for j in jobs) / max(makespan, 1e-12),
        "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
        "latency_mean_s": sum(latency) / len(latency), "latency_p99_s": pct(latency, 0.99),
        "makespan_s": makespan, "routed": [r.routed for r in replicas],
        "preemptions": sum(r.scheduler.counters.preemptions for r in replicas),
        "migrations": sum(r.scheduler.counters.migrations for r in replicas),
    }
