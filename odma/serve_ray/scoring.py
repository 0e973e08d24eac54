"""How the router weighs replicas (no Ray here): odma's placement score across processes.

A request arrives with its predicted KV need (prompt + the reservation odma's policy gives its L̂, times n). Each
replica last reported its pool (`ReplicaLoad`, through Ray Serve's routing stats); the router adds what it has
sent there since that report (`Sent`). A replica *fits* the request when its largest free contiguous range, less
what its queue and those recent sends will take first, holds the need and its batch has a free slot: free bytes
alone do not say that one block fits. Among fitting replicas the best has the lowest placement score
(`odma.kv.placement`: w_memory · (committed + need) / capacity + w_compute · tokens attended / the busiest's).
When no replica fits, a replica with nothing waiting takes it (it admits it the moment it has room, sooner than
the router would learn of that room) — the one closest to having room. When every replica already has requests
waiting, the router holds it (late binding: it goes to whichever replica frees room first) under the scheduler's
starvation guard: a held request that later requests have overtaken `max_skips` times, or that has waited
`max_hold_s`, goes anyway to the replica closest to having room and waits in its queue.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, fields
from typing import Hashable, Iterable

# a request sent this long before a replica's report may not have reached it yet: from the proxy to the engine's
# queue takes more than 50 ms on a busy host (a burst of four then went 4/0 over two replicas); counting a request
# in the report and as pending for half a second only makes the replica look a little busier
TRANSIT_S = 0.5


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica's memory, compute and queue, in tokens, as of `at` (time.time() on the replica)."""

    capacity_tokens: int  # what its pools can hand out now
    reserved_tokens: int  # Σ capacity of live blocks
    live_tokens: int  # tokens attention reads per decode step: the compute load
    largest_free_tokens: int  # the largest block a reservation could get now (PoolStats.largest_reservable_tokens)
    queued_tokens: int  # what its waiting requests will reserve (their initial reservations)
    queued_prompts: int  # their prompt tokens (prefill work ahead)
    running: int
    waiting: int
    max_num_seqs: int  # its decode batch cap (all devices)
    max_request_tokens: int  # the largest request its pools can ever hold
    at: float
    bounds_version: int = 0  # the shared bucket bounds it reserves from
    # the mean first reservation of its running and waiting requests (0 when idle): what the router assumes of a
    # request it cannot see (odma.serve_ray.router, engines as ingress: Ray's proxy does not read the body)
    typical_need_tokens: int = 0

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "ReplicaLoad | None":
        """None for a replica that has not reported yet (or an unreadable report)."""
        if not d:
            return None
        try:
            return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})
        except TypeError:
            return None


def load_of(schedulers: Iterable, *, waiting: int, max_num_seqs: int, max_request_tokens: int, at: float,
            bounds_version: int = 0) -> ReplicaLoad:
    """A replica's load from its schedulers (one per device) and their KV managers; `waiting` counts every request
    not running yet (the engine's inbox too), `max_num_seqs` the batch cap of all devices together."""
    cap = reserved = live = queued = prompts = largest = running = 0
    firsts: list[int] = []
    for s in schedulers:
        stats = s.kv.stats()
        queue, batch = list(s.waiting), list(s.running)  # copies: the engine's thread may change them
        cap += stats.total_tokens
        reserved += stats.reserved_tokens
        live += stats.live_tokens
        largest = max(largest, stats.largest_reservable_tokens)
        waiting_firsts = [s.kv.initial_tokens(q) for q in queue]
        queued += sum(waiting_firsts)
        prompts += sum(q.prompt_tokens for q in queue)
        running += len(batch)
        firsts += waiting_firsts + [s.kv.initial_tokens(q) for q in batch]
    typical = round(sum(firsts) / len(firsts)) if firsts else 0
    return ReplicaLoad(cap, reserved, live, largest, queued, prompts, running, waiting, max_num_seqs,
                       max_request_tokens, at, bounds_version, typical)


@dataclass(frozen=True, slots=True)
class Sent:
    """A request the router sent to a replica and has not seen complete."""

    need: int
    prompt_tokens: int
    at: float


@dataclass(frozen=True, slots=True)
class Candidate:
    key: Hashable
    load: ReplicaLoad | None
    pending: tuple[Sent, ...] = ()  # sent there after its report (not in it yet)

    @property
    def pending_tokens(self) -> int:
        return sum(s.need for s in self.pending)

    @property
    def pending_prompts(self) -> int:
        return sum(s.prompt_tokens for s in self.pending)


def unreported(loads: Iterable[ReplicaLoad | None]) -> ReplicaLoad:
    """What the router assumes of a replica that has not reported yet: as large as the largest that has, and
    idle (a replica that just started holds nothing)."""
    known = [l for l in loads if l is not None]
    cap = max((l.capacity_tokens for l in known), default=1 << 30)
    req = max((l.max_request_tokens for l in known), default=cap)
    seqs = max((l.max_num_seqs for l in known), default=1 << 16)
    return ReplicaLoad(cap, 0, 0, cap, 0, 0, 0, 0, seqs, req, 0.0)


def typical_need(loads: Iterable[ReplicaLoad | None]) -> int:
    """The need assumed of a request the router cannot read (engines as the ingress: Ray's proxy does not parse the
    body): the largest typical first reservation the replicas report (0 when all are idle)."""
    return max((l.typical_need_tokens for l in loads if l is not None), default=0)


def room(c: Candidate, load: ReplicaLoad) -> int:
    """The largest block a request sent now could get there, once its queue and our recent sends took theirs
    (pessimistic: as if they all came out of the largest free range)."""
    return load.largest_free_tokens - load.queued_tokens - c.pending_tokens


def fits(c: Candidate, load: ReplicaLoad, need: int) -> bool:
    slots = load.max_num_seqs - load.running - load.waiting - len(c.pending)
    return need <= load.max_request_tokens and need <= room(c, load) and slots > 0


def queue_empty(c: Candidate, load: ReplicaLoad) -> bool:
    """Nothing waits there (as far as the router knows: its report, and nothing sent since)."""
    return load.waiting == 0 and not c.pending


def score(load: ReplicaLoad, c: Candidate, need: int, busiest: int, w_memory: float, w_compute: float) -> float:
    committed = load.reserved_tokens + load.queued_tokens + c.pending_tokens
    compute = load.live_tokens + load.queued_prompts + c.pending_prompts
    return w_memory * (committed + need) / max(1, load.capacity_tokens) + w_compute * compute / busiest


def rank_replicas(candidates: list[Candidate], need: int, *, w_memory: float = 1.0,
                  w_compute: float = 1.0) -> tuple[list[Hashable], list[Hashable]]:
    """(replicas where the request fits now, lowest score first; the others, closest to room for it first)."""
    fitting, short = _rank(candidates, need, w_memory, w_compute)
    return [c.key for c, _ in fitting], [c.key for c, _ in short]


def route(candidates: list[Candidate], need: int, *, w_memory: float = 1.0, w_compute: float = 1.0) -> list[Hashable]:
    """Where to send the request, best first; [] = hold it (see the module docstring)."""
    fitting, short = _rank(candidates, need, w_memory, w_compute)
    if fitting:
        return [c.key for c, _ in fitting]
    return [c.key for c, l in short if queue_empty(c, l)]


def _rank(candidates: list[Candidate], need: int, w_memory: float, w_compute: float):
    if not candidates:
        return [], []
    default = unreported(c.load for c in candidates)
    loads = [c.load or default for c in candidates]
    busiest = max(1, max(l.live_tokens + l.queued_prompts + c.pending_prompts for c, l in zip(candidates, loads)))
    # equal scores (idle replicas, requests of unknown need): the one holding fewer requests first
    ranked = sorted(zip(candidates, loads), key=lambda cl: (score(cl[1], cl[0], need, busiest, w_memory, w_compute),
                                                          cl[1].running + cl[1].waiting + len(cl[0].pending)))
    fitting = [(c, l) for c, l in ranked if fits(c, l, need)]
    taken = {c.key for c, _ in fitting}
    # where it does not fit yet: the replica closest to having the range first (then the score; sorted is stable)
    short = sorted(((c, l) for c, l in ranked if c.key not in taken), key=lambda cl: need - room(cl[0], cl[1]))
    return fitting, short


def pending_after(sent: Iterable[Sent], load: ReplicaLoad | None) -> tuple[Sent, ...]:
    """The sends a replica's report cannot include yet: all of them before its first report."""
    if load is None:
        return tuple(sent)
    return tuple(s for s in sent if s.at > load.at - TRANSIT_S)


@dataclass(slots=True)
class _Held:
    created_at: float
    since: float
    bypassed: int = 0


class HoldBook:
    """Requests the router holds because no replica has room, and the starvation guard over them: a held request
    that `max_skips` later requests have overtaken, or that has been held `max_hold_s`, is held no more."""

    def __init__(self, max_skips: int, max_hold_s: float) -> None:
        self.max_skips, self.max_hold_s = max_skips, max_hold_s
        self._held: dict[str, _Held] = {}
        self.holds = 0  # requests held at least once
        self.released = 0  # requests the guard sent on without room

    def hold(self, key: str, created_at: float, now: float | None = None) -> bool:
        """Hold it (again); True the first time."""
        if key in self._held:
            return False
        self._held[key] = _Held(created_at, time.time() if now is None else now)
        self.holds += 1
        return True

    def overdue(self, key: str, now: float | None = None) -> bool:
        h = self._held.get(key)
        if h is None:
            return False
        now = time.time() if now is None else now
        return h.bypassed >= self.max_skips or now - h.since >= self.max_hold_s

    def release(self, key: str) -> None:
        """The guard sends it on (counted)."""
        if self._held.pop(key, None) is not None:
            self.released += 1

    def routed(self, key: str, created_at: float, now: float | None = None) -> None:
        """A request went to a replica: it overtook every held request older than it."""
        self._held.pop(key, None)
        now = time.time() if now is None else now
        for k, h in list(self._held.items()):
            if h.created_at < created_at:
                h.bypassed += 1
            if now - h.since > 4 * self.max_hold_s:  # its client left while it was held: forget it
                del self._held[k]

    def forget(self, key: str) -> None:
        self._held.pop(key, None)

    def __len__(self) -> int:
        return len(self._held)


@dataclass(slots=True)
class RoutingCounters:
    """What the memory-aware routers of this process did (the ingress's /metrics reads them: the router runs
    inside the ingress's process, in its deployment handle)."""

    routed: int = 0
    holds: int = 0
    released: int = 0
    decisions: int = 0  # choose_replicas calls with a request, and the age of the reports they read
    stats_age_s: float = 0.0


ROUTING = RoutingCounters()
