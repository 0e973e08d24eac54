"""The KV side of the engine: the reservation policy for `--policy`, and the pool over the runner's arena."""

from __future__ import annotations

from dataclasses import replace

from odma.buckets import BucketManager, equal_width_bounds
from odma.engine.config import EngineConfig
from odma.policy import BucketPolicy, ReservationPolicy, StaticPolicy


def build_policy(config: EngineConfig, bootstrap: list[int] | None = None) -> ReservationPolicy:
    """odma: dynamic quantile buckets refreshed from realized lengths; s3: static equal-width buckets;
    static: prompt + max_tokens for every request. All share the same pool and budget."""
    cap = config.max_tokens_cap
    if config.policy == "static":
        return StaticPolicy()
    if config.policy == "s3":
        buckets = BucketManager.fixed(equal_width_bounds(cap, config.s3_buckets), cap)
        return BucketPolicy(buckets, growth=config.pool.growth, name="s3")
    bcfg = replace(config.buckets, large_bound=cap)  # the large bucket holds the largest max_tokens
    return BucketPolicy(
        BucketManager(bcfg, bootstrap=bootstrap or None), growth=config.pool.growth, name="odma",
        reserve_scale=config.pool.reserve_scale,
    )
