"""Engines as the ingress (`RaySettings.ingress = "engines"`): Ray Serve's HTTP proxy routes each request straight
to an engine replica, which serves odma-serve's own app over its own engine (create_app over its AsyncEngine, as
odma-serve does). One actor hop fewer than with the ingress replica (`front.Front`) on the request and on every
streamed token, and no single process that every token of the cluster passes through. What it gives up: the
router runs in the proxy, which does not read the request's body, so it places by what the replicas' requests
typically reserve (`router.unseen_job`) instead of this request's predicted need, and each engine predicts for
itself; admission (429) is per replica, at its share of the cluster's queue. /metrics answers for the cluster:
this replica's metrics merged with the others' last reports to the cluster state."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from odma.engine import EngineConfig
from odma.serve_ray.merge_metrics import merge_texts
from odma.serve_ray.replica import EngineReplica
from odma.serve_ray.settings import RaySettings


class _ClusterText:
    def __init__(self, replica: "EngineIngress") -> None:
        self.replica = replica

    def collect(self):
        r = self.replica
        yield from merge_texts({r.name: generate_latest(r.metrics.registry).decode(), **r.others_metrics})
        replicas = GaugeMetricFamily("odma_ray_replicas", "Engine replicas reporting to the cluster state")
        replicas.add_metric([], 1 + len(r.others_metrics))
        yield replicas


class ClusterMetrics:
    """What odma-serve's app reads of its metrics (`refused`, `registry`), for the whole cluster."""

    def __init__(self, replica: "EngineIngress") -> None:
        self.replica = replica
        self.registry = CollectorRegistry()
        self.registry.register(_ClusterText(replica))

    def refused(self, reason: str) -> None:
        self.replica.metrics.refused(reason)


class EngineIngress(EngineReplica):
    """A Ray Serve ingress deployment class (`odma.serve_ray.app` wraps it with `serve.ingress`)."""

    wants_others_metrics = True  # its /metrics answers for the whole cluster

    async def __init__(self, config: EngineConfig, settings: RaySettings, cluster, served_name: str,
                       aliases: tuple[str, ...] = (), generation_config: str = "auto",
                       override_generation_config: str | None = None, max_n: int = 16) -> None:
        from odma.server.generation_config import engine_sampling_defaults

        self.others_metrics: dict[str, str] = {}
        await super().__init__(config, settings, cluster)
        self.defaults = engine_sampling_defaults(self.engine, generation_config, override_generation_config)
        self.served_name, self.aliases, self.max_n = served_name, aliases, max_n

    def admission_queue(self, settings: RaySettings) -> int:
        """Its share of the cluster's queue (`max_queue` waiting in all), at least 1."""
        return max(1, -(-settings.max_queue // settings.replicas))

    def _install(self, state: dict) -> None:
        super()._install(state)
        if "metrics" in state:
            self.others_metrics = state["metrics"]

    def __serve_build_asgi_app__(self):
        from odma.server.app import create_app

        return create_app(self.runtime, ClusterMetrics(self), self.served_name, aliases=self.aliases,
                          defaults=self.defaults, max_n=self.max_n)
