"""The ingress: odma-serve's own FastAPI app (`odma.server.app.create_app`) over a runtime whose engine is the
cluster. It holds the tokenizer and the model's config but no weights: it validates and shapes requests exactly as
odma-serve does, predicts each request's length once (`predict_at="front"`), and hands the job to the engine
deployment through a Ray Serve handle, whose request router picks the replica. The replica's events come back one
batch per engine step and feed the same answer code (streams.py) as in odma-serve.

`RemoteRuntime` is odma-serve's `ServedRuntime` (odma.server.served_engine), as `AsyncEngine` is; its `stats()` merges
the replicas' engine snapshots. `FrontEngine` is its `ServedEngine`: what the app reads of an `LLMEngine`."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, AsyncIterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from odma.engine import EngineConfig, SamplingParams
from odma.engine.length_predictor import LoadedPredictor
from odma.engine.llm_engine import check_request
from odma.engine.output_text import OutputDecoder
from odma.engine.sequence import RequestTags, Sequence
from odma.engine.stats import EngineStats
from odma.kv import KVRequest, build_policy
from odma.kv.buckets import align_up
from odma.server.admission import Door, HandedOverDoor, Pass
from odma.server.runtime import Event, drain_events
from odma.serve_ray.merge_metrics import merge_stats, merge_texts
from odma.server.wire import RemoteJob, Views, sample_ids
from odma.serve_ray.scoring import ROUTING, ReplicaLoad
from odma.serve_ray.settings import RaySettings
from predictor.serving import ServedPredictor

log = logging.getLogger(__name__)


class ClusterView:
    """The ingress's copy of the cluster state (refreshed every report period): the replicas' loads, the shared
    bucket bounds (installed into a policy like the replicas', to size what a request will reserve), the median
    realized length, the replicas' metrics."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.policy = build_policy(config.policy, max_tokens=config.max_tokens_cap, buckets=config.buckets,
                                   pool=config.resolved_pool, s3_buckets=config.s3_buckets)
        self.buckets = getattr(self.policy, "buckets", None) if config.policy == "odma" else None
        if self.buckets is not None:
            self.buckets.follow()
        self.loads: dict[str, ReplicaLoad] = {}
        self.stats: dict[str, EngineStats] = {}  # each live replica's last engine snapshot
        self.texts: dict[str, str] = {}
        self.median: float | None = None
        self.updated_at = 0.0

    def apply(self, snapshot: dict) -> None:
        if self.buckets is not None and snapshot.get("bounds"):
            self.buckets.install(snapshot["bounds"])
        self.median = snapshot.get("median")
        loads = {name: ReplicaLoad.from_dict(d) for name, d in (snapshot.get("replicas") or {}).items()}
        self.loads = {name: l for name, l in loads.items() if l is not None}
        if "stats" in snapshot:
            self.stats = {name: EngineStats.from_dict(d) for name, d in snapshot["stats"].items()}
        if "metrics" in snapshot:
            self.texts = snapshot["metrics"]
        self.updated_at = time.monotonic()

    @property
    def running(self) -> int:
        return sum(l.running for l in self.loads.values())

    @property
    def waiting(self) -> int:
        return sum(l.waiting for l in self.loads.values())

    @property
    def max_request_tokens(self) -> int:
        """The largest request every replica can hold (0 before any reported)."""
        return min((l.max_request_tokens for l in self.loads.values()), default=0)

    def need(self, prompt_tokens: int, max_tokens: int, prediction: tuple[float, float] | None, n: int) -> int:
        """KV tokens the job's blocks reserve first, as the replicas' policy sizes them (shared bounds)."""
        predicted, u = prediction if prediction is not None else (None, 0.0)
        req = KVRequest("route", prompt_tokens, max_tokens, predicted, u)
        return n * align_up(self.policy.initial_tokens(req), self.config.pool.align)


class FrontEngine:
    """odma-serve's `ServedEngine` for an ingress that holds no model: limits and checks from the model's config and
    the replicas' reports."""

    def __init__(self, config: EngineConfig, tokenizer, model_config, view: ClusterView,
                 model_folder: Path | None = None) -> None:
        self.config, self.tokenizer, self.view, self.model_folder = config, tokenizer, view, model_folder
        self.vocab_size = model_config.vocab_size
        self.eos_ids = tuple(model_config.eos_token_ids)
        self._output_decoder = OutputDecoder(tokenizer, self.eos_ids)
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        self.outstanding = 0  # samples submitted here and not finished yet

    @property
    def max_request_tokens(self) -> int:
        return self.view.max_request_tokens

    def validate(self, ids: list[int], params: SamplingParams) -> None:
        check_request(ids, params, vocab_size=self.vocab_size, max_tokens_cap=self.config.max_tokens_cap,
                      max_model_len=self.max_model_len, max_request_tokens=self.max_request_tokens,
                      align=self.config.pool.align)

    def decode(self, ids: list[int]) -> str:
        return self._output_decoder(ids)

    @property
    def num_running(self) -> int:
        return self.view.running

    @property
    def num_waiting(self) -> int:
        """Samples queued at the replicas, and those here that no replica reports yet (held by the router)."""
        return max(self.view.waiting, self.outstanding - self.view.running)


class FrontPredictor:
    """The length predictor at the ingress: requests that arrive together are predicted in one batch, off the
    event loop, through `ServedPredictor` (the engine's and the vLLM plugin's loop).

    A predictor that learns is taught where requests finish, at the replicas; none finishes here. What the
    replicas realized reaches the ingress as the cluster's shared window of lengths, which is all a running median
    learns from, so the window stands in for it: its median, u = 1, and no prediction before any length was
    reported (the replica predicts then). A learner that reads the requests too would need them sent here."""

    def __init__(self, loaded: LoadedPredictor, generator: str, view: ClusterView, latency: Histogram) -> None:
        self.loaded, self.generator, self.view, self.latency = loaded, generator, view, latency
        self.served = ServedPredictor(loaded.predictor)
        self.shared_window = self.served.learns
        self._pending: list[tuple[Any, asyncio.Future]] = []
        self._draining = False
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="odma-front-predictor")
        self.calls = self.requests = 0
        self.seconds = 0.0

    async def predict(self, seq: Sequence) -> tuple[float, float] | None:
        """A usable (L̂, u), or None: the request reserves for the worst case."""
        if self.shared_window:
            return self.served.usable((self.view.median, 1.0)) if self.view.median is not None else None
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending.append((seq.predict_request(self.generator), fut))
        if not self._draining:
            self._draining = True
            loop.create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                started = time.perf_counter()
                try:  # ServedPredictor.predict does not raise; the executor can (shut down)
                    preds = await loop.run_in_executor(self._pool, self.served.predict, [r for r, _ in batch])
                except Exception:  # noqa: BLE001 - the requests must not be lost: worst case
                    log.exception("length predictor unreachable at the ingress; these requests reserve the worst case")
                    preds = [None] * len(batch)
                seconds = time.perf_counter() - started
                self.latency.observe(seconds)
                self.calls, self.requests, self.seconds = self.calls + 1, self.requests + len(batch), self.seconds + seconds
                for (_, fut), pred in zip(batch, preds):
                    if not fut.done():
                        fut.set_result(pred)
        finally:
            self._draining = False


@dataclass(slots=True)
class RemoteHandle:
    """One HTTP request's samples, the queue their events arrive on, and the task that drives the replica call."""

    request_ids: list[str]
    queue: asyncio.Queue
    remaining: int
    task: asyncio.Task | None = None

    @property
    def finished(self) -> bool:
        return self.remaining == 0


def _as_own_call(request_id: str) -> None:
    """Calls made from here on in this task (the job's own: a copy of the handler's context) go to the engines
    under `request_id`. Ray Serve names every call made while one HTTP request is handled by that request's internal
    id, and its routing tracks calls by it: of the jobs of one request's several prompts, all but one were never
    routed (a hang)."""
    from ray.serve import context

    context._set_request_context(_internal_request_id=request_id)


REPLICA_RETRIES = 2  # a request whose replica dies before its first event goes to another replica this often


def _replica_died(exc: BaseException) -> bool:
    """Whether the engine replica's process is gone (killed, OOM, node lost), as Ray reports it."""
    from ray.exceptions import RayActorError  # ActorDiedError, ActorUnavailableError

    return isinstance(exc, RayActorError)


class RemoteRuntime(HandedOverDoor):
    """odma-serve's `ServedRuntime` over the engine deployment. A replica that fails mid-request (it died, Ray lost
    it) fails that request's unfinished samples with an error naming the replica's failure: the answer is a 500,
    or an error event in a stream, never a hang."""

    def __init__(self, engine: FrontEngine, engines, cluster, settings: RaySettings,
                 predictor: FrontPredictor | None) -> None:
        self.engine, self.cluster, self.settings, self.predictor = engine, cluster, settings, predictor
        self.view = engine.view
        # places of requests admitted and not submitted yet (being tokenized): from submit on, `outstanding` counts them
        self.door = Door(settings.max_queue)
        self._generate = engines.options(stream=True).generate
        self._poller: asyncio.Task | None = None
        self.failed_streams = 0  # requests whose replica failed under them
        self.retried = 0  # requests sent again because their replica died before answering
        self.closing = False  # the app asks before admitting; Ray Serve drains the replicas itself when it stops

    # -- lifecycle -----------------------------------------------------------------------------------

    async def refresh(self, with_metrics: bool = False) -> None:
        self.view.apply(await self.cluster.snapshot.remote(with_metrics))

    async def wait_for_replicas(self, timeout_s: float) -> None:
        """Until a replica has reported (its pool's size bounds what requests are accepted)."""
        deadline = time.monotonic() + timeout_s
        while True:
            await self.refresh()
            if self.view.loads:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"no engine replica reported within {timeout_s:.0f} s")
            await asyncio.sleep(self.settings.report_period_s / 2)

    def start(self) -> None:
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll_forever())

    def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            self._poller = None

    @property
    def alive(self) -> bool:
        """The ingress serves while it runs: Ray Serve checks the engine replicas and restarts them itself."""
        return True

    def drain(self) -> None:
        """Refuse new requests (503); Ray Serve drains the replicas, and the requests they run, itself."""
        self.closing = True

    def close(self) -> None:
        """Nothing is owned here beyond the poller: each replica closes its own engine."""
        self.stop()

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.report_period_s)
            try:
                await self.refresh(with_metrics=True)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the cluster state may be restarting; the next poll retries
                log.warning("cluster state unreachable; retrying", exc_info=True)

    # -- requests ------------------------------------------------------------------------------------

    def submit(self, prompt: str | list[int], params: SamplingParams, *, n: int = 1, prompt_text: str | None = None,
               tags: RequestTags | None = None, admitted: Pass | None = None) -> RemoteHandle:
        """Validate (InvalidRequestError... raise here, nothing sent) and start the job on a replica. `admitted`:
        the places `admit` took, given back here as `outstanding` takes the samples over (no await in between)."""
        ids, prompt_text = self.checked_prompt(prompt, params, prompt_text, admitted)
        rid = f"req-{uuid.uuid4().hex}"
        handle = RemoteHandle(sample_ids(rid, n), asyncio.Queue(), n)
        job = RemoteJob(rid, ids, params, n, prompt_text, tags, created_at=time.time())
        self.engine.outstanding += n
        handle.task = asyncio.get_running_loop().create_task(self._run(handle, job))
        # a callback, not _run's `finally`: a task cancelled before it first ran never enters its body
        handle.task.add_done_callback(lambda _: self._settled(n))
        return handle

    def _settled(self, samples: int) -> None:
        self.engine.outstanding -= samples

    async def _run(self, handle: RemoteHandle, job: RemoteJob) -> None:
        views = Views(job.request_id, job.n)
        stream = None
        _as_own_call(job.request_id)
        try:
            job = await self._sized(job)
            for attempt in range(1 + REPLICA_RETRIES):
                stream = self._generate.remote(job)
                received = False
                try:
                    async for batch in stream:
                        received = True
                        for event in batch:
                            view = views.views[event[0]]
                            token, finished = view.apply(event)
                            handle.queue.put_nowait(Event(token, finished, view))
                    break
                except Exception as exc:  # noqa: BLE001 - only a replica that died before answering is retried
                    if received or attempt == REPLICA_RETRIES or not _replica_died(exc):
                        raise
                    # nothing came back yet, so nothing reached the client: the request goes to another replica
                    # (the router drops the dead one as soon as a call to it fails)
                    self.retried += 1
                    log.warning("request %s: its replica died before answering (%s); sent again", job.request_id,
                                type(exc).__name__)
        except asyncio.CancelledError:
            if stream is not None:
                stream.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - whatever the replica or Ray raised fails this request only
            self.failed_streams += 1
            message = f"replica failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500]
            log.warning("request %s: %s", job.request_id, message)
            for view in views.unfinished():
                view.fail(message)
                handle.queue.put_nowait(Event(None, True, view))
        if views.unfinished():  # the stream ended without finishing a sample: say so rather than wait forever
            for view in views.unfinished():
                view.fail("replica failed: the stream ended early")
                handle.queue.put_nowait(Event(None, True, view))

    async def _sized(self, job: RemoteJob) -> RemoteJob:
        """The job with its predicted length (at the ingress) and the KV need the router weighs."""
        prediction = None
        tags = job.tags
        if self.predictor is not None:
            seq = Sequence(job.request_id, job.prompt_ids, job.params, prompt_text=job.prompt_text, tags=tags)
            prediction = await self.predictor.predict(seq)
            if prediction is not None:
                tags = replace(tags or RequestTags(), prediction=prediction)
        elif self.view.median is not None:  # the replica predicts; the router sizes by the shared median
            prediction = (float(self.view.median), 0.0)
        need = self.view.need(job.prompt_tokens, job.params.max_tokens, prediction, job.n)
        return replace(job, tags=tags, need=need)

    def events(self, handle: RemoteHandle) -> AsyncIterator[Event]:
        """The events of all the handle's samples until each finished; leaving early cancels the replica's work."""
        return drain_events(handle, self.cancel)

    def cancel(self, handle: RemoteHandle) -> None:
        if handle.task is not None and not handle.task.done():
            handle.task.cancel()

    def finish_early(self, request_id: str) -> None:
        """Nothing to do: the replica ends the request at the same token (it runs the same stop-string check,
        odma.serve_ray.replica), so its realized length is logged as in odma-serve."""

    def stats(self) -> EngineStats:
        """The replicas' last reported snapshots, merged (as their /metrics are)."""
        return merge_stats(self.view.stats, policy=self.engine.config.policy)


class ClusterMetrics:
    """The ingress's /metrics: the replicas' metrics merged under odma-serve's names, with the ingress's own
    (HTTP refusals, the predictor when it runs here) and the cluster's (replicas, routing) added."""

    def __init__(self, view: ClusterView) -> None:
        self.view = view
        self.own = CollectorRegistry()  # merged into the replicas' families
        self.predict = Histogram("odma_predictor_latency_seconds", "Length predictor latency per batch call",
                                 buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
                                 registry=self.own)
        self.http_refusals: dict[str, int] = {}
        self.runtime: RemoteRuntime | None = None
        self.own.register(_Refusals(self))
        self.registry = CollectorRegistry()
        self.registry.register(_Cluster(self))

    def refused(self, reason: str) -> None:
        self.http_refusals[reason] = self.http_refusals.get(reason, 0) + 1


class _Refusals:
    def __init__(self, metrics: ClusterMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        c = CounterMetricFamily("odma_http_refusals", "Requests refused at the door", labels=["reason"])
        for reason, n in sorted(self.metrics.http_refusals.items()):
            c.add_metric([reason], n)
        yield c


class _Cluster:
    def __init__(self, metrics: ClusterMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        m = self.metrics
        texts = {"ingress": generate_latest(m.own).decode(), **m.view.texts}
        yield from merge_texts(texts)
        replicas = GaugeMetricFamily("odma_ray_replicas", "Engine replicas reporting to the cluster state")
        replicas.add_metric([], len(m.view.loads))
        yield replicas
        for name, doc, value in (
            ("odma_router_holds", "Requests the router held because no replica had room", ROUTING.holds),
            ("odma_router_guard_releases", "Held requests the starvation guard sent on without room", ROUTING.released),
            ("odma_router_routed", "Requests the memory-aware router placed", ROUTING.routed),
            ("odma_router_stats_reads", "Replica reports the router read to place a request", ROUTING.decisions),
            ("odma_router_stats_age_seconds", "Σ age of those reports when read (÷ reads: mean staleness)",
             ROUTING.stats_age_s),
            ("odma_ray_failed_requests", "Requests failed because their replica failed",
             m.runtime.failed_streams if m.runtime is not None else 0),
            ("odma_ray_retried_requests", "Requests sent again because their replica died before answering",
             m.runtime.retried if m.runtime is not None else 0),
        ):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            yield c


class Front:
    """The ingress deployment class (`odma.serve_ray.app` wraps it with `serve.ingress`): it builds odma-serve's
    app over the cluster."""

    async def __init__(self, engines, cluster, config: EngineConfig, settings: RaySettings, served_name: str,
                       aliases: tuple[str, ...] = (), generation_config: str = "auto",
                       override_generation_config: str | None = None, max_n: int = 16) -> None:
        from transformers import AutoTokenizer

        from odma.engine.length_predictor import load_engine_predictor
        from odma.models import resolve_model
        from odma.models.config import ModelConfig
        from odma.models.weights import model_name
        from odma.server.generation_config import load_sampling_defaults

        folder = resolve_model(config.model)
        view = ClusterView(config)
        self.engine = FrontEngine(config, AutoTokenizer.from_pretrained(str(folder)), ModelConfig.from_folder(folder), view,
                                  model_folder=folder)
        self.metrics = ClusterMetrics(view)
        predictor = None
        if settings.predict_at == "front" and config.policy != "static":
            loaded = load_engine_predictor(config.predictor)
            predictor = FrontPredictor(loaded, model_name(config.model), view, self.metrics.predict)
        self.runtime = RemoteRuntime(self.engine, engines, cluster, settings, predictor)
        self.metrics.runtime = self.runtime
        await self.runtime.wait_for_replicas(timeout_s=600)
        self.defaults = load_sampling_defaults(generation_config, folder, override_generation_config,
                                               config.max_tokens_cap)
        self.served_name, self.aliases, self.max_n = served_name, aliases, max_n

    def __serve_build_asgi_app__(self):
        from odma.server.app import create_app

        return create_app(self.runtime, self.metrics, self.served_name, aliases=self.aliases, defaults=self.defaults,
                          max_n=self.max_n)
