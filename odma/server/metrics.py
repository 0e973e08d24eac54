"""Prometheus metrics: histograms the engine feeds through its hooks, gauges/counters read at scrape time from the
runtime's snapshot (`stats()`: the pools, queues and counters; never stale, nothing to keep between scrapes)."""

from __future__ import annotations

import json

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from odma.engine.sequence import Sequence
from odma.engine.stats import EngineStats
from odma.server.served_engine import ServedRuntime

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    """One registry per server. Implements the engine's metrics hooks (on_predict / on_first_token / on_finish)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram("odma_ttft_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("odma_tpot_seconds", "Time per output token after the first",
                              buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
                              registry=self.registry)
        self.predict = Histogram("odma_predictor_latency_seconds", "Length predictor latency per batch call",
                                 buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
                                 registry=self.registry)
        self.finished: dict[str, int] = {}
        self.generated_tokens = 0
        self.http_refusals: dict[str, int] = {}  # reason -> count (queue_full, too_large, invalid)

    # -- engine hooks ----------------------------------------------------------------------------

    def on_predict(self, seconds: float, n: int) -> None:
        self.predict.observe(seconds)

    def on_first_token(self, seq: Sequence, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_finish(self, seq: Sequence) -> None:
        self.finished[seq.finish_reason or "unknown"] = self.finished.get(seq.finish_reason or "unknown", 0) + 1
        self.generated_tokens += seq.num_generated
        if seq.first_token_at is not None and seq.finished_at is not None and seq.num_generated > 1:
            self.tpot.observe((seq.finished_at - seq.first_token_at) / (seq.num_generated - 1))

    def refused(self, reason: str) -> None:
        self.http_refusals[reason] = self.http_refusals.get(reason, 0) + 1

    def attach(self, runtime: ServedRuntime) -> None:
        self.registry.register(_EngineCollector(runtime, self))


def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc)
    g.add_metric([], value)
    return g


def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc)
    c.add_metric([], value)
    return c


def labelled(family, name: str, doc: str, label: str, values: dict):
    m = family(name, doc, labels=[label])
    for key, value in values.items():
        m.add_metric([str(key)], value)
    return m


def predictor_info(pred) -> GaugeMetricFamily:
    """Which length predictor serves (`name`), and whether it stands in for one that could not be loaded
    (`fallback_reason` says why): a `LoadedPredictor`, or a snapshot's `PredictorStats`."""
    info = GaugeMetricFamily("odma_predictor_info", "The length predictor in use (fallback=1: the one asked for "
                             "could not be loaded; reason says why)", labels=["name", "fallback", "reason"])
    info.add_metric([pred.name, "1" if pred.fallback_reason else "0", (pred.fallback_reason or "")[:200]], 1)
    return info


class _EngineCollector:
    """Reads the runtime's snapshot (`stats()`) at scrape time; each method below yields one group of metrics."""

    def __init__(self, runtime: ServedRuntime, metrics: Metrics) -> None:
        self.runtime, self.metrics = runtime, metrics

    def collect(self):
        stats = self.runtime.stats()
        yield from self._queue(stats, self.runtime.waiting)
        yield from self._kv(stats)
        yield from self._devices(stats)
        yield from self._buckets(stats)
        yield from self._growth(stats)
        yield from self._preemption(stats)
        yield from self._ballooning(stats)
        yield from self._work(stats)
        yield from self._requests()
        yield predictor_info(stats.predictor)
        yield from self._probe(stats)
        yield labelled(GaugeMetricFamily, "odma_policy_info", "The reservation policy in use", "policy",
                       {stats.policy: 1})

    @staticmethod
    def _probe(stats: EngineStats):
        """The served model's length probe: which head serves (shipped / online), its work, its cost, the online
        window and the calibration in force; a probe that was asked for and refused is reported with the reason."""
        probe = stats.probe
        if probe is None:
            if stats.probe_fallback:
                info = GaugeMetricFamily("odma_probe_info", "The length probe in use (refused: why)",
                                         labels=["source", "reason"])
                info.add_metric(["refused", stats.probe_fallback[:200]], 1)
                yield info
            return
        info = GaugeMetricFamily("odma_probe_info", "The length probe in use: shipped heads or the online refit, and "
                                 "the calibration in force", labels=["source", "reason", "calibration"])
        info.add_metric([probe.source, "", json.dumps(probe.calibration) if probe.calibration else ""], 1)
        yield info
        yield counter("odma_probe_predictions", "Prompt-end predictions from the served model's states", probe.predicted)
        yield counter("odma_probe_refinements", "Decode-time refinements of the remaining length", probe.refined)
        yield counter("odma_probe_failures", "Probe calls that raised (the requests kept their tags)", probe.failures)
        yield counter("odma_probe_seconds", "Time inside the probe (predict, refine, learn)", probe.seconds)
        if probe.online_samples is not None:
            yield gauge("odma_probe_online_samples", "Finished requests in the online window", probe.online_samples)
            yield counter("odma_probe_online_refits", "Online refits of the probe's head", probe.online_refits)

    @staticmethod
    def _queue(stats: EngineStats, waiting: int):
        # the door's count, which --max-queue bounds: it includes requests still being tokenized, which the engine
        # has not seen yet, and leaves out preempted ones waiting to run again (odma_device_waiting_requests has them)
        yield gauge("odma_queue_depth", "Requests (samples) admitted and not running yet", waiting)
        yield gauge("odma_running_requests", "Requests holding a block", stats.running)

    @staticmethod
    def _kv(stats: EngineStats):
        yield gauge("odma_kv_budget_bytes", "KV pool size", stats.total("budget_bytes"))
        yield gauge("odma_kv_reserved_bytes", "KV bytes reserved by live blocks", stats.total("reserved_bytes"))
        yield gauge("odma_kv_live_bytes", "KV bytes holding tokens", stats.total("live_bytes"))
        yield gauge("odma_kv_free_bytes", "KV bytes free (extents and cached blocks)", stats.total("free_bytes"))
        yield gauge("odma_kv_external_fragmentation",
                    "1 - the largest block a reservation could get / what free memory would give as one range "
                    "(cached blocks coalesced with free neighbours; the worst device)",
                    stats.external_fragmentation)
        yield labelled(GaugeMetricFamily, "odma_bucket_live_blocks", "Live blocks per bucket (-1 = large)", "bucket",
                       stats.live_blocks_per_bucket)

    @staticmethod
    def _devices(stats: EngineStats):
        device_gauges = {
            "odma_device_running_requests": ("Requests holding a block, per device", "running"),
            "odma_device_waiting_requests": ("Requests placed on the device and waiting", "waiting"),
            "odma_device_kv_reserved_bytes": ("KV bytes reserved by live blocks, per device", "reserved_bytes"),
            "odma_device_kv_live_bytes": ("KV bytes holding tokens, per device", "live_bytes"),
        }
        for name, (doc, field) in device_gauges.items():
            yield labelled(GaugeMetricFamily, name, doc, "device", {d.device: getattr(d, field) for d in stats.devices})

    @staticmethod
    def _buckets(stats: EngineStats):
        buckets = stats.buckets
        if buckets is None:
            return
        bounds = {i: b for i, b in enumerate(buckets.bounds)}
        bounds[-1] = buckets.large_bound
        yield labelled(GaugeMetricFamily, "odma_bucket_bound_tokens", "Output tokens each bucket reserves", "bucket", bounds)
        yield gauge("odma_bucket_bounds_version", "Bucket bound refreshes that changed the bounds", buckets.version)

    @staticmethod
    def _growth(stats: EngineStats):
        pool, sched = stats.pool_counter, stats.scheduler_counter
        yield counter("odma_migrations", "Blocks moved to a larger range mid-decode", pool("migrations"))
        yield counter("odma_migrated_tokens", "Tokens copied by migrations", pool("migrated_tokens"))
        yield counter("odma_migration_refusals", "Growths refused for lack of room", pool("migration_refusals"))
        yield counter("odma_grown_in_place", "Growths where the block lies: over the free units after it (counted in "
                      "migrations too) or, with --kv-growth map, by mapping memory behind it (nothing copied)",
                      pool("grown_in_place"))
        yield counter("odma_continued_blocks", "Growths that went on in a new block, the rows so far read where they "
                      "lie (--continue-growth)", pool("continued"))
        yield counter("odma_reservation_refusals", "Reservations refused for lack of room (request waited)",
                      pool("refusals"))
        yield counter("odma_theta_refusals", "Admissions deferred to keep reservations within theta (eLLM Alg. 1)",
                      sched("theta_refusals"))
        yield counter("odma_demand_refusals", "Admissions deferred: the running requests' predicted final KV would pass "
                      "--admission-demand of the pool", sched("demand_refusals"))
        yield counter("odma_window_clears", "Held queue heads admitted by relocating the blocks in their way",
                      sched("window_clears"))
        yield counter("odma_window_moves", "Blocks relocated to clear those windows", sched("window_moves"))
        yield counter("odma_prefix_copies", "Admissions that copied a shared prompt prefix's K/V from a running request",
                      sched("prefix_copies"))
        yield counter("odma_prefix_maps", "Admissions that mapped a running request's pages of a shared prompt prefix "
                      "(policy paged) or read its rows in place (--prefix-reads)", sched("prefix_maps"))
        yield counter("odma_prefix_copied_tokens", "Prompt tokens not computed thanks to those copies or maps",
                      sched("prefix_tokens"))
        yield counter("odma_prefix_holds", "Admissions put off one step to copy a prefix prefilled in that step",
                      sched("prefix_holds"))

    @staticmethod
    def _preemption(stats: EngineStats):
        sched = stats.scheduler_counter
        yield counter("odma_preemptions", "Requests freed under pressure and recomputed later", sched("preemptions"))
        yield counter("odma_stalls", "Request-steps spent waiting for room to grow", sched("stalls"))
        yield counter("odma_swap_outs", "Preempted requests whose K/V went to the host buffer", sched("swap_outs"))
        yield counter("odma_swap_ins", "Swapped requests whose K/V came back", sched("swap_ins"))
        if stats.swapping:
            yield gauge("odma_swap_held_bytes", "K/V bytes in the host buffers now", stats.total("swap_held_bytes"))
            yield gauge("odma_swap_buffer_bytes", "Logical size of the host buffers (eLLM Alg. 2 scales them)",
                        stats.total("swap_buffer_bytes"))

    @staticmethod
    def _ballooning(stats: EngineStats):
        yield counter("odma_activation_refusals", "Prefills deferred until their activation room was freed",
                      stats.scheduler_counter("activation_refusals"))
        yield counter("odma_prefill_chunks", "Prefill steps that fed part of a prompt (its activation room was lent)",
                      stats.scheduler_counter("prefill_chunks"))
        if not stats.ballooning:
            return
        e = stats.balloon_total
        yield gauge("odma_balloon_reserve_bytes", "Activation room kept for a max_prefill_tokens prefill", e("reserve_bytes"))
        yield gauge("odma_balloon_lent_bytes", "Activation room lent to the KV pool now", e("lent_bytes"))
        yield counter("odma_balloon_inflations", "Segments lent to the KV pool", e("balloon_inflations"))
        yield counter("odma_balloon_deflations", "Segments taken back for a prefill", e("balloon_deflations"))
        yield counter("odma_balloon_rollbacks", "Deflations rolled back (a block had nowhere to go)",
                      e("balloon_deflate_rollbacks"))
        yield counter("odma_balloon_moved_bytes", "Live KV bytes copied out of deflated segments", e("balloon_moved_bytes"))

    @staticmethod
    def _work(stats: EngineStats):
        yield counter("odma_engine_steps", "Model steps run", stats.steps)
        yield counter("odma_engine_busy_seconds", "Seconds spent inside model steps", stats.busy_seconds)
        yield counter("odma_engine_decode_tokens", "Decode tokens computed (Σ decode batch sizes)", stats.decode_tokens)
        yield counter("odma_engine_prefill_tokens", "Prompt tokens computed, recomputations included", stats.prefill_tokens)
        yield counter("odma_prompt_copies", "Samples of n > 1 requests that copied the prompt's K/V", stats.prompt_copies)
        yield counter("odma_prompt_recomputes", "Samples of n > 1 requests that prefilled the prompt themselves "
                      "(no sibling held it any more)", stats.prompt_recomputes)
        yield counter("odma_rejected_predictions", "Predictions that were not finite or negative (the request "
                      "reserved for the worst case)", stats.rejected_predictions)
        yield counter("odma_tag_batches", "Length predictor calls made off the engine loop (--tagging ahead)",
                      stats.tag_batches)
        yield counter("odma_tag_timeouts", "Requests that went on untagged because their length prediction came back "
                      "after --tag-timeout", stats.tag_timeouts)
        yield gauge("odma_tags_waiting", "Requests waiting for their length prediction (--tagging ahead)",
                    stats.tags_waiting)

    def _requests(self):
        m = self.metrics
        yield counter("odma_generated_tokens", "Output tokens of finished requests", m.generated_tokens)
        yield labelled(CounterMetricFamily, "odma_requests_finished", "Finished requests by reason", "reason",
                       dict(sorted(m.finished.items())))
        yield labelled(CounterMetricFamily, "odma_http_refusals", "Requests refused at the door", "reason",
                       dict(sorted(m.http_refusals.items())))
