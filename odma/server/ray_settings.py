"""How odma runs on Ray Serve (odma-serve's `--ray` flags): replicas, the request router, where the length
predictor runs, and how often the replicas tell the router and each other what they hold. The engine of every
replica is an `EngineConfig`. Here, in the server's package, because its CLI parses them; `odma.serve_ray` reads
them (`odma.serve_ray.settings` re-exports them)."""

from __future__ import annotations

from dataclasses import dataclass

from odma.errors import ConfigError

ROUTERS = ("odma", "pow2")  # odma: memory-aware (odma.serve_ray.router); pow2: Ray Serve's default
PREDICT_AT = ("front", "replica")
# front: an ingress replica (tokenizer, predictor, odma's router in its handle) in front of the engine replicas;
# engines: Ray's HTTP proxy routes straight to the engine replicas, each serving odma-serve's whole app
INGRESS = ("front", "engines")
DEFAULT_MAX_SKIPS = 8  # the scheduler's starvation guard: a request bypassed this often is bypassed no more


@dataclass(frozen=True, slots=True)
class RaySettings:
    replicas: int = 2  # engine replicas, one odma engine each
    router: str = "odma"
    # "front": the ingress predicts (L̂, u) once and the router places the request by its predicted KV need; the
    # replica keeps that prediction. "replica": the engine predicts as in odma-serve, and the router estimates
    # the need from the shared window's median length.
    predict_at: str = "front"
    # "engines": one actor hop fewer on every request and token (the ingress's), no single process that every token
    # passes through; but the router, in Ray's HTTP proxy, sees no request body: it places by the replicas' typical
    # need instead of this request's predicted need, and each engine predicts for itself (predict_at is moot)
    ingress: str = "front"
    replica_cpus: float = 1.0  # Ray CPUs each replica reserves (its torch threads are EngineConfig.threads)
    stats_period_s: float = 0.2  # Ray Serve polls each replica's load for the router this often
    report_period_s: float = 0.5  # each replica reports realized lengths, load and metrics to the cluster state
    max_skips: int = DEFAULT_MAX_SKIPS  # a request held at the router for room is passed over at most this often
    # ... and held at most this long, then it waits at a replica. 0 (the default): never hold; a request without
    # room waits in the queue of the replica closest to room, under that engine's own guard. Holding measured
    # worse on NQ (TTFT p50 x4.6-10, docs/BENCHMARKS.md): the router learns of freed room later than the replica.
    max_hold_s: float = 0.0
    w_memory: float = 1.0  # odma.kv.placement's weights
    w_compute: float = 1.0
    max_queue: int = 256  # requests (samples) waiting in the whole cluster before 429
    health_check_period_s: float = 2.0  # how soon Ray notices a replica that died and starts another
    app_name: str = "odma"
    address: str | None = None  # a running Ray cluster ("auto", "ray://host:10001"); None: start a local one

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ConfigError(f"router must be one of {ROUTERS}, got {self.router!r}")
        if self.predict_at not in PREDICT_AT:
            raise ConfigError(f"predict_at must be one of {PREDICT_AT}, got {self.predict_at!r}")
        if self.ingress not in INGRESS:
            raise ConfigError(f"ingress must be one of {INGRESS}, got {self.ingress!r}")
        if self.replicas < 1 or self.max_queue < 1 or self.max_skips < 0:
            raise ConfigError("replicas and max_queue must be >= 1, max_skips >= 0")
        if self.max_hold_s < 0:
            raise ConfigError(f"max_hold_s must be >= 0, got {self.max_hold_s}")
        for name in ("stats_period_s", "report_period_s", "health_check_period_s", "replica_cpus"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
