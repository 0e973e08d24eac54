"""The memory-aware request router (Ray Serve's custom request router API): each request goes to the replica where
its predicted KV need fits the largest free contiguous range and the placement score is lowest; when none has
room it is held here, under the scheduler's starvation guard (odma.serve_ray.scoring says how). Ray Serve runs
one per deployment handle, i.e. inside the ingress's process, or in its HTTP proxy when the engines are the ingress
(then the request's body is not read here: `unseen_job`). Ray Serve's default is power-of-two-choices."""

from __future__ import annotations

import logging
import time
from typing import List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from odma.serve_ray import scoring
from odma.server.wire import RemoteJob
from odma.serve_ray.scoring import Candidate, HoldBook, ReplicaLoad, Sent, pending_after, rank_replicas, route
from odma.serve_ray.settings import DEFAULT_MAX_SKIPS

# a send older than this only matters until its replica's next report; forgetting it bounds what a request
# cancelled between choice and routing leaves behind
FORGET_SENT_S = 600.0


def _job(pending_request: Optional[PendingRequest]) -> RemoteJob | None:
    if pending_request is None:
        return None
    for arg in pending_request.args:
        if isinstance(arg, RemoteJob):
            return arg
    return None


def unseen_job(candidates: list[Candidate]) -> RemoteJob:
    """What the router assumes of a request whose job it cannot read (engines as the ingress): the replicas'
    typical need, counted against the replica it goes to, so that a burst is spread by what such requests take."""
    return RemoteJob("unseen", [], None, 1, None, None, need=scoring.typical_need(c.load for c in candidates))


class MemoryAwareRouter(RequestRouter):
    """Not FIFOMixin: a replica chosen for one request's need is given to that request, not to the oldest.
    Ray Serve pickles this module by value into the process that routes: shared state is reached through
    imported modules (`scoring.ROUTING`), which stay references."""

    def initialize_state(self, max_skips: int = DEFAULT_MAX_SKIPS, max_hold_s: float = 0.0, w_memory: float = 1.0,
                         w_compute: float = 1.0) -> None:
        # in Ray Serve's log of the process that routes (the ingress replica, or the HTTP proxy when the engines
        # are the ingress): which router places this deployment's requests
        logging.getLogger("ray.serve").info("odma memory-aware router routes %s", self._deployment_id)
        self._holds = HoldBook(max_skips, max_hold_s)
        self._weights = {"w_memory": w_memory, "w_compute": w_compute}
        self._sent: dict[ReplicaID, dict[str, Sent]] = {}

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        job = _job(pending_request)
        by_id = {r.replica_id: r for r in candidate_replicas}
        candidates = []
        now = time.time()
        for r in candidate_replicas:
            load = ReplicaLoad.from_dict(r.routing_stats)
            candidates.append(Candidate(r.replica_id, load, pending_after(self._sent.get(r.replica_id, {}).values(), load)))
            if load is not None and pending_request is not None:
                scoring.ROUTING.stats_age_s += now - load.at
                scoring.ROUTING.decisions += 1
        if job is None and pending_request is not None:  # an HTTP request from Ray's proxy: the body is not read
            job = unseen_job(candidates)
        need = job.need if job is not None else 0
        chosen = route(candidates, need, **self._weights)
        if chosen:
            return self._ranks(chosen, by_id, pending_request, job)  # one replica per rank: Ray tries them in order
        _, others = rank_replicas(candidates, need, **self._weights)
        if pending_request is None or self._holds.max_hold_s <= 0:
            return self._ranks(others, by_id, pending_request, job)
        key = pending_request.metadata.internal_request_id
        if self._holds.overdue(key):
            self._holds.release(key)
            scoring.ROUTING.released += 1
            return self._ranks(others, by_id, pending_request, job)
        if self._holds.hold(key, pending_request.created_at):
            scoring.ROUTING.holds += 1
        pending_request.routing_context.should_backoff = True  # retry after Ray's backoff, not in a busy loop
        return []

    def _ranks(self, keys: list, by_id: dict, pending_request: Optional[PendingRequest],
               job: RemoteJob | None) -> List[List[RunningReplica]]:
        """The answer to Ray; the request counts as sent to the first choice from now on. Ray tells the router a
        request was routed only once the replica accepted it (a round trip later): requests routed meanwhile
        must see this one, or a burst all goes to the same replica."""
        if keys and job is not None and pending_request is not None:
            self._record(keys[0], pending_request.metadata.internal_request_id, job.need, job.prompt_tokens * job.n)
        return [[by_id[k]] for k in keys]

    def _record(self, replica_id: ReplicaID, key: str, need: int, prompt_tokens: int) -> None:
        """`key` is on its way to `replica_id` (and to no other replica)."""
        now = time.time()
        for sent in self._sent.values():
            sent.pop(key, None)
            for k in [k for k, s in sent.items() if now - s.at > FORGET_SENT_S]:  # cancelled before it was routed
                del sent[k]
        self._sent.setdefault(replica_id, {})[key] = Sent(need, prompt_tokens, now)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        job = _job(pending_request)
        key = pending_request.metadata.internal_request_id
        if job is not None:
            self._record(replica_id, key, job.need, job.prompt_tokens * job.n)  # where it went (maybe a later rank)
        else:  # unseen (engines as the ingress): move what choose_replicas assumed of it
            assumed = next((sent[key] for sent in self._sent.values() if key in sent), None)
            if assumed is not None:
                self._record(replica_id, key, assumed.need, assumed.prompt_tokens)
        self._holds.routed(key, pending_request.created_at)
        scoring.ROUTING.routed += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        sent = self._sent.get(replica_id)
        if sent is not None:
            sent.pop(internal_request_id, None)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._sent.pop(replica_id, None)
