"""The Ray Serve application: an ingress (odma-serve's FastAPI app, `front.Front`), N engine replicas
(`replica.EngineReplica`) behind the memory-aware request router (or Ray Serve's default power-of-two-choices),
and the cluster state (`cluster.ClusterState`: the shared window of realized lengths and bucket bounds).

    odma-serve --ray --replicas 2 --kv-budget 64MiB           # starts a local Ray, or joins --ray-address
    serve run odma.serve_ray:build_app replicas=2 kv-budget=64MiB   # any odma-serve flag as key=value
"""

from __future__ import annotations

import logging
import shlex
import signal
import time
from dataclasses import replace
from typing import Callable

from odma.engine import EngineConfig
from odma.engine.length_log import read_realized_lengths
from odma.serve_ray.cluster import ClusterState, log_files
from odma.serve_ray.engine_ingress import EngineIngress
from odma.serve_ray.front import Front
from odma.serve_ray.replica import EngineReplica
from odma.serve_ray.settings import RaySettings

log = logging.getLogger("odma.serve")
BOOTSTRAP_LENGTHS = 2000  # as many as one engine bootstraps from its log


def bootstrap_lengths(config: EngineConfig) -> list[int]:
    """The realized lengths the cluster's window starts from: the last ones of the length logs (odma-serve's and
    every replica's), when the config bootstraps from its log."""
    lengths: list[int] = []
    if config.length_log and config.bootstrap_from_log:
        for path in log_files(config.length_log):
            lengths += read_realized_lengths(path, model=config.model)
    return lengths[-BOOTSTRAP_LENGTHS:]


def build_application(config: EngineConfig, settings: RaySettings, *, served_name: str | None = None,
                      generation_config: str = "auto", override_generation_config: str | None = None, max_n: int = 16):
    """The bound Serve application (give it to `serve.run`)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from odma.models.weights import model_name

    router = {"request_router_class": "odma.serve_ray.router:MemoryAwareRouter",
              "request_router_kwargs": {"max_skips": settings.max_skips, "max_hold_s": settings.max_hold_s,
                                        "w_memory": settings.w_memory, "w_compute": settings.w_compute}}
    routing = RequestRouterConfig(
        **(router if settings.router == "odma" else {}),
        request_routing_stats_period_s=settings.stats_period_s,
        request_routing_stats_timeout_s=max(5.0, 10 * settings.stats_period_s),
        # a held request is looked at again within 10-100 ms (Ray's defaults back off to 0.5 s)
        initial_backoff_s=0.01, backoff_multiplier=2, max_backoff_s=0.1,
    )
    quiet = {"enable_access_log": False}  # Serve logs every call at INFO: the replicas' reports, every token batch
    cluster = serve.deployment(name="OdmaCluster", num_replicas=1, ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=10_000, logging_config=quiet)(ClusterState)
    engines = serve.deployment(
        name="OdmaEngine", num_replicas=settings.replicas, ray_actor_options={"num_cpus": settings.replica_cpus},
        # admission is the ingress's (429 at max_queue for the cluster, or at each engine's share of it when the
        # engines are the ingress): Ray's own limit is never the one that refuses
        max_ongoing_requests=settings.max_queue + config.max_num_seqs * len(config.device_list),
        health_check_period_s=settings.health_check_period_s, health_check_timeout_s=30,
        graceful_shutdown_timeout_s=5, request_router_config=routing, logging_config=quiet,
    )
    shared = replace(config.buckets, large_bound=config.max_tokens_cap) if config.policy == "odma" else None
    cluster_app = cluster.bind(shared, report_period_s=settings.report_period_s, bootstrap=bootstrap_lengths(config))
    name = served_name or model_name(config.model)
    if settings.ingress == "engines":  # Ray's proxy routes to the engine replicas, each serving odma-serve's app
        return engines(serve.ingress()(EngineIngress)).bind(
            config, settings, cluster_app, name, (config.model, "default"), generation_config,
            override_generation_config, max_n)
    front = serve.deployment(name="OdmaFront", num_replicas=1, ray_actor_options={"num_cpus": 0},
                             max_ongoing_requests=100_000, graceful_shutdown_timeout_s=5,
                             logging_config=quiet)(serve.ingress()(Front))
    return front.bind(engines(EngineReplica).bind(config, settings, cluster_app), cluster_app, config, settings,
                      name, (config.model, "default"), generation_config, override_generation_config, max_n)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def wait_for_stop_signal(poll_s: float = 0.2, on_ready: Callable[[], None] | None = None) -> int:
    """Until SIGINT or SIGTERM; returns the signal, with the default handlers back (a second Ctrl-C during the
    teardown interrupts it). The handler takes no lock: with a threading.Event, two signals in quick succession
    (Ctrl-C that a wrapper such as `timeout` also forwards) re-entered Event.set in the main thread and deadlocked.
    on_ready: called once the handlers are in place (from then on a signal ends the wait)."""
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _: received.append(signum)) for sig in STOP_SIGNALS}
    if on_ready is not None:
        on_ready()
    try:
        while not received:
            time.sleep(poll_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return received[0]


def serve_forever(config: EngineConfig, settings: RaySettings, *, host: str, port: int, served_name: str | None,
                  generation_config: str, override_generation_config: str | None, max_n: int) -> int:
    """`odma-serve --ray`: start (or join) Ray, deploy, serve until SIGINT/SIGTERM, then tear everything down."""
    import ray
    from ray import serve

    from odma.models import resolve_model

    resolve_model(config.model)  # convert a first-use model once here, not in every replica at the same time
    ray.init(address=settings.address, include_dashboard=False, log_to_driver=True)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_application(config, settings, served_name=served_name, generation_config=generation_config,
                                    override_generation_config=override_generation_config, max_n=max_n),
                  name=settings.app_name, route_prefix="/")
        log.info("odma on Ray Serve: %d replicas, router %s, ingress %s, ready at http://%s:%d", settings.replicas,
                 settings.router, settings.ingress, host, port)
        wait_for_stop_signal()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def build_app(args: dict):
    """For `serve run odma.serve_ray:build_app key=value ...`: the keys are odma-serve's flags (without the
    dashes: `kv-budget=64MiB`, `replicas=2`, `router=pow2`); a flag without a value takes `true`."""
    from odma.server.cli import build_parser, config_from_args, ray_settings_from_args

    argv: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if str(value).lower() == "true":
            argv.append(flag)
        else:
            argv += [flag, *shlex.split(str(value))]
    parsed = build_parser().parse_args(argv)
    settings = replace(ray_settings_from_args(parsed), address=None)
    return build_application(config_from_args(parsed), settings, served_name=parsed.served_model_name,
                             generation_config=parsed.generation_config,
                             override_generation_config=parsed.override_generation_config, max_n=parsed.max_n)
