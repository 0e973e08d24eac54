"""One engine replica: an odma engine (`LLMEngine` + the asyncio bridge `AsyncEngine`, as in odma-serve) behind
Ray Serve. It streams each job's events one batch per engine step, reports its load to the router
(`record_routing_stats`, polled by Ray Serve), and reports realized lengths, load and metrics to the cluster
state, reserving from the bucket bounds that the cluster computes from every replica's lengths.
Ray is imported only where a Serve replica runs this (the class itself is plain Python)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import replace

from odma.engine import EngineConfig, LLMEngine
from odma.server.metrics import Metrics
from odma.server.runtime import AsyncEngine, Handle
from odma.server.streams import StopWatch
from odma.serve_ray.cluster import replica_log
from odma.server.wire import EventEncoder, RemoteJob
from odma.serve_ray.scoring import ReplicaLoad, load_of
from odma.serve_ray.settings import RaySettings

log = logging.getLogger(__name__)
UNLIMITED_QUEUE = 1 << 30  # the ingress does admission for the whole cluster (429); a replica queues what it gets


class ReplicaMetrics(Metrics):
    """odma-serve's metrics, plus the lengths realized since the last report (what the shared window learns)."""

    def __init__(self) -> None:
        super().__init__()
        self._realized: list[int] = []
        self._lock = threading.Lock()

    def on_finish(self, seq) -> None:
        super().on_finish(seq)
        if seq.finish_reason in ("stop", "length"):  # what the engine's own window learns too
            with self._lock:
                self._realized.append(seq.num_generated)

    def take_realized(self) -> list[int]:
        with self._lock:
            out, self._realized = self._realized, []
        return out

    def give_back(self, lengths: list[int]) -> None:
        """A report that did not reach the cluster: send these again next time."""
        with self._lock:
            self._realized[:0] = lengths


def replica_load(engine: LLMEngine) -> ReplicaLoad:
    """The engine's pools and queues now (read from another thread: copies of the queues, thread-safe stats)."""
    buckets = getattr(engine.policy, "buckets", None)
    # waiting: the queues, and requests not tagged yet (inbox) or samples of n > 1 held for their prompt
    return load_of([w.scheduler for w in engine.workers], waiting=engine.num_waiting,
                   max_num_seqs=engine.config.max_num_seqs * len(engine.workers),
                   max_request_tokens=engine.max_request_tokens, at=time.time(),
                   bounds_version=buckets.version if buckets is not None else 0)


class EngineReplica:
    """A Ray Serve deployment class (`odma.serve_ray.app` wraps it). `cluster`: a handle to the ClusterState
    deployment."""

    wants_others_metrics = False  # the other replicas' metrics come back with each report (an ingress wants them)

    async def __init__(self, config: EngineConfig, settings: RaySettings, cluster) -> None:
        from ray import serve

        context = serve.get_replica_context()
        self.name = context.replica_tag
        rank = getattr(context.rank, "rank", context.rank)
        self.settings, self.cluster = settings, cluster
        # its own length log; the cluster's window is bootstrapped from the logs, not each replica
        config = replace(config, length_log=replica_log(config.length_log, int(rank or 0)), bootstrap_from_log=False)
        self.metrics = ReplicaMetrics()
        self.engine = LLMEngine(config, metrics=self.metrics)
        self.buckets = getattr(self.engine.policy, "buckets", None)
        if self.buckets is not None and config.policy == "odma":
            self.buckets.follow()
        else:
            self.buckets = None  # static / s3: fixed bounds, nothing to share
        self.runtime = AsyncEngine(self.engine, max_queue=self.admission_queue(settings))
        self.metrics.attach(self.runtime)
        self._install(await self.cluster.join.remote(self.name))
        self.runtime.start()
        self._reporter = asyncio.get_running_loop().create_task(self._report_forever())
        log.info("replica %s (rank %s) serving; bucket bounds %s", self.name, rank,
                 self.buckets.bounds if self.buckets is not None else "fixed")

    def admission_queue(self, settings: RaySettings) -> int:
        return UNLIMITED_QUEUE

    # -- requests ------------------------------------------------------------------------------------

    async def generate(self, job: RemoteJob):
        """The job's events, one list of wire events per engine step, until each sample finished. Leaving early
        (the ingress cancelled: its client left) cancels the samples and frees their blocks."""
        handle: Handle = self.runtime.submit(job.prompt_ids, job.params, n=job.n, prompt_text=job.prompt_text,
                                             tags=job.tags)
        encoder = EventEncoder()
        # a stop string ends the request here at the token where the ingress's text sees it (the same TextStream)
        stops = StopWatch(self.engine, job.params, job.n)
        try:
            while not handle.finished:
                events = [await handle.queue.get()]
                while not handle.queue.empty():
                    events.append(handle.queue.get_nowait())
                batch = []
                for ev in events:
                    if ev.finished:
                        handle.remaining -= 1
                    elif stops.stopped_by(ev.seq.index, ev.token):
                        self.runtime.finish_early(ev.seq.request_id)
                    batch.append(encoder.encode(ev.token, ev.finished, ev.seq))
                yield batch
        finally:
            if not handle.finished:
                self.runtime.cancel(handle)

    # -- what the router and the cluster read --------------------------------------------------------

    def record_routing_stats(self) -> dict:
        """Ray Serve polls this for the request router (`odma.serve_ray.router`)."""
        return replica_load(self.engine).as_dict()

    def check_health(self) -> None:
        """Ray Serve restarts a replica whose engine loop stopped."""
        if not self.runtime.alive:
            raise RuntimeError(f"replica {self.name}: the engine loop is not running")

    async def _report_forever(self) -> None:
        period = self.settings.report_period_s
        while True:
            await asyncio.sleep(period)
            lengths = self.metrics.take_realized()
            try:
                from prometheus_client import generate_latest

                text = generate_latest(self.metrics.registry).decode()
                load = replica_load(self.engine).as_dict()
                stats = self.runtime.stats().as_dict()
                # positional, as the rest: sent by keyword, the live cluster tests saw the ingress lose every replica
                self._install(await self.cluster.report.remote(self.name, lengths, load, text, self.wants_others_metrics,
                                                               stats))
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the cluster state restarts; keep the lengths and try again
                self.metrics.give_back(lengths)
                log.warning("replica %s: report to the cluster state failed; retrying", self.name, exc_info=True)

    def _install(self, state: dict) -> None:
        if self.buckets is not None and state.get("bounds"):
            if self.buckets.install(state["bounds"]):
                log.info("replica %s: shared bucket bounds %s", self.name, self.buckets.bounds)

    def __del__(self) -> None:
        reporter = getattr(self, "_reporter", None)
        if reporter is not None:
            reporter.cancel()
        runtime = getattr(self, "runtime", None)
        if runtime is not None:
            runtime.stop()
            self.engine.close()
