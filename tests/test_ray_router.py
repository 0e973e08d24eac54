"""The memory-aware request router as Ray Serve drives it (no Ray cluster: replicas are stand-ins with an id and
their routing stats): it ranks one replica per rank, counts what it sent since a replica's report, holds a
request no replica has room for (with backoff, not a busy loop) and lets the starvation guard release it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'odma[ray]')")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata  # noqa: E402
from ray.serve.request_router import PendingRequest  # noqa: E402

from odma.engine import SamplingParams  # noqa: E402
from odma.serve_ray import scoring  # noqa: E402
from odma.server.wire import RemoteJob  # noqa: E402
from odma.serve_ray.router import MemoryAwareRouter  # noqa: E402
from odma.serve_ray.scoring import ReplicaLoad  # noqa: E402


@dataclass
class Replica:
    replica_id: str
    routing_stats: dict


def stats(largest: int, reserved: int = 0, at: float | None = None, waiting: int = 0) -> dict:
    return ReplicaLoad(4096, reserved, 0, largest, 0, 0, 0, waiting, 64, 4096,
                       time.time() if at is None else at).as_dict()


def request(i: int, need: int) -> PendingRequest:
    job = RemoteJob(f"req-{i}", [1, 2, 3], SamplingParams(max_tokens=8), need=need)
    return PendingRequest(args=[job], kwargs={}, metadata=RequestMetadata(request_id=f"r{i}", internal_request_id=f"i{i}"),
                          created_at=time.time() + i * 1e-3)


def router(**state) -> MemoryAwareRouter:
    r = MemoryAwareRouter(deployment_id=DeploymentID("OdmaEngine", "odma"), handle_source=DeploymentHandleSource.UNKNOWN)
    r.initialize_state(**state)
    return r


@pytest.fixture(autouse=True)
def loop():
    """Ray's PendingRequest makes an asyncio future when built: an event loop must be current."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield loop
    asyncio.set_event_loop(None)
    loop.close()


def choose(r: MemoryAwareRouter, replicas, pr) -> list[list[str]]:
    ranks = asyncio.get_event_loop().run_until_complete(r.choose_replicas(replicas, pr))
    return [[x.replica_id for x in rank] for rank in ranks]


def test_one_replica_per_rank_best_first_and_only_where_it_fits():
    r = router()
    a, b = Replica("a", stats(largest=300, reserved=3000)), Replica("b", stats(largest=3000, reserved=1000))
    assert choose(r, [a, b], request(0, need=200)) == [["b"], ["a"]]  # both fit: lower score first
    assert choose(r, [a, b], request(1, need=1000)) == [["b"]]  # one block of 1000 fits only b


def test_what_it_sent_counts_until_the_replica_reports_it():
    r = router()
    a, b = Replica("a", stats(largest=1000)), Replica("b", stats(largest=1000))
    first = request(0, need=600)
    assert choose(r, [a, b], first)[0] == ["a"]
    r.on_request_routed(first, "a", None)
    second = request(1, need=600)
    assert choose(r, [a, b], second) == [["b"]]  # a's report predates the send: 400 left there
    r.on_request_completed("b", "i1")
    r.on_request_completed("a", "i0")
    assert choose(r, [a, b], request(2, need=600))[0] == ["a"]
    r.on_request_routed(request(3, need=600), "a", None)
    a.routing_stats = stats(largest=400, reserved=600, at=time.time() + 1)  # a report that includes both sends
    assert choose(r, [a, b], request(4, need=300))[0] == ["b"]  # counted once, via the report


def test_a_burst_spreads_before_ray_reports_any_routing():
    """Ray calls on_request_routed only after the replica accepted (a round trip): the requests of a burst are
    all chosen before that, and must still see each other."""
    r = router()
    a, b = Replica("a", stats(largest=4000)), Replica("b", stats(largest=4000))
    firsts = [choose(r, [a, b], request(i, need=500))[0][0] for i in range(4)]
    assert sorted(firsts) == ["a", "a", "b", "b"]


def test_a_request_counts_only_where_it_was_routed():
    r = router()
    a, b = Replica("a", stats(largest=1000)), Replica("b", stats(largest=1000))
    pr = request(0, need=600)
    assert choose(r, [a, b], pr)[0] == ["a"]
    r.on_request_routed(pr, "b", None)  # a refused it (its queue was full): Ray took the next rank
    assert choose(r, [a, b], request(1, need=600)) == [["a"]]  # b holds it, not a


def http_request(i: int) -> PendingRequest:
    """What Ray's HTTP proxy hands the router when the engines are the ingress: the ASGI scope, no RemoteJob."""
    return PendingRequest(args=[object()], kwargs={}, created_at=time.time() + i * 1e-3,
                          metadata=RequestMetadata(request_id=f"h{i}", internal_request_id=f"h{i}"))


def test_a_request_it_cannot_read_is_sized_by_the_replicas_typical_need():
    r = router()
    busy = dict(stats(largest=1000, reserved=3000), running=6, typical_need_tokens=500)
    a, b = Replica("a", busy), Replica("b", stats(largest=400))
    # 500 (a's typical first reservation) fits only a's range, although b holds less: sized, not just counted
    assert choose(r, [a, b], http_request(0)) == [["a"]]
    assert scoring.ROUTING.decisions > 0


def test_a_burst_of_unread_requests_spreads_over_idle_replicas():
    r = router()
    a, b = Replica("a", stats(largest=2000)), Replica("b", stats(largest=2000))  # idle: typical need 0
    firsts = [choose(r, [a, b], http_request(i))[0][0] for i in range(4)]
    assert sorted(firsts) == ["a", "a", "b", "b"]  # equal scores: fewer requests there first


def test_a_burst_of_unread_requests_spreads_and_counts_where_it_went():
    r = router()
    typical = dict(stats(largest=2000), typical_need_tokens=600)
    a, b = Replica("a", typical), Replica("b", dict(typical))
    burst = [http_request(i) for i in range(4)]
    firsts = [choose(r, [a, b], pr)[0][0] for pr in burst]
    assert sorted(firsts) == ["a", "a", "b", "b"]  # each one's assumed 600 counted before any report
    r.on_request_routed(burst[0], "b" if firsts[0] == "a" else "a", None)  # Ray took the other rank
    assert sorted(len(sent) for sent in r._sent.values()) == [1, 3]  # the assumed need moved with it


def test_a_request_without_room_goes_where_nothing_waits_before_it():
    r = router()
    a, b = Replica("a", stats(largest=900, waiting=1)), Replica("b", stats(largest=100))
    assert choose(r, [a, b], request(0, need=1000)) == [["b"]]  # b admits it the moment it has room


def test_a_request_without_room_is_held_with_backoff_then_released_by_the_guard():
    before = (scoring.ROUTING.holds, scoring.ROUTING.released)
    r = router(max_skips=2, max_hold_s=60)
    a, b = Replica("a", stats(largest=100, waiting=1)), Replica("b", stats(largest=200, waiting=2))
    big = request(0, need=1000)
    assert choose(r, [a, b], big) == [] and big.routing_context.should_backoff  # both have requests waiting
    for i in (1, 2):  # two later requests overtake it
        small = request(i, need=50)
        best = choose(r, [a, b], small)[0][0]  # a small one fits
        r.on_request_routed(small, best, None)
    assert choose(r, [a, b], big) == [["b"], ["a"]]  # overtaken max_skips times: the best replica anyway
    assert (scoring.ROUTING.holds, scoring.ROUTING.released) == (before[0] + 1, before[1] + 1)


def test_a_held_request_is_released_after_max_hold_s():
    r = router(max_skips=100, max_hold_s=0.2)
    a = Replica("a", stats(largest=100, waiting=1))
    big = request(0, need=1000)
    assert choose(r, [a], big) == []
    time.sleep(0.25)
    assert choose(r, [a], big) == [["a"]]


def test_a_dead_replica_takes_its_sends_with_it():
    r = router()
    a, b = Replica("a", stats(largest=1000)), Replica("b", stats(largest=1000))
    r.on_request_routed(request(0, need=900), "a", None)
    r.on_replica_actor_died("a")
    assert choose(r, [a, b], request(1, need=600))[0] == ["a"]  # its replacement starts from its own report


def test_max_hold_s_zero_never_holds_a_request():
    before = scoring.ROUTING.holds
    r = router(max_skips=100, max_hold_s=0.0)
    a, b = Replica("a", stats(largest=100, waiting=1)), Replica("b", stats(largest=200, waiting=2))
    big = request(0, need=1000)
    assert choose(r, [a, b], big) == [["b"], ["a"]]  # no room anywhere: straight to where room is closest
    assert not big.routing_context.should_backoff and scoring.ROUTING.holds == before


def test_the_age_of_the_reports_it_reads_is_counted():
    before = (scoring.ROUTING.decisions, scoring.ROUTING.stats_age_s)
    r = router()
    now = time.time()
    a, b = Replica("a", stats(largest=1000, at=now - 2.0)), Replica("b", stats(largest=1000, at=now - 1.0))
    choose(r, [a, b], request(0, need=10))
    assert scoring.ROUTING.decisions == before[0] + 2
    assert 3.0 <= scoring.ROUTING.stats_age_s - before[1] < 4.0
