"""The memory room: contiguous KV blocks sized from predicted lengths, and everything that moves them.

Data flow inside: a request's predicted length → `BucketManager` (bucket bounds from realized lengths) →
`ReservationPolicy` (tokens to reserve, what to grow into) → `KVPool` (one contiguous block per request, carved
from free extents; grows in place or migrates) → release → the bucket window learns the realized length.
Around the pool: ballooning between KV and activation memory (`BalloonPool`, `ElasticKV`), the host buffer of
swapped-out KV (`OffloadController`), placement over several devices (`rank_devices`).

The door: schedulers (the engine's, the replay's) talk to memory only through `KVManager` — admit, grow,
release, evict, make_way — and get `KVHandle` / `Growth` values back. `ContiguousKV` is odma's memory,
`PagedKV` vLLM's page-count model. Everything a module outside this package may use is exported here.
"""

from odma.config import BucketConfig, PoolConfig, ReservationTable
from odma.kv.balloon import ActivationProfile, BalloonPool, Segment
from odma.kv.blocks import LARGE_REGION, MAIN, Block, BlockMover, Growth, KVHandle
from odma.kv.buckets import (
    LARGE,
    BucketChoice,
    BucketManager,
    align_up,
    equal_width_bounds,
    optimal_bounds,
    quantile_bounds,
)
from odma.kv.elastic import ElasticKV
from odma.kv.manager import ContiguousKV, KVManager
from odma.kv.offload import OffloadConfig, OffloadController
from odma.kv.mapped import MappedKV, PlaneGeometry
from odma.kv.paged import PagedKV
from odma.kv.placement import DeviceLoad, rank_devices
from odma.kv.policy import (
    POLICY_KINDS,
    BucketPolicy,
    ExactPolicy,
    KVRequest,
    Reservation,
    ReservationPolicy,
    SizedRequest,
    StaticPolicy,
    build_policy,
)
from odma.kv.pool import KVPool, PoolCounters, PoolStats

__all__ = [
    "LARGE", "LARGE_REGION", "MAIN", "POLICY_KINDS", "ActivationProfile", "BalloonPool", "Block", "BlockMover",
    "BucketChoice", "BucketConfig", "BucketManager", "BucketPolicy", "ContiguousKV", "DeviceLoad", "ElasticKV",
    "ExactPolicy", "Growth", "KVHandle", "KVManager", "KVPool", "KVRequest", "MappedKV", "OffloadConfig", "OffloadController",
    "PagedKV", "PlaneGeometry", "PoolConfig", "PoolCounters", "PoolStats", "Reservation", "ReservationPolicy", "ReservationTable", "Segment",
    "SizedRequest", "StaticPolicy", "align_up", "build_policy", "equal_width_bounds", "optimal_bounds", "quantile_bounds",
    "rank_devices",
]
