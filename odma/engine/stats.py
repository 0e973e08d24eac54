"""What an engine reports of itself: one frozen snapshot (`EngineStats`, from `LLMEngine.stats()`), plain numbers
and small dicts, no torch. The server's /metrics, /health and the Ray ingress read this, never the engine's parts
(workers, pools, schedulers), so a runtime that holds no engine (the Ray ingress) can hand one out too."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from odma.kv import PoolCounters, PoolStats

PROBE_CALIBRATION_KEYS = ("alpha", "tau", "ceiling", "target")


@dataclass(frozen=True, slots=True)
class DeviceStats:
    """One device's KV pool and queues at the time of the snapshot."""

    device: str
    running: int  # requests holding a block
    waiting: int  # requests placed on the device and waiting (preempted ones too)
    budget_bytes: int  # the pool's size now (ballooned segments included)
    reserved_bytes: int  # held by live blocks
    live_bytes: int  # holding tokens
    free_bytes: int  # free extents and cached blocks
    external_fragmentation: float
    live_blocks_per_bucket: dict[int, int]  # bucket index -> live blocks (-1: the large bucket)
    pool_counters: dict[str, int]  # the pool's events since it was made (odma.kv.PoolCounters' fields)
    scheduler_counters: dict[str, int]  # the device scheduler's events (odma.engine.scheduler.SchedulerCounters)
    swap_held_bytes: int | None = None  # K/V in the host swap buffer (None: no swap)
    swap_buffer_bytes: int | None = None  # the swap buffer's logical size
    balloon: dict[str, int] | None = None  # the KV ↔ activation balloon's snapshot (None: no ballooning)


def device_stats(device: str, pool: PoolStats, scheduler: Any, swap: Any = None, elastic: Any = None) -> DeviceStats:
    """One device's snapshot from its pool's stats, its scheduler (queues and counters; copied here, as the engine's
    thread may change them), its host swap (`HostSwap`) and its balloon (`ElasticKV`), when it has them."""
    return DeviceStats(
        device=device, running=len(scheduler.running), waiting=len(scheduler.waiting),
        budget_bytes=pool.total_tokens * pool.bytes_per_token, reserved_bytes=pool.reserved_bytes,
        live_bytes=pool.live_bytes, free_bytes=pool.free_bytes, external_fragmentation=pool.external_fragmentation,
        live_blocks_per_bucket=dict(pool.live_blocks_per_bucket),
        pool_counters={f.name: getattr(pool, f.name) for f in fields(PoolCounters)},
        scheduler_counters=asdict(scheduler.counters),
        swap_held_bytes=swap.held_bytes if swap is not None else None,
        swap_buffer_bytes=swap.controller.logical_bytes if swap is not None else None,
        balloon=dict(elastic.snapshot()) if elastic is not None else None)


@dataclass(frozen=True, slots=True)
class BucketStats:
    bounds: tuple[int, ...]  # output tokens each bucket reserves
    large_bound: int
    version: int  # refreshes that changed the bounds


@dataclass(frozen=True, slots=True)
class PredictorStats:
    name: str
    fallback_reason: str | None = None  # why the predictor asked for could not be loaded (None: it was)


@dataclass(frozen=True, slots=True)
class ProbeStats:
    """The served model's length probe: which head serves, its work and the calibration in force."""

    source: str
    predicted: int
    refined: int
    failures: int
    seconds: float
    online_samples: int | None = None  # None: no online learner
    online_refits: int | None = None
    calibration: dict[str, Any] | None = None  # PROBE_CALIBRATION_KEYS of the online calibration, when one is set

    @classmethod
    def of(cls, stats: dict) -> "ProbeStats":
        """From `LengthProbe.stats()`."""
        online = stats.get("online") or {}
        cal = online.get("calibration") or {}
        return cls(stats["source"], stats["predicted"], stats["refined"], stats["failures"], stats["seconds"],
                   online["samples"] if online else None, online["refits"] if online else None,
                   {k: cal.get(k) for k in PROBE_CALIBRATION_KEYS} if cal else None)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """An engine's state and counters at one moment. Totals over devices are methods, so one device or several (or
    several replicas' merged, odma.serve_ray.merge_metrics.merge_stats) read the same way."""

    policy: str
    predictor: PredictorStats = PredictorStats("")
    devices: tuple[DeviceStats, ...] = ()
    buckets: BucketStats | None = None  # None: the policy has no buckets
    waiting: int = 0  # requests not running yet: the devices' queues, the inbox, samples held for their prompt
    steps: int = 0
    busy_seconds: float = 0.0  # inside model steps
    decode_tokens: int = 0
    prefill_tokens: int = 0  # recomputations included
    prompt_copies: int = 0  # samples of n > 1 requests that copied the prompt's K/V
    prompt_recomputes: int = 0  # ... that prefilled the prompt themselves
    rejected_predictions: int = 0  # predictions not finite or out of range (reserved the worst case)
    tag_batches: int = 0  # tagging ahead: predictor calls made off the loop (0 when tagging in the loop)
    tag_timeouts: int = 0  # tagging ahead: requests handed to the engine untagged, their tag too late
    tags_waiting: int = 0  # tagging ahead: requests whose tag has not come back yet
    probe: ProbeStats | None = None
    probe_fallback: str | None = None  # a probe asked for and refused: why

    def as_dict(self) -> dict:
        """Plain dicts, lists and numbers (for a process that should not import odma.engine: Ray's cluster state)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EngineStats":
        """The inverse of `as_dict`."""
        return cls(**{**d, "predictor": PredictorStats(**d["predictor"]),
                      "devices": tuple(DeviceStats(**x) for x in d["devices"]),
                      "buckets": BucketStats(**{**d["buckets"], "bounds": tuple(d["buckets"]["bounds"])})
                      if d["buckets"] is not None else None,
                      "probe": ProbeStats(**d["probe"]) if d["probe"] is not None else None})

    @property
    def running(self) -> int:
        return sum(d.running for d in self.devices)

    @property
    def swapping(self) -> bool:
        """Some device preempts through a host swap buffer."""
        return any(d.swap_held_bytes is not None for d in self.devices)

    @property
    def ballooning(self) -> bool:
        """Some device lends activation room to its KV pool."""
        return any(d.balloon is not None for d in self.devices)

    def total(self, name: str) -> int | float:
        """A DeviceStats number summed over devices (`reserved_bytes`, `swap_held_bytes`...; None counts 0)."""
        return sum(getattr(d, name) or 0 for d in self.devices)

    def pool_counter(self, name: str) -> int:
        return sum(d.pool_counters.get(name, 0) for d in self.devices)

    def scheduler_counter(self, name: str) -> int:
        return sum(d.scheduler_counters.get(name, 0) for d in self.devices)

    def balloon_total(self, name: str) -> int:
        return sum(d.balloon.get(name, 0) for d in self.devices if d.balloon is not None)

    @property
    def external_fragmentation(self) -> float:
        """The worst device's."""
        return max((d.external_fragmentation for d in self.devices), default=0.0)

    @property
    def live_blocks_per_bucket(self) -> dict[int, int]:
        """Summed over devices, in bucket order."""
        out: dict[int, int] = {}
        for d in self.devices:
            for bucket, n in d.live_blocks_per_bucket.items():
                out[bucket] = out.get(bucket, 0) + n
        return dict(sorted(out.items()))
