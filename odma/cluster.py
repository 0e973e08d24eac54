"""Several devices, one pool each, one set of bucket bounds: placement by compute load and memory pressure.

All pools share one `BucketManager` through one policy object, so the logical bucket boundaries are the
same on every device at every moment (a refresh swaps them for all at once), and realized lengths from
every device feed the same window. A request is placed on the device with the lowest score
    w_memory · (reserved + this request's block) / capacity  +  w_compute · live tokens / max live tokens
among those whose pool can reserve it now; it then stays there (extend / release route to its pool).
On CPU, several pools in one process are a faithful test bed: placement is pure bookkeeping.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Sequence

from odma.allocator import Block, KVPool
from odma.buckets import BucketManager
from odma.errors import ConfigError, DuplicateRequestError, UnknownRequestError
from odma.policy import BucketPolicy, ReservationPolicy, SizedRequest


@dataclass(frozen=True, slots=True)
class Placement:
    device: str
    block: Block


@dataclass(frozen=True, slots=True)
class DeviceLoad:
    device: str
    capacity_tokens: int
    reserved_tokens: int
    live_tokens: int  # tokens attention reads per decode step: the compute load
    live_blocks: int


def pool_load(device: str, pool: KVPool, queued_reserve: int = 0, queued_tokens: int = 0) -> DeviceLoad:
    """A pool's load, plus what its queue will reserve and attend (a request placed there waits behind it)."""
    return DeviceLoad(device, pool.capacity_tokens, pool.reserved_tokens + queued_reserve,
                      pool.live_tokens + queued_tokens, pool.live_blocks)


def rank_devices(loads: Sequence[DeviceLoad], need: int, w_memory: float = 1.0, w_compute: float = 1.0) -> list[str]:
    """Devices best first for a request that will reserve `need` tokens (the score in the module docstring)."""
    busiest = max(1, max(l.live_tokens for l in loads))

    def score(l: DeviceLoad) -> tuple[float, str]:
        memory = (l.reserved_tokens + need) / max(1, l.capacity_tokens)
        return w_memory * memory + w_compute * l.live_tokens / busiest, l.device

    return [l.device for l in sorted(loads, key=score)]


class ClusterManager:
    def __init__(self, devices: Sequence[str], buckets: BucketManager,
                 make_pool: Callable[[str, ReservationPolicy], KVPool], *, growth: str = "next",
                 w_memory: float = 1.0, w_compute: float = 1.0) -> None:
        if not devices or len(set(devices)) != len(devices):
            raise ConfigError(f"devices must be distinct and non-empty, got {list(devices)}")
        if w_memory < 0 or w_compute < 0 or w_memory + w_compute == 0:
            raise ConfigError("placement weights must be >= 0 and not both 0")
        self.buckets = buckets
        self.policy = BucketPolicy(buckets, growth=growth)  # one policy: one set of bounds everywhere
        self.pools = {d: make_pool(d, self.policy) for d in devices}
        if any(p.policy is not self.policy for p in self.pools.values()):
            raise ConfigError("make_pool must build each pool with the policy it is given")
        self.w_memory, self.w_compute = w_memory, w_compute
        self._where: dict[str, str] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_device_list(cls, spec: str, buckets: BucketManager, tokens_per_device: int, *,
                         w_memory: float = 1.0, w_compute: float = 1.0, **pool_kw) -> "ClusterManager":
        """`--devices mlu:0,mlu:1` → one pool of `tokens_per_device` tokens per device (bookkeeping only)."""
        devices = [d.strip() for d in spec.split(",") if d.strip()]
        return cls(devices, buckets, lambda _d, policy: KVPool(tokens_per_device, policy, **pool_kw),
                   w_memory=w_memory, w_compute=w_compute)

    def loads(self) -> list[DeviceLoad]:
        return [pool_load(d, p) for d, p in self.pools.items()]

    def _ranked(self, req: SizedRequest) -> list[str]:
        need = self.policy.initial_tokens(req)
        return rank_devices(self.loads(), need, self.w_memory, self.w_compute)

    def place(self, req: SizedRequest) -> Placement | None:
        """Reserve on the best device that has room now; None when no device has."""
        with self._lock:
            if req.request_id in self._where:
                raise DuplicateRequestError(f"request {req.request_id} is already placed on {self._where[req.request_id]}")
            for device in self._ranked(req):
                block = self.pools[device].reserve(req)
                if block is not None:
                    self._where[req.request_id] = device
                    return Placement(device, block)
            return None

    def place_batch(self, reqs: Sequence[SizedRequest]) -> dict[str, Placement | None]:
        """Place a batch, largest prompts first (the hardest to fit go where room is still widest)."""
        order = sorted(reqs, key=lambda r: -r.prompt_tokens)
        return {r.request_id: self.place(r) for r in order}

    def device_of(self, request_id: str) -> str:
        device = self._where.get(request_id)
        if device is None:
            raise UnknownRequestError(f"request {request_id!r} is not placed on any device")
        return device

    def extend(self, request_id: str, new_len: int) -> Block | None:
        return self.pools[self.device_of(request_id)].extend(request_id, new_len)

    def release(self, request_id: str, realized_len: int) -> Block:
        device = self.device_of(request_id)
        block = self.pools[device].release(request_id, realized_len)
        with self._lock:
            del self._where[request_id]
        return block

    def bucket_bounds(self) -> dict[str, tuple[int, ...]]:
        """Per device, the bounds its pool reserves with (identical by construction)."""
        return {d: p.policy.buckets.bounds for d, p in self.pools.items()}  # type: ignore[attr-defined]
