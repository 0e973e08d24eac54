"""One /metrics for the cluster: the replicas' Prometheus texts merged under odma-serve's names (no Ray here).

Counters, histograms and gauges that add up (bytes, requests, tokens) are summed over replicas; gauges that
describe one replica's state are not: the bucket bounds (the same on all: shared) and the worst fragmentation
are the maximum; the info gauges say what serves; the per-device gauges keep one series per replica.
"""

from __future__ import annotations

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

MAXIMUM = {"odma_kv_external_fragmentation", "odma_bucket_bound_tokens", "odma_bucket_bounds_version",
           "odma_predictor_info", "odma_policy_info"}
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
