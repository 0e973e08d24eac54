"""The router replay (odma.bench.router_replay): every request completes once, on one replica, and memory is
left clean; the memory-aware router sends a request where its block fits."""

from __future__ import annotations

import pytest

from odma.bench.router_replay import replay_cluster, replica_load
from odma.analyze.policies import BuildContext, build_manager, parse_policy
from odma.analyze.simulate import SimJob, TableStepModel, parse_step_table, sim_sequence
from odma.engine.prefill_cost import PLAIN_TOKENS
from odma.engine.scheduler import Scheduler
from odma.engine.scheduler_config import SchedulerConfig

STEP = TableStepModel(parse_step_table("1:10,64:40"), prefill_ms_per_token=0.1)


def schedulers(n: int, tokens: int = 4096, max_batch: int = 8) -> list[Scheduler]:
    ctx = BuildContext(total_tokens=tokens, max_new_tokens=256)
    config = SchedulerConfig(max_num_seqs=max_batch, max_prefill_tokens=1024, prefill_cost=PLAIN_TOKENS,
                             preempt="recompute")
    return [Scheduler(build_manager(parse_policy("odma/predict=oracle"), ctx), config) for _ in range(n)]


def jobs(n: int, every_s: float = 0.05, prefix: str = "r") -> list[SimJob]:
    return [SimJob(f"{prefix}{i}", i * every_s, 20 + 7 * (i % 5), 10 + 37 * (i % 7), 256, (10.0 + 37 * (i % 7), 0.0))
            for i in range(n)]


@pytest.mark.parametrize("router", ["pow2", "jsq", "odma", "odma-typical"])
def test_every_request_completes_once_and_memory_is_left_clean(router):
    replicas = schedulers(3)
    work = jobs(60)
    out = replay_cluster(work, replicas, STEP, router, max_num_seqs=8, seed=1)
    assert out["completed"] == len(work) and sum(out["routed"]) == len(work)
    assert min(out["routed"]) > 0  # the load spreads
    for s in replicas:
        assert not s.running and not s.waiting
        assert s.kv.stats().reserved_tokens == 0
    assert out["throughput_tps"] > 0 and out["latency_p99_s"] >= out["ttft_p99_s"]  # a latency includes its TTFT


def test_the_memory_aware_router_prefers_the_replica_with_room():
    small, large = schedulers(2)
    # the first replica already runs 8 requests (its batch is full, its memory partly taken)
    for j in jobs(8, every_s=0.0, prefix="busy"):
        small.add(sim_sequence(j))
    small.schedule()
    a = replica_load(small, 8, 0.0)
    b = replica_load(large, 8, 0.0)
    assert a.largest_free_tokens < b.largest_free_tokens and a.running > 0 and b.running == 0
    out = replay_cluster(jobs(1), [small, large], STEP, "odma", max_num_seqs=8)
    assert out["routed"] == [0, 1]


def test_an_unknown_router_is_refused():
    with pytest.raises(ValueError, match="router must be one of"):
        replay_cluster(jobs(1), schedulers(1), STEP, "random", max_num_seqs=8)
