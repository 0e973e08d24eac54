"""The engine's own scheduler and memory, driven without a model: one simulation driver.

Jobs arrive at their times; each round the engine's `Scheduler` plans a step over its `KVManager`; a step-time
model charges the step (plus any swap copies); every planned item then advances as a model step would (its
tokens cached, one token emitted unless it was a chunk of a longer prefill) and jobs that reached their length
finish and release their memory. `odma-bench scheduler` and `odma-bench balloon` are configurations of it (a
step-time table measured on this CPU); `odma-analyze replay --scheduler engine` runs a replay workload through
it on a device profile's cost model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from odma.analyze.profiles import StepWork


class StepModel(Protocol):
    def step_seconds(self, work: StepWork) -> float:
        """Seconds one engine step takes."""


def parse_step_table(spec: str) -> tuple[list[float], list[float]]:
    """"batch:ms,batch:ms,..." → (batch sizes, seconds), with (0, 0) first: the decode-time table."""
    pairs = sorted((float(b), float(ms) / 1000) for b, ms in (item.split(":") for item in spec.split(",")))
    return [0.0] + [b for b, _ in pairs], [0.0] + [s for _, s in pairs]


@dataclass(frozen=True)
class TableStepModel:
    """A step-time model measured on a CPU: a decode step costs the interpolated time for its batch size, plus
    `kv_ms_per_1k` per 1K context tokens its requests read; a prefill chunk of q tokens after `start` cached
    ones costs q × (prefill_ms_per_token + prefill_ms_per_1k_context × (start + q) / 1K)."""

    decode: tuple[list[float], list[float]]  # parse_step_table's (batch sizes, seconds)
    prefill_ms_per_token: float
    kv_ms_per_1k: float = 0.0
    prefill_ms_per_1k_context: float = 0.0

    def step_seconds(self, work: StepWork) -> float:
        xs, ys = self.decode
        prefill_ms = sum(q * (self.prefill_ms_per_token + self.prefill_ms_per_1k_context * (start + q) / 1e3)
                         for start, q in work.prefill_chunks)
        return float(np.interp(work.decode_tokens, xs, ys)) + (self.kv_ms_per_1k * work.kv_tokens_read / 1e3
                                                               + prefill_ms) / 1e3


@dataclass(frozen=True, slots=True)
class SimJob:
    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int  # it generates exactly this many tokens
    max_tokens: int
    prediction: tuple[float, float] | None = None  # the predictor's (L̂, u); None: untagged
    growth_hint: float | None = None  # output tokens its first growth should hold (Sequence.growth_hint)
    # L̂ itself where `prediction` holds the replay's scaled view of it (scale=): the engine keeps L̂ unscaled on
    # the request and scales in the pool, and admission by predicted demand reads it. None: `prediction`'s
    predicted_output: float | None = None


@dataclass(slots=True)
class SimRecord:
    job: SimJob
    first_token_s: float | None = None
    finish_s: float | None = None

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.job.arrival_s

    @property
    def latency_s(self) -> float:
        return self.finish_s - self.job.arrival_s


@dataclass(slots=True)
class SimResult:
    clock: float  # simulated seconds until the last job finished
    steps: int
    peak_running: int
    running_time: float  # ∫ running requests dt
    prefill_tokens: int
    records: dict[str, SimRecord] = field(default_factory=dict)

    @property
    def completed(self) -> int:
        return sum(r.finish_s is not None for r in self.records.values())


def sim_sequence(job: SimJob):
    """The engine's Sequence for a job: placeholder tokens, tagged with the predictor's (L̂, u) when it has one."""
    from odma.engine.sampling import SamplingParams
    from odma.engine.sequence import Sequence

    seq = Sequence(job.request_id, [0] * job.prompt_tokens, SamplingParams(max_tokens=job.max_tokens))
    seq.growth_hint = job.growth_hint
    if job.prediction is not None:
        length, u = job.prediction
        seq.predicted_length = seq.predicted_tokens = float(length)
        if job.predicted_output is not None:
            seq.predicted_length = float(job.predicted_output)
        seq.uncertainty = float(u)
    return seq


def advance(scheduler, work, buckets, target: dict[str, int]) -> list:
    """What a model step does to the bookkeeping: every item's tokens are cached and it emits one token (none
    after a chunk of a longer prefill); requests that reached their target length finish (their memory is
    released). Returns those. Bucket bounds are refreshed when due, as the engine does after a step."""
    finished = []
    for w in work:
        seq = w.seq
        seq.num_cached = w.start + w.q_len
        if seq.num_cached < seq.num_tokens:
            continue
        seq.output_ids.append(0)
        if seq.num_generated >= target[seq.request_id]:
            scheduler.finish(seq, "stop")
            finished.append(seq)
    if buckets is not None and buckets.refresh_due():
        buckets.refresh()
    return finished


def step_work(work, copied_tokens: int = 0) -> StepWork:
    """What the planned items ask of the model: decode tokens and the context they read, prefill chunks, and the
    tokens growth copied while the step was planned."""
    decode = [w for w in work if w.q_len == 1]
    prefills = tuple((w.start, w.q_len) for w in work if w.q_len > 1)
    return StepWork(len(decode), sum(w.start for w in decode), sum(q for _, q in prefills), copied_tokens,
                    prefills)


def simulate(jobs: Sequence[SimJob], scheduler, step_model: StepModel, *, buckets=None, swap=None,
             on_step: Callable[[Any, StepWork], None] | None = None, check_every: int = 100) -> SimResult:
    """Run every job to completion through `scheduler` (the engine's `Scheduler` over a `KVManager`).

    `swap`: the modelled host buffer of swap preemption (its copies cost time); `on_step(work, step)` sees every
    planned step before it runs (e.g. ballooning's activation invariant); the memory's invariants are checked
    every `check_every` steps and at the end."""
    kv = scheduler.kv
    pending = sorted(jobs, key=lambda j: j.arrival_s)  # stable: jobs arriving together keep their order
    target = {j.request_id: j.output_tokens for j in jobs}
    records = {j.request_id: SimRecord(j) for j in jobs}
    result = SimResult(0.0, 0, 0, 0.0, 0, records)
    clock = 0.0
    i = idle = done = 0
    charged = kv.copied_tokens
    while done < len(jobs):
        while i < len(pending) and pending[i].arrival_s <= clock:
            scheduler.add(sim_sequence(pending[i]))
            i += 1
        work = scheduler.schedule()
        if swap is not None:
            clock += swap.take_seconds()
        if not work:
            # a round without work preempts the newest running request (room for the others to grow): allow
            # one such round per running request before calling it stuck
            if scheduler.has_work() and idle <= len(scheduler.running) + 2:
                idle += 1
                continue
            if i < len(pending):
                clock = max(clock, pending[i].arrival_s)
                continue
            raise RuntimeError(f"requests remain but nothing can be scheduled: {len(scheduler.running)} running, "
                               f"{len(scheduler.waiting)} waiting, {kv.counters()}")
        idle = 0
        planned = step_work(work, kv.copied_tokens - charged)  # copies of workless rounds count too
        charged = kv.copied_tokens
        if on_step is not None:
            on_step(work, planned)
        dt = step_model.step_seconds(planned)
        result.running_time += len(scheduler.running) * dt
        clock += dt
        result.steps += 1
        result.prefill_tokens += planned.prefill_tokens
        result.peak_running = max(result.peak_running, len(scheduler.running))
        for w in work:
            if w.seq.num_generated == 0 and w.start + w.q_len == w.seq.num_tokens:  # it emits its first token
                records[w.seq.request_id].first_token_s = clock
        for seq in advance(scheduler, work, buckets, target):
            records[seq.request_id].finish_s = clock
            done += 1
        if result.steps % check_every == 0:
            kv.check()
    kv.check()
    result.clock = clock
    return result
