"""The engine: request → predictor tag (L̂, u, bucket) → scheduler (reserve / extend / release on the pool)
→ model runner → sampled tokens → finished requests logged with their realized lengths."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

import torch

from odma.engine.config import EngineConfig, parse_bytes, parse_kv_budget
from odma.engine.fork import Forks
from odma.engine.length_log import LengthLog, read_realized_lengths
from odma.engine.length_predictor import LoadedPredictor, load_engine_predictor, load_length_probe
from odma.engine.model_runner import ModelRunner
from odma.engine.output_text import OutputDecoder
from odma.engine.prefix_share import copy_prefixes
from odma.engine.sampling import SamplingParams
from odma.engine.scheduler import Scheduler
from odma.engine.stats import BucketStats, EngineStats, PredictorStats, ProbeStats, device_stats
from odma.engine.sequence import RequestTags, Sequence, Status
from odma.engine.stopping import stop_reason
from odma.engine.tagging import LengthTagger, TagAheadConfig
from odma.engine.worker import DeviceWorker, build_worker
from odma.errors import ConfigError, InvalidRequestError, RequestTooLargeError
from odma.kv import KVPool, build_policy, rank_devices
from odma.models import DTYPES
from odma.models.llama import CausalLM
from odma.models.random_served import is_random_model, make_random_served_model

log = logging.getLogger(__name__)
TAG_WAIT_S = 0.05  # tagging ahead: how long an idle step waits for a tag before it returns (the caller's loop goes on)


@dataclass(frozen=True, slots=True)
class StepOutput:
    seq: Sequence
    token: int | None  # the new token (None: the request only finished, e.g. cancelled)
    finished: bool


def open_backend(device: str):
    """The backend of `device`; ConfigError when it is absent or not supported here."""
    from backends import BackendError, get_backend

    try:
        return get_backend(device)
    except BackendError as exc:
        raise ConfigError(str(exc)) from None


def check_request(ids: list[int], params: SamplingParams, *, vocab_size: int, max_tokens_cap: int, max_model_len: int,
                  max_request_tokens: int, align: int) -> None:
    """Refuse a request no engine with these limits could serve (InvalidRequestError / RequestTooLargeError), before
    anything is queued. Also what a cluster's ingress checks, which holds no model."""
    if not ids:
        raise InvalidRequestError("the prompt is empty (0 tokens)")
    if any(type(t) is not int or not 0 <= t < vocab_size for t in ids):
        raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab_size})")
    # the sampler indexes the logits by these ids: one outside the vocabulary would fail the whole step's batch
    for name, named in (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids)):
        outside = sorted({t for t in named if not (type(t) is int and 0 <= t < vocab_size)})
        if outside:
            raise InvalidRequestError(f"{name} names token ids outside the vocabulary [0, {vocab_size}): {outside[:5]}")
    if params.max_tokens > max_tokens_cap:
        raise InvalidRequestError(f"max_tokens {params.max_tokens} exceeds this server's cap of {max_tokens_cap}")
    total = len(ids) + params.max_tokens
    if total > max_model_len:
        raise InvalidRequestError(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the model's "
            f"context of {max_model_len} tokens"
        )
    if -(-total // align) * align > max_request_tokens:
        raise RequestTooLargeError(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) cannot fit the KV pool's largest "
            f"block ({max_request_tokens} tokens); lower max_tokens or raise --kv-budget"
        )


class NullMetrics:
    """The hooks the engine calls; the server's Prometheus metrics implement the same methods."""

    def on_predict(self, seconds: float, n: int) -> None: ...
    def on_first_token(self, seq: Sequence, seconds: float) -> None: ...
    def on_finish(self, seq: Sequence) -> None: ...


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        model: CausalLM | None = None,
        tokenizer: Any = None,
        predictor: LoadedPredictor | None = None,
        metrics: Any = None,
    ) -> None:
        self.config = config
        torch.set_num_threads(config.threads)
        devices = config.device_list
        backends = [open_backend(d) for d in devices]
        for b in backends:  # fail on a bad budget before loading anything
            parse_kv_budget(config.kv_budget, b.memory_info().total_bytes)
        folder = None
        self.weights = config.dtype  # what the served weights are: a dtype, or "native" (a GGUF's own blocks)
        if model is None and is_random_model(config.model):
            if len(devices) > 1:
                raise ConfigError(f"{config.model} is made on one device: serve it with --device, not --devices")
            if config.weights == "native":
                raise ConfigError(f"{config.model} has dense random weights: --weights native does not apply")
            model, random_tokenizer = make_random_served_model(config.model, DTYPES[config.dtype],
                                                               str(backends[0].device))
            tokenizer = tokenizer if tokenizer is not None else random_tokenizer
        elif model is None:
            from odma.models.weights import load_served_model

            model, folder, self.weights = load_served_model(config.model, config.weights, config.dtype,
                                                            device=str(backends[0].device))
            if tokenizer is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(str(folder))
        self.model = model
        self.tokenizer = tokenizer
        self._output_decoder: OutputDecoder | None = None  # made on the first decode (the EOS ids known by then)
        self.model_folder = folder  # None when the model object was handed in (its generation_config is unknown)
        self.max_model_len = config.max_model_len or model.config.max_position_embeddings
        bootstrap = []
        if config.length_log and config.bootstrap_from_log:
            bootstrap = read_realized_lengths(config.length_log, model=config.model, max_length=self.max_model_len)
        # one policy object for every device: one set of bucket bounds, one window of realized lengths
        # (the paged baseline reserves no buckets; its requests are tagged as odma's are, for ordering)
        self.policy = build_policy("odma" if config.policy == "paged" else config.policy,
                                   max_tokens=config.max_tokens_cap, buckets=config.buckets,
                                   pool=config.resolved_pool, s3_buckets=config.s3_buckets, bootstrap=bootstrap)
        kv_dtype = DTYPES[config.resolved_kv_dtype]
        models = {str(model.device): model}  # devices that are the same torch device share the weights
        self.workers: list[DeviceWorker] = []
        for device, backend in zip(devices, backends):
            here = models.get(str(backend.device))
            if here is None:
                from odma.models import load_model, resolve_model

                here = models[str(backend.device)] = load_model(folder or resolve_model(config.model),
                                                                dtype=model.dtype, device=str(backend.device))
            self.workers.append(build_worker(config, device, backend, here, self.policy, kv_dtype))
        self._worker_of: dict[str, DeviceWorker] = {}
        self._device_threads = None  # one thread per device when their model steps run concurrently
        if len(self.workers) > 1 and config.parallel_devices_resolved:
            from concurrent.futures import ThreadPoolExecutor

            self._device_threads = ThreadPoolExecutor(len(self.workers), thread_name_prefix="odma-device")
        self.metrics = metrics or NullMetrics()
        from odma.models.weights import model_name

        self.generator = model_name(config.model)  # the predictor's `generator` field: whose lengths these are
        loaded = predictor or load_engine_predictor(config.predictor if config.policy != "static" else "median")
        self.tagger = LengthTagger(loaded, self.policy, self.generator, self.metrics,
                                   growth_hint=config.pool.growth_hint == "pred",
                                   ahead=(TagAheadConfig(config.tag_batch, config.tag_timeout_s)
                                          if config.tagging == "ahead" else None))
        self.probe, self.probe_fallback = load_length_probe(config, model, self.generator)
        if self.probe is not None:
            for w in self.workers:
                w.runner.capture_layers = self.probe.capture_layers
        self.length_log = (LengthLog(config.length_log, config.policy, config.model, self.generator,
                                     prompts=config.length_log_prompts, backups=config.length_log_backups,
                                     max_bytes=parse_bytes(config.length_log_max_size, "length log size", allow_zero=True))
                           if config.length_log else None)
        self._inbox: deque[tuple[str, Any]] = deque()
        self._inbox_lock = threading.Lock()
        self._live: dict[str, Sequence] = {}
        self.forks = Forks()  # samples 2..n of n > 1 requests, until sample 1 has its prompt cached
        self._ids = itertools.count()
        self.steps = 0
        self.errors = 0
        self.busy_seconds = 0.0  # time inside model steps (the rest of wall time: idle, scheduling, HTTP)
        self.decode_tokens = 0  # Σ decode batch sizes over steps
        self.prefill_tokens = 0  # prompt (and recomputed) tokens fed
        log.info(
            "engine: policy=%s on %s, kv %s per device, predictor=%s%s", config.policy, ", ".join(devices),
            config.kv_budget, self.predictor.name,
            f" (fallback: {self.predictor.fallback_reason})" if self.predictor.fallback_reason else "",
        )
        from odma.models.cpu_linear import linear_summary
        from odma.models.gguf import weight_bytes

        log.info("engine: weights %s (%.1f MB as stored); linear layers: %s", self.weights, weight_bytes(model) / 1e6,
                 linear_summary(model))

    def tag_requests_ahead(self) -> None:
        """Tag requests with their predicted length on a worker thread as they arrive, overlapping the model's steps
        (what a server wants; `tagging="auto"` asks it of the server's runtime). Call it before adding requests."""
        self.tagger.tag_ahead(TagAheadConfig(self.config.tag_batch, self.config.tag_timeout_s))

    @property
    def predictor(self) -> LoadedPredictor:
        return self.tagger.predictor

    @predictor.setter
    def predictor(self, loaded: LoadedPredictor) -> None:
        self.tagger.predictor = loaded

    @property
    def rejected_predictions(self) -> int:
        """Predictions not finite or out of range: those requests reserved the worst case."""
        return self.tagger.rejected

    # The first device's parts (the only device's, unless --devices names several).
    @property
    def backend(self):
        return self.workers[0].backend

    @property
    def runner(self) -> ModelRunner:
        return self.workers[0].runner

    @property
    def pool(self) -> KVPool:
        return self.workers[0].pool

    @property
    def scheduler(self) -> Scheduler:
        return self.workers[0].scheduler

    @property
    def elastic(self):
        return self.workers[0].elastic

    @property
    def swap(self):
        return self.workers[0].swap

    # -- requests in -----------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        prompt_text: str | None = None,
        tags: RequestTags | None = None,
    ) -> Sequence:
        """Validate and queue a request (thread-safe). Raises InvalidRequestError / RequestTooLargeError
        before anything is queued, so a refused request holds nothing."""
        return self.add_samples(prompt, params, 1, request_id=request_id, prompt_text=prompt_text, tags=tags)[0]

    def add_samples(
        self,
        prompt: str | list[int],
        params: SamplingParams | None,
        n: int,
        *,
        request_id: str | None = None,
        prompt_text: str | None = None,
        tags: RequestTags | None = None,
    ) -> list[Sequence]:
        """Queue `n` samples of one prompt, each a request with its own block (ids: `request_id`, then
        `request_id.1`, ...; a seeded request's sample i draws from seed + i). The prompt is computed once:
        the other samples copy its K/V (`odma.engine.fork`). Validation as in `add_request`."""
        params = params or SamplingParams(max_tokens=self.config.default_max_tokens)
        if type(n) is not int or n < 1:
            raise InvalidRequestError(f"n must be an integer >= 1, got {n!r}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer: pass token ids")
            prompt_text = prompt if prompt_text is None else prompt_text
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = list(prompt)
        self.validate(ids, params)
        rid = request_id or f"req-{next(self._ids)}"
        seqs = [Sequence(rid if i == 0 else f"{rid}.{i}", ids if i == 0 else list(ids), params,
                         prompt_text=prompt_text, tags=tags, index=i) for i in range(n)]
        if n > 1:
            Forks.group(seqs)
        with self._inbox_lock:
            taken = [s.request_id for s in seqs if s.request_id in self._live]
            if taken:
                raise InvalidRequestError(f"request id {taken[0]!r} is already in flight")
            for seq in seqs:
                self._live[seq.request_id] = seq
            # tagging ahead: the group waits for its first sample's tag off the loop (one made upstream needs none)
            ahead = self.tagger.ahead is not None and (tags is None or tags.prediction is None)
            if ahead:
                self.tagger.ask_ahead(seqs[0], seqs)
            else:
                self._inbox.append(("add", seqs))
        return seqs

    def validate(self, ids: list[int], params: SamplingParams) -> None:
        check_request(ids, params, vocab_size=self.model.config.vocab_size, max_tokens_cap=self.config.max_tokens_cap,
                      max_model_len=self.max_model_len, max_request_tokens=self.max_request_tokens,
                      align=self.config.pool.align)

    @property
    def max_request_tokens(self) -> int:
        """Prompt + output tokens the largest block of any device's pool can hold."""
        return max(w.kv.max_request_tokens for w in self.workers)

    def _fits(self, tokens: int, limit: int) -> bool:
        return -(-tokens // self.config.pool.align) * self.config.pool.align <= limit

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Cancel a request (thread-safe); its block is released at the next step. reason="stop" ends it as a
        normal completion (a stop string matched), so its length is logged as realized."""
        with self._inbox_lock:
            self._inbox.append(("abort", (request_id, reason)))
        if self.tagger.ahead is not None:
            self.tagger.ahead.poke()  # a loop waiting for tags ends the request now

    def fail_all(self, message: str) -> list[StepOutput]:
        """Finish every live request with an error (the loop's last resort); frees all their blocks."""
        outputs = []
        for seq in list(self._live.values()):
            if seq.status is not Status.FINISHED:
                seq.error = message
                try:
                    outputs.append(self._finish(seq, "error"))
                except Exception:  # noqa: BLE001 - keep failing the others
                    log.exception("could not finish %s", seq.request_id)
        return outputs

    def cancel_all(self, message: str) -> list[StepOutput]:
        """End every live request with an error `message`, the queued ones too (the server is stopping): they are
        placed first, so none is scheduled after it ended. Call it from the thread that steps the engine."""
        return self._drain_inbox() + self.fail_all(message)

    # -- the loop --------------------------------------------------------------------------------

    def has_work(self) -> bool:
        """Requests queued, running, or (tagging ahead) waiting for their tag."""
        return self._steppable() or (self.tagger.ahead is not None and self.tagger.ahead.waiting > 0)

    def _steppable(self) -> bool:
        return bool(self._inbox) or any(w.scheduler.has_work() for w in self.workers) or self.forks.pending > 0

    def step(self) -> list[StepOutput]:
        """One model step on every device that has work. Scheduling and bookkeeping are serial; the model
        steps of several devices run concurrently when `parallel_devices` is on (threads: torch releases the
        interpreter lock inside its kernels), else one after another. Tagging ahead, a step with nothing else
        to do waits (briefly) for the next tag rather than spin."""
        if self.tagger.ahead is not None and not self._steppable():
            self.tagger.ahead.wait(TAG_WAIT_S)
        outputs = self._drain_inbox()
        self._queue_forks()
        # samples of n > 1 requests admitted this step copy the prompt's K/V instead of computing it
        batches = [(w, self.forks.prepare(copy_prefixes(work, w.runner.arena), w.runner.arena))
                   for w in self.workers if (work := w.scheduler.schedule())]
        if len(batches) > 1 and self._device_threads is not None:
            results = list(self._device_threads.map(lambda b: self._run(*b), batches))
        else:
            results = [self._run(w, work) for w, work in batches]
        for (worker, work), (tokens, error, seconds) in zip(batches, results):
            outputs += self._apply(worker, work, tokens, error, seconds)
        self._queue_forks()
        self._maybe_refresh_buckets()
        return outputs

    def _queue_forks(self) -> None:
        """Samples whose first sample has its prompt cached join its device's queue (they copy its K/V); those
        whose first sample ended go wherever placement puts them (they prefill the prompt themselves)."""
        by_device = {w.device: w for w in self.workers}
        for first, forks in self.forks.release():
            for seq in forks:
                if seq.finished:
                    continue
                worker = by_device[first.device] if first.device in by_device and not first.finished else self._place(seq)
                self._worker_of[seq.request_id] = worker
                seq.device = worker.device
                worker.scheduler.add(seq)

    @staticmethod
    def _run(worker: DeviceWorker, work: list) -> tuple[list | None, Exception | None, float]:
        started = time.perf_counter()
        try:
            return worker.runner.run(work), None, time.perf_counter() - started
        except Exception as exc:  # noqa: BLE001 - reported by _apply, which fails the step's requests
            return None, exc, time.perf_counter() - started

    def _apply(self, worker: DeviceWorker, work: list, tokens: list | None, error: Exception | None,
               step_seconds: float) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        self.steps += 1
        if error is not None:  # a failed step fails its requests, never leaks their blocks
            log.error("model step failed on %s", worker.device, exc_info=error)
            self.errors += 1
            for w in work:
                w.seq.error = f"{type(error).__name__}: {error}"
                outputs.append(self._finish(w.seq, "error"))
            return outputs
        self.busy_seconds += step_seconds
        if self.probe is not None:  # before the tokens are appended: it reads what each item was fed
            self.probe.after_step(work, worker.runner.captured)
        for w in work:
            if w.q_len == 1:
                self.decode_tokens += 1
            else:
                self.prefill_tokens += w.q_len
        now = time.monotonic()
        slowest_first_token = 0.0
        for w, tok in zip(work, tokens):
            if tok is None:
                continue
            seq = w.seq
            seq.output_ids.append(tok)
            if seq.first_token_at is None:
                seq.first_token_at = now
                slowest_first_token = max(slowest_first_token, now - seq.arrival)
                self.metrics.on_first_token(seq, now - seq.arrival)
            reason = stop_reason(seq, tok, eos_ids=self.runner.eos_ids, tokenizer=self.tokenizer,
                                 max_model_len=self.max_model_len)
            outputs.append(self._finish(seq, reason, tok) if reason else StepOutput(seq, tok, False))
        self._scale_swap_buffer(worker, step_seconds, slowest_first_token, work)
        return outputs

    def _scale_swap_buffer(self, worker: DeviceWorker, step_seconds: float, slowest_first_token: float,
                           work: list) -> None:
        """eLLM Algorithm 2 on the device's swap buffer: one SLO outcome per step (a decode step slower than the
        TPOT SLO; a first token later than the TTFT SLO)."""
        c = self.config
        if worker.swap is None or (c.slo_ttft_s is None and c.slo_tpot_s is None):
            return
        decoded = any(w.q_len == 1 for w in work)
        tpot_violated = c.slo_tpot_s is not None and decoded and step_seconds > c.slo_tpot_s
        ttft_violated = c.slo_ttft_s is not None and slowest_first_token > c.slo_ttft_s
        worker.swap.controller.end_iteration(ttft_violated, tpot_violated)

    def _finish(self, seq: Sequence, reason: str, tok: int | None = None) -> StepOutput:
        realized = reason in ("stop", "length")
        # a request not placed yet (still in the inbox) is in no queue: any scheduler just marks it finished
        self._worker_of.pop(seq.request_id, self.workers[0]).scheduler.finish(seq, reason, observe=realized)
        self.forks.drop(seq)
        seq.finished_at = time.monotonic()
        self._live.pop(seq.request_id, None)
        if self.tagger.ahead is not None and seq.index == 0:
            waiting = self.tagger.ahead.drop(seq.request_id)  # cancelled while its tag was made: the tag is dropped
            if waiting is not None and any(not f.finished for f in waiting[1:]):
                self.forks.hold(seq, waiting[1:])  # its other samples still run: they prefill the prompt themselves
        if realized:
            self.tagger.learn(seq)
            if self.probe is not None:
                self.probe.learn(seq)
            if self.length_log is not None:
                self.length_log.write(seq)
        self.metrics.on_finish(seq)
        return StepOutput(seq, tok, True)

    def _drain_inbox(self) -> list[StepOutput]:
        with self._inbox_lock:
            items = list(self._inbox)
            self._inbox.clear()
        groups = [(seqs, False) for kind, seqs in items if kind == "add"]
        if self.tagger.ahead is not None:
            for seqs, prediction in self.tagger.ahead.ready():
                if prediction is not None:  # it enters as a prediction made upstream
                    seqs[0].tags = replace(seqs[0].tags or RequestTags(), prediction=tuple(prediction))
                groups.append((seqs, True))
            groups.sort(key=lambda group: group[0][0].arrival)  # stable: in the order the requests arrived
        if groups:
            # the other samples of a group get the first's tag
            self.tagger.tag([seqs[0] for seqs, _ in groups], [asked for _, asked in groups])
            for first, *forks in (seqs for seqs, _ in groups):
                worker = self._place(first)
                self._worker_of[first.request_id] = worker
                first.device = worker.device
                worker.scheduler.add(first)
                self.forks.hold(first, forks)
        outputs = []
        for kind, item in items:
            if kind == "abort":
                rid, reason = item
                seq = self._live.get(rid)
                if seq is not None and seq.status is not Status.FINISHED:
                    outputs.append(self._finish(seq, reason))
        return outputs

    def _place(self, seq: Sequence) -> DeviceWorker:
        """The device with the least memory pressure and compute load (odma.kv.placement's score, the queue
        counted as load) among those whose pool can ever hold the request; it stays there to the end."""
        if len(self.workers) == 1:
            return self.workers[0]
        need = self.policy.initial_tokens(seq)
        total = seq.prompt_tokens + seq.params.max_tokens
        fits = [w for w in self.workers if self._fits(total, w.kv.max_request_tokens)]
        by_name = {w.device: w for w in fits or self.workers}
        return by_name[rank_devices([w.load() for w in by_name.values()], need)[0]]

    def _maybe_refresh_buckets(self) -> None:
        buckets = getattr(self.policy, "buckets", None)
        if buckets is not None and buckets.refresh_due():
            if buckets.refresh():
                log.info("bucket bounds refreshed: %s", buckets.bounds)

    # -- convenience -----------------------------------------------------------------------------

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None) -> list[Sequence]:
        """Run prompts to completion together (continuous batching); for tests and offline use."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while any(not s.finished for s in seqs):
            self.step()
        return seqs

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.runner.eos_ids

    def decode(self, ids: list[int]) -> str:
        if self._output_decoder is None or self._output_decoder.tokenizer is not self.tokenizer:
            self._output_decoder = OutputDecoder(self.tokenizer, self.eos_ids)
        return self._output_decoder(ids)

    @property
    def num_waiting(self) -> int:
        queued = sum(len(w.scheduler.waiting) for w in self.workers) + self.forks.pending
        if self.tagger.ahead is not None:  # samples whose group waits for its tag
            queued += sum(len(group) for group in self.tagger.ahead.waiters())
        return queued + sum(len(seqs) for k, seqs in list(self._inbox) if k == "add")

    @property
    def num_running(self) -> int:
        return sum(len(w.scheduler.running) for w in self.workers)

    def stats(self) -> EngineStats:
        """A snapshot of the pools, queues, buckets and counters, safe to take from any thread (the pools' stats
        are thread-safe; queues and counters are copied)."""
        buckets = getattr(self.policy, "buckets", None)
        ahead = self.tagger.ahead
        return EngineStats(
            policy=self.config.policy, predictor=PredictorStats(self.predictor.name, self.predictor.fallback_reason),
            devices=tuple(device_stats(w.device, w.pool.stats(), w.scheduler, w.swap, w.elastic) for w in self.workers),
            buckets=(BucketStats(tuple(buckets.bounds), buckets.large_bound, buckets.version)
                     if buckets is not None else None),
            waiting=self.num_waiting, steps=self.steps, busy_seconds=self.busy_seconds,
            decode_tokens=self.decode_tokens, prefill_tokens=self.prefill_tokens, prompt_copies=self.forks.copied,
            prompt_recomputes=self.forks.recomputed, rejected_predictions=self.rejected_predictions,
            probe=ProbeStats.of(self.probe.stats()) if self.probe is not None else None,
            probe_fallback=self.probe_fallback or None,
            tag_batches=ahead.batches if ahead is not None else 0,
            tag_timeouts=ahead.timeouts if ahead is not None else 0,
            tags_waiting=ahead.waiting if ahead is not None else 0)

    def close(self) -> None:
        self.tagger.close()
        if self._device_threads is not None:
            self._device_threads.shutdown(wait=True)
        if self.length_log is not None:
            self.length_log.close()
        if self.probe is not None:
            self.probe.close()
