"""The cluster seen as one engine (no Ray here): the replicas' Prometheus texts merged under odma-serve's names
(`merge_texts`, the ingress's /metrics), and their engine snapshots merged into one (`merge_stats`, the ingress
runtime's `stats()`), by the same rules.

Counters, histograms and gauges that add up (bytes, requests, tokens) are summed over replicas; gauges that
describe one replica's state are not: the bucket bounds (the same on all: shared) and the worst fragmentation
are the maximum; the info gauges say what serves; the per-device gauges keep one series per replica (in a merged
snapshot, one device per replica's device, named `replica/device`).
"""

from __future__ import annotations

from dataclasses import replace

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from odma.engine.stats import EngineStats, ProbeStats

SUMMED = ("waiting", "steps", "busy_seconds", "decode_tokens", "prefill_tokens", "prompt_copies", "prompt_recomputes",
          "rejected_predictions", "tag_batches", "tag_timeouts", "tags_waiting")

MAXIMUM = {"odma_kv_external_fragmentation", "odma_bucket_bound_tokens", "odma_bucket_bounds_version",
           "odma_predictor_info", "odma_policy_info", "odma_probe_info"}
PER_REPLICA_PREFIX = "odma_device_"


def merge_texts(texts: dict[str, str]) -> list[Metric]:
    """Families by name, in the order first seen; `texts` maps a replica's name to its exposition text."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple, float]] = {}
    for replica, text in texts.items():
        for fam in text_string_to_metric_families(text):
            if fam.name.endswith("_created"):
                continue  # creation timestamps do not add up
            if fam.name not in families:
                families[fam.name] = Metric(fam.name, fam.documentation, fam.type)
                values[fam.name] = {}
            merged = values[fam.name]
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue
                labels = dict(s.labels)
                if fam.name.startswith(PER_REPLICA_PREFIX):
                    labels["replica"] = replica
                key = (s.name, tuple(sorted(labels.items())))
                if key in merged and fam.name in MAXIMUM:
                    merged[key] = max(merged[key], s.value)
                else:
                    merged[key] = merged.get(key, 0.0) + s.value
    for name, fam in families.items():
        for (sample, labels), value in values[name].items():
            fam.add_sample(sample, dict(labels), value)
    return list(families.values())


def merge_stats(snapshots: dict[str, EngineStats], *, policy: str) -> EngineStats:
    """One snapshot for the cluster from each replica's (`snapshots` maps a replica's name to its last one); with
    none reported yet, an empty one for `policy`."""
    if not snapshots:
        return EngineStats(policy=policy)
    named = list(snapshots.items())
    first = named[0][1]
    fallbacks = [s.predictor for _, s in named if s.predictor.fallback_reason]
    bucketed = [s.buckets for _, s in named if s.buckets is not None]
    return EngineStats(
        policy=first.policy, predictor=fallbacks[0] if fallbacks else first.predictor,
        devices=tuple(replace(d, device=f"{name}/{d.device}") for name, s in named for d in s.devices),
        buckets=max(bucketed, key=lambda b: b.version) if bucketed else None,
        probe=_merge_probes([s.probe for _, s in named if s.probe is not None]),
        probe_fallback=next((s.probe_fallback for _, s in named if s.probe_fallback), None),
        **{f: sum(getattr(s, f) for _, s in named) for f in SUMMED})


def _merge_probes(probes: list[ProbeStats]) -> ProbeStats | None:
    if not probes:
        return None
    online = [p for p in probes if p.online_samples is not None]
    return replace(probes[0], predicted=sum(p.predicted for p in probes), refined=sum(p.refined for p in probes),
                   failures=sum(p.failures for p in probes), seconds=sum(p.seconds for p in probes),
                   online_samples=sum(p.online_samples for p in online) if online else None,
                   online_refits=sum(p.online_refits or 0 for p in online) if online else None)
