"""The cluster's shared state (no Ray here; Ray Serve runs one copy as a deployment): one window of realized
lengths fed by every replica, the bucket bounds computed from it, each replica's last load and metrics.

Every replica reports every `report_period_s` (the lengths it realized since its last report, its load, its
Prometheus text, its engine's snapshot) and gets the current bounds back; it reserves from those bounds only (its own bucket manager
follows, `BucketManager.follow`). A replica that starts, or restarts, asks for them before it serves. The ingress
reads a snapshot for /health, /metrics and admission. Refreshes follow the engine's rules (every
`refresh_every_n` lengths or `refresh_every_s`), so one cluster refreshes as one engine would.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from pathlib import Path

from odma.config import BucketConfig
from odma.kv import BucketManager

STALE_REPORTS = 10  # a replica silent for this many report periods is gone (its load and metrics are dropped)


def replica_log(path: Path | None, rank: int) -> Path | None:
    """Each replica appends realized lengths to its own log (`lengths.jsonl` → `lengths.replica0.jsonl`): several
    processes never share one file."""
    if path is None:
        return None
    return path.with_name(f"{path.stem}.replica{rank}{path.suffix}")


def log_files(path: Path | None) -> list[Path]:
    """The length log and the replicas' logs beside it (what a restarted cluster bootstraps its window from)."""
    if path is None:
        return []
    return sorted(p for p in [path, *path.parent.glob(f"{path.stem}.replica*{path.suffix}")] if p.is_file())


class ClusterState:
    """Thread-safe: Ray Serve may call it from several threads."""

    def __init__(self, buckets: BucketConfig | None, *, report_period_s: float = 0.5,
                 bootstrap: list[int] | None = None) -> None:
        # None: the policy has no dynamic bounds (static, s3); lengths still give the median
        self.buckets = BucketManager(buckets, bootstrap=bootstrap or None) if buckets is not None else None
        self.report_period_s = report_period_s
        self._lengths: deque[int] = deque(bootstrap or (), maxlen=(buckets or BucketConfig()).window)
        self._loads: dict[str, tuple[dict, float]] = {}
        self._texts: dict[str, str] = {}
        self._stats: dict[str, dict] = {}  # each replica's last engine snapshot (EngineStats.as_dict())
        self._lock = threading.Lock()
        self.reports = 0
        self.lengths_seen = 0

    # -- replicas ------------------------------------------------------------------------------------

    def join(self, name: str) -> dict:
        """A replica starts (or restarts): the bounds it must reserve from."""
        with self._lock:
            self._loads.pop(name, None)
            return self._bounds()

    def report(self, name: str, lengths: list[int], load: dict | None = None, metrics_text: str | None = None,
               others_metrics: bool = False, stats: dict | None = None) -> dict:
        """A replica's realized lengths since its last report, its load, metrics and engine snapshot; returns the
        current bounds, and the other live replicas' metrics texts when asked (a replica that is also the ingress
        serves /metrics for the whole cluster)."""
        with self._lock:
            self.reports += 1
            now = time.time()
            if load is not None:
                self._loads[name] = (load, now)
            if metrics_text is not None:
                self._texts[name] = metrics_text
            if stats is not None:
                self._stats[name] = stats
            good = [int(x) for x in lengths if type(x) is int and x >= 0]
            self.lengths_seen += len(good)
            self._lengths.extend(good)
            if self.buckets is not None:
                for x in good:
                    self.buckets.observe(x)
                if self.buckets.refresh_due():
                    self.buckets.refresh()
            out = self._bounds()
            if others_metrics:
                self._drop_stale()
                out["metrics"] = {n: self._texts[n] for n in self._loads if n != name and n in self._texts}
            return out

    def leave(self, name: str) -> None:
        with self._lock:
            self._loads.pop(name, None)
            self._texts.pop(name, None)
            self._stats.pop(name, None)

    # -- the ingress ---------------------------------------------------------------------------------

    def snapshot(self, with_metrics: bool = False) -> dict:
        """Bounds, the median realized length, each live replica's load and engine snapshot (and its metrics text
        when asked)."""
        with self._lock:
            self._drop_stale()
            out = self._bounds()
            out["replicas"] = {name: load for name, (load, _) in self._loads.items()}
            out["stats"] = {name: self._stats[name] for name in self._loads if name in self._stats}
            if with_metrics:
                out["metrics"] = {name: self._texts[name] for name in self._loads if name in self._texts}
            out["reports"], out["lengths_seen"] = self.reports, self.lengths_seen
            return out

    def _bounds(self) -> dict:
        b = self.buckets
        median = statistics.median(self._lengths) if self._lengths else None
        return {"bounds": list(b.bounds) if b is not None else None, "version": b.version if b is not None else 0,
                "median": median}

    def _drop_stale(self) -> None:
        limit = time.time() - STALE_REPORTS * self.report_period_s
        for name in [n for n, (_, at) in self._loads.items() if at < limit]:
            del self._loads[name]
            self._texts.pop(name, None)
            self._stats.pop(name, None)
