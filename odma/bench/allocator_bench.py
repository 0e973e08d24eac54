"""Latency of reserve + release on the pool with many live blocks (steady-state churn)."""

from __future__ import annotations

import argparse
import gc
import random
import time

from odma.kv import BucketManager, BucketPolicy, KVPool, KVRequest


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="1000,100000", help="live block counts to measure at")
    p.add_argument("--ops", type=int, default=20000, help="reserve+release pairs measured per size")
    p.add_argument("--seed", type=int, default=0)


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class _Churn:
    """A pool filled with `live_blocks` requests, then churned: each op reserves a new request and
    releases a random live one, so free lists, splits and coalescing all happen as in serving."""

    def __init__(self, live_blocks: int, seed: int) -> None:
        self.rng = random.Random(seed)
        policy = BucketPolicy(BucketManager.fixed((32, 64, 128, 256, 512), 1024, alpha=0.5, tau=0.9))
        # room for all live blocks with ~15 % headroom, so churn rarely refuses
        self.pool = KVPool(int(live_blocks * 500 * 1.15) + 4096, policy, large_share=0.1, align=16)
        self.next_id = 0
        self.live: list[str] = []
        for _ in range(live_blocks):
            req = self._request()
            if self.pool.reserve(req) is not None:
                self.live.append(req.request_id)
        self.pair_us: list[float] = []
        self.refused = 0

    def _request(self) -> KVRequest:
        rng = self.rng
        self.next_id += 1
        return KVRequest(f"r{self.next_id}", rng.randint(8, 200), 1024, rng.lognormvariate(4.5, 0.8), rng.random())

    def run(self, ops: int) -> None:
        clock, pool, live = time.perf_counter_ns, self.pool, self.live
        for _ in range(ops):
            req = self._request()
            idx = self.rng.randrange(len(live))
            t0 = clock()
            block = pool.reserve(req)
            pool.release(live[idx], 10)
            t1 = clock()
            if block is None:
                self.refused += 1
                live[idx] = live[-1]
                live.pop()
            else:
                live[idx] = req.request_id
            self.pair_us.append((t1 - t0) / 1e3)

    def summary(self) -> dict:
        s = self.pool.stats()
        return {
            "live_blocks": s.live_blocks,
            "p50_us": _percentile(self.pair_us, 0.50),
            "p99_us": _percentile(self.pair_us, 0.99),
            "ops": len(self.pair_us),
            "refused": self.refused,
            "free_list_hits": s.free_list_hits,
            "external_fragmentation": round(s.external_fragmentation, 4),
        }


def _label(n: int) -> str:
    return f"{n // 1000}k" if n % 1000 == 0 else str(n)


def run(args: argparse.Namespace) -> dict:
    sizes = [int(s) for s in args.sizes.split(",")]
    churns = [_Churn(n, args.seed) for n in sizes]
    gc.collect()
    gc.freeze()  # long-lived setup objects: the collector need not rescan them (as a server would do)
    chunk = 500
    for _ in range(0, args.ops, chunk):  # interleaved, so machine noise hits every size alike
        for c in churns:
            c.run(chunk)
    gc.unfreeze()
    out: dict = {"ops_per_size": args.ops}
    for n, c in zip(sizes, churns):
        m = c.summary()
        tag = _label(n)
        out[f"reserve_release_p50_us_{tag}"] = round(m["p50_us"], 2)
        out[f"reserve_release_p99_us_{tag}"] = round(m["p99_us"], 2)
        out[f"detail_{tag}"] = m
    if len(sizes) >= 2:
        lo, hi = _label(sizes[0]), _label(sizes[-1])
        out["scaling_ratio"] = round(out[f"reserve_release_p99_us_{hi}"] / out[f"reserve_release_p99_us_{lo}"], 3)
    return out
