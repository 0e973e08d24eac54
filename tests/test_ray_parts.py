"""The parts of odma on Ray Serve that need no Ray: the router's score (largest free range, queue, starvation
guard), the cluster's shared window and bounds, a follower bucket manager, the merged /metrics, the events on the
wire, the ingress's validation and sizing, and the engine keeping a prediction made upstream."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from odma.config import BucketConfig, PoolConfig
from odma.engine import EngineConfig, SamplingParams
from odma.engine.logprobs import TokenLogprob
from odma.engine.sequence import RequestTags, Sequence
from odma.engine.testing import tiny_engine
from odma.errors import ConfigError, InvalidRequestError, RequestTooLargeError
from odma.kv import BucketManager, KVRequest
from odma.models.config import ModelConfig
from odma.models.tiny import make_tiny_model
from odma.server.metrics import Metrics
from odma.serve_ray.cluster import ClusterState, log_files, replica_log
from odma.serve_ray.front import ClusterView, FrontEngine
from odma.serve_ray.merge_metrics import merge_texts
from odma.server.wire import EventEncoder, SampleView
from odma.serve_ray.scoring import (Candidate, HoldBook, ReplicaLoad, Sent, load_of, pending_after, rank_replicas,
                                    route)
from odma.serve_ray.settings import RaySettings

torch.set_num_threads(1)


def load(**kw) -> ReplicaLoad:
    base = dict(capacity_tokens=4096, reserved_tokens=0, live_tokens=0, largest_free_tokens=4096, queued_tokens=0,
                queued_prompts=0, running=0, waiting=0, max_num_seqs=64, max_request_tokens=4096, at=100.0)
    return ReplicaLoad(**{**base, **kw})


# -- the router's score ------------------------------------------------------------------------------


def test_a_request_goes_where_one_block_fits_not_where_most_bytes_are_free():
    # A has more free memory but in pieces (largest range 256); B less, but in one range of 1024
    a = Candidate("a", load(reserved_tokens=1024, largest_free_tokens=256))
    b = Candidate("b", load(reserved_tokens=3072, largest_free_tokens=1024))
    fitting, others = rank_replicas([a, b], need=512)
    assert fitting == ["b"] and others == ["a"]
    # a small request fits both: the lower placement score (less reserved) wins
    fitting, _ = rank_replicas([a, b], need=128)
    assert fitting == ["a", "b"]


def test_the_queue_and_recent_sends_count_against_the_free_range():
    queued = Candidate("a", load(largest_free_tokens=1024, queued_tokens=800))  # its queue takes 800 first
    sent = Candidate("b", load(largest_free_tokens=1024), (Sent(700, 10, 101.0),))  # we sent 700 since its report
    idle = Candidate("c", load(largest_free_tokens=600, reserved_tokens=3496))
    fitting, others = rank_replicas([queued, sent, idle], need=500)
    assert fitting == ["c"] and set(others) == {"a", "b"}


def test_a_full_batch_does_not_fit_and_an_unreported_replica_is_taken_as_idle():
    full = Candidate("a", load(running=64, max_num_seqs=64))
    new = Candidate("b", None)
    fitting, others = rank_replicas([full, new], need=100)
    assert fitting == ["b"] and others == ["a"]


def test_without_room_anywhere_a_replica_with_an_empty_queue_takes_it_else_the_router_holds_it():
    waiting = Candidate("a", load(largest_free_tokens=900, waiting=2))
    empty = Candidate("b", load(largest_free_tokens=100))
    sent = Candidate("c", load(largest_free_tokens=500), (Sent(10, 1, 101.0),))  # something sent there since
    assert route([waiting, empty, sent], need=1000) == ["b"]
    assert route([waiting, sent], need=1000) == []  # every replica has someone waiting: hold it here
    assert sorted(route([waiting, empty], need=50)) == ["a", "b"]  # where it fits, a queue does not bar it


def test_compute_load_breaks_ties_between_equal_memory():
    busy = Candidate("a", load(live_tokens=3000, reserved_tokens=1000))
    calm = Candidate("b", load(live_tokens=100, reserved_tokens=1000))
    assert rank_replicas([busy, calm], need=64)[0] == ["b", "a"]


def test_sends_before_a_report_are_in_it_and_later_ones_are_not():
    report = load(at=100.0)
    sent = [Sent(10, 1, 90.0), Sent(20, 1, 99.99), Sent(30, 1, 101.0)]
    assert [s.need for s in pending_after(sent, report)] == [20, 30]  # 99.99: may not have arrived (transit)
    assert len(pending_after(sent, None)) == 3  # no report yet: all of them count


def test_the_starvation_guard_releases_a_request_overtaken_max_skips_times():
    book = HoldBook(max_skips=3, max_hold_s=60)
    book.hold("big", created_at=1.0, now=10.0)
    for i in range(2):
        book.routed(f"small{i}", created_at=2.0 + i, now=10.0)
        assert not book.overdue("big", now=10.0)
    book.routed("older", created_at=0.5, now=10.0)  # an older request does not overtake it
    assert not book.overdue("big", now=10.0)
    book.routed("small3", created_at=5.0, now=10.0)
    assert book.overdue("big", now=10.0)
    book.release("big")
    assert book.released == 1 and len(book) == 0


def test_the_starvation_guard_releases_a_request_held_too_long():
    book = HoldBook(max_skips=8, max_hold_s=2.0)
    assert book.hold("r", created_at=1.0, now=10.0) and not book.hold("r", created_at=1.0, now=10.5)
    assert not book.overdue("r", now=11.9) and book.overdue("r", now=12.0)


def test_replica_load_survives_the_routing_stats_round_trip():
    l = load(bounds_version=3)
    assert ReplicaLoad.from_dict(l.as_dict()) == l
    assert ReplicaLoad.from_dict({}) is None and ReplicaLoad.from_dict({"at": 1.0}) is None


def test_a_replicas_typical_need_is_the_mean_first_reservation_of_what_it_holds(folder):
    engine = tiny_engine(folder, kv_budget="4MiB", max_tokens_cap=256)
    sched = engine.workers[0].scheduler
    idle = load_of([sched], waiting=0, max_num_seqs=8, max_request_tokens=1024, at=1.0)
    assert idle.typical_need_tokens == 0
    for i, n in enumerate((8, 40, 72)):
        engine.add_request([1] * n, SamplingParams(max_tokens=64), request_id=f"r{i}")
    engine.step()
    seqs = list(sched.running) + list(sched.waiting)
    busy = load_of([sched], waiting=len(sched.waiting), max_num_seqs=8, max_request_tokens=1024, at=2.0)
    firsts = [sched.kv.initial_tokens(q) for q in seqs]
    assert len(seqs) == 3 and len(set(firsts)) > 1  # the prompts differ, so do their first reservations
    assert busy.typical_need_tokens == round(sum(firsts) / 3)


def test_a_request_the_router_cannot_read_takes_the_largest_typical_need():
    from odma.serve_ray.scoring import typical_need

    assert typical_need([load(typical_need_tokens=300), None, load(typical_need_tokens=700)]) == 700
    assert typical_need([load(), None]) == 0 and typical_need([]) == 0  # idle or unreported: nothing assumed


def test_settings_refuse_unknown_choices():
    with pytest.raises(ConfigError):
        RaySettings(router="random")
    with pytest.raises(ConfigError):
        RaySettings(predict_at="both")
    with pytest.raises(ConfigError):
        RaySettings(max_hold_s=-1)
    with pytest.raises(ConfigError):
        RaySettings(ingress="proxy")
    assert RaySettings(max_hold_s=0).max_hold_s == 0  # 0: the router never holds


# -- shared bounds ----------------------------------------------------------------------------------


def shared_config() -> BucketConfig:
    return BucketConfig(min_samples=16, refresh_every_n=16, large_bound=512)


def test_lengths_from_every_replica_feed_one_window_and_one_set_of_bounds():
    state = ClusterState(shared_config())
    start = state.join("r0")["bounds"]
    state.report("r0", [10] * 8)
    state.report("r1", [400] * 7)
    assert state.buckets.bounds == tuple(start)  # 15 lengths: below min_samples
    got = state.report("r1", [400])  # the 16th, from another replica
    assert got["bounds"] != start and got["bounds"] == list(state.buckets.bounds)
    assert 16 in got["bounds"] and 400 in got["bounds"]  # both replicas' lengths shaped them
    assert got["median"] == 205 and state.lengths_seen == 16
    assert state.join("r2")["bounds"] == got["bounds"]  # a replica that (re)starts gets the current bounds


def test_a_report_with_bad_lengths_keeps_the_good_ones():
    state = ClusterState(shared_config())
    state.report("r0", [5, -1, "x", 7.5, 9])
    assert state.lengths_seen == 2


def test_a_silent_replica_drops_out_of_the_snapshot():
    state = ClusterState(shared_config(), report_period_s=0.01)
    state.report("r0", [], load().as_dict(), "text")
    assert set(state.snapshot(with_metrics=True)["replicas"]) == {"r0"}
    time.sleep(0.15)
    snap = state.snapshot(with_metrics=True)
    assert snap["replicas"] == {} and snap["metrics"] == {}


def test_a_replica_that_serves_http_gets_the_others_metrics_with_its_bounds():
    state = ClusterState(shared_config())
    assert "metrics" not in state.report("r0", [], load().as_dict(), "r0 text")  # only when asked
    got = state.report("r1", [], load().as_dict(), "r1 text", others_metrics=True)
    assert got["metrics"] == {"r0": "r0 text"} and got["bounds"] == list(state.buckets.bounds)


def test_static_policies_share_no_bounds():
    state = ClusterState(None)
    assert state.report("r0", [3, 4])["bounds"] is None and state.snapshot()["median"] == 3.5


def test_a_follower_takes_bounds_only_from_install():
    follower = BucketManager(shared_config())
    follower.follow()
    for x in range(100):
        follower.observe(x)
    assert not follower.refresh_due()
    before = follower.version
    assert follower.install([16, 64, 512]) and follower.bounds == (16, 64, 512) and follower.version == before + 1
    assert not follower.install([16, 64, 512]) and follower.version == before + 1
    for bad in ([], [64, 16], [0, 16], [16, 16], [16, 1024]):
        with pytest.raises(ConfigError):
            follower.install(bad)
    assert follower.bounds == (16, 64, 512)


def test_replica_logs_sit_beside_the_length_log(tmp_path):
    base = tmp_path / "lengths.jsonl"
    assert replica_log(base, 3) == tmp_path / "lengths.replica3.jsonl" and replica_log(None, 0) is None
    for p in (base, replica_log(base, 0), replica_log(base, 1), tmp_path / "other.jsonl"):
        p.write_text("")
    assert log_files(base) == [base, replica_log(base, 0), replica_log(base, 1)]


# -- one /metrics -----------------------------------------------------------------------------------


def replica_text(ttft: list[float], finished: int, bound: int, fragmentation: float) -> str:
    m = Metrics()
    for t in ttft:
        m.ttft.observe(t)
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class Extra:
        def collect(self):
            c = CounterMetricFamily("odma_requests_finished", "Finished", labels=["reason"])
            c.add_metric(["stop"], finished)
            yield c
            b = GaugeMetricFamily("odma_bucket_bound_tokens", "Bounds", labels=["bucket"])
            b.add_metric(["0"], bound)
            yield b
            f = GaugeMetricFamily("odma_kv_external_fragmentation", "Frag")
            f.add_metric([], fragmentation)
            yield f
            d = GaugeMetricFamily("odma_device_running_requests", "Per device", labels=["device"])
            d.add_metric(["cpu"], finished)
            yield d

    m.registry.register(Extra())
    return generate_latest(m.registry).decode()


def test_replica_metrics_merge_under_the_same_names():
    fams = merge_texts({"r0": replica_text([0.1, 0.3], 2, 64, 0.2), "r1": replica_text([2.0], 5, 64, 0.6)})
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams for s in f.samples}
    assert samples[("odma_requests_finished_total", (("reason", "stop"),))] == 7
    assert samples[("odma_ttft_seconds_count", ())] == 3
    assert samples[("odma_ttft_seconds_bucket", (("le", "0.5"),))] == 2
    assert samples[("odma_ttft_seconds_sum", ())] == pytest.approx(2.4)
    assert samples[("odma_bucket_bound_tokens", (("bucket", "0"),))] == 64  # shared, not summed
    assert samples[("odma_kv_external_fragmentation", ())] == 0.6  # the worst replica
    assert samples[("odma_device_running_requests", (("device", "cpu"), ("replica", "r0")))] == 2
    assert not any(name.endswith("_created") for name, _ in samples)


def test_merged_metrics_are_valid_exposition():
    from prometheus_client import CollectorRegistry

    fams = merge_texts({"r0": replica_text([0.1], 1, 64, 0.0), "r1": replica_text([0.2], 1, 64, 0.0)})
    registry = CollectorRegistry()
    registry.register(type("Merged", (), {"collect": lambda self: iter(fams)})())
    names = [f.name for f in text_string_to_metric_families(generate_latest(registry).decode())]
    assert len(names) == len(set(names)) and "odma_ttft_seconds" in names


# -- events on the wire -----------------------------------------------------------------------------


def test_logprobs_and_the_prompts_scores_cross_once_and_arrive_whole():
    seq = Sequence("req-1", [5, 6, 7], SamplingParams(max_tokens=4, logprobs=1, prompt_logprobs=1))
    encoder, view = EventEncoder(), SampleView("req-1", 0)
    seq.prompt_logprobs = [None, TokenLogprob(6, -1.0, ((6, -1.0),)), TokenLogprob(7, -2.0, ((7, -2.0),))]
    wire = []
    for i, tok in enumerate([11, 12, 13]):
        seq.output_ids.append(tok)
        seq.output_logprobs = (seq.output_logprobs or []) + [TokenLogprob(tok, -0.5 * i, ((tok, -0.5 * i),))]
        finished = i == 2
        seq.finish_reason = "length" if finished else None
        wire.append(encoder.encode(tok, finished, seq))
    assert wire[0][7] is not None and wire[1][7] is None and wire[2][7] is None  # prompt scores once
    assert [len(w[6]) for w in wire] == [1, 1, 1]  # each entry once
    assert [view.apply(w) for w in wire] == [(11, False), (12, False), (13, True)]
    assert view.output_logprobs == seq.output_logprobs and view.prompt_logprobs == seq.prompt_logprobs
    assert view.num_generated == 3 and view.finish_reason == "length" and view.finished


# -- the ingress ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


def test_the_ingress_refuses_what_a_replica_would(folder):
    engine = tiny_engine(folder, kv_budget="1MiB", max_tokens_cap=512)
    view = ClusterView(engine.config)
    view.apply({"replicas": {"r0": load(max_request_tokens=engine.max_request_tokens).as_dict()}})
    front = FrontEngine(engine.config, None, ModelConfig.from_folder(folder), view)
    too_long = [1] * (engine.max_request_tokens - 8)
    cases = [([], SamplingParams(max_tokens=4)), ([1, 2], SamplingParams(max_tokens=513)),
             ([10 ** 6], SamplingParams(max_tokens=4)), (too_long, SamplingParams(max_tokens=64))]
    for ids, params in cases:
        errors = []
        for e in (engine, front):
            with pytest.raises((InvalidRequestError, RequestTooLargeError)) as info:
                e.validate(ids, params)
            errors.append((type(info.value), str(info.value)))
        assert errors[0] == errors[1]
    front.validate([1, 2, 3], SamplingParams(max_tokens=8))  # and accepts what it accepts


def test_the_ingress_and_the_engine_open_the_same_door_to_the_app(folder):
    from odma.server.served_engine import ServedEngine

    engine = tiny_engine(folder, kv_budget="1MiB")
    front = FrontEngine(engine.config, None, ModelConfig.from_folder(folder), ClusterView(engine.config))
    assert isinstance(engine, ServedEngine) and isinstance(front, ServedEngine)  # every member, data ones too
    for name in ("vocab_size", "eos_ids", "max_model_len"):
        assert getattr(front, name) == getattr(engine, name), name
    assert front.decode([5, 6, *engine.eos_ids]) == engine.decode([5, 6]) == ""  # no tokenizer here: ids only


def test_the_ingress_sizes_a_request_as_the_replicas_policy_reserves_it(folder):
    engine = tiny_engine(folder, buckets=shared_config(), max_tokens_cap=512)
    view = ClusterView(engine.config)
    view.apply({"bounds": [16, 48, 128, 512], "version": 1, "median": 40})
    engine.policy.buckets.install([16, 48, 128, 512])
    for predicted, prompt in ((10.0, 7), (90.0, 30), (None, 5)):
        req = KVRequest("x", prompt, 256, predicted, 0.0)
        aligned = -(-engine.policy.initial_tokens(req) // 16) * 16
        assert view.need(prompt, 256, None if predicted is None else (predicted, 0.0), 1) == aligned
    assert view.need(7, 256, (10.0, 0.0), 3) == 3 * view.need(7, 256, (10.0, 0.0), 1)  # n blocks


def test_the_engine_keeps_a_prediction_made_upstream(folder):
    class Counting:
        name = "counting"
        calls = 0

        def predict(self, requests):
            Counting.calls += len(requests)
            return [(7.0, 0.1) for _ in requests]

    from odma.engine.length_predictor import LoadedPredictor

    engine = tiny_engine(folder)
    engine.predictor = LoadedPredictor(Counting(), "counting", None)
    given = engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True),
                               tags=RequestTags(prediction=(42.0, 0.3)))
    own = engine.add_request([4, 5, 6], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    assert (given.predicted_length, given.uncertainty) == (42.0, 0.3) and given.bucket is not None
    assert own.predicted_length == 7.0 and Counting.calls == 1  # only the request without one was predicted
    while not (given.finished and own.finished):
        engine.step()


# -- without Ray ---------------------------------------------------------------------------------------

NO_RAY = "import sys; sys.modules['ray'] = None  # as if Ray were not installed\n"


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_single_process_odma_serve_never_imports_ray():
    code = ("import sys\n"
            "import odma.server.cli, odma.server.app, odma.serve_ray, odma.serve_ray.front, odma.serve_ray.replica\n"
            "import odma.serve_ray.cluster, odma.serve_ray.app\n"
            "odma.server.cli.build_parser().parse_args([])\n"
            "assert not [m for m in sys.modules if m == 'ray' or m.startswith('ray.')], 'ray was imported'\n")
    done = run_python(code)
    assert done.returncode == 0, done.stderr


def test_odma_serve_ray_without_ray_says_what_to_install():
    done = run_python(NO_RAY + "from odma.server.cli import main\n"
                      "sys.exit(main(['--ray', '--model', 'no-such-model', '--log-level', 'error']))\n")
    assert done.returncode == 2, done.stderr
    assert "--ray needs Ray Serve: pip install 'odma[ray]'" in done.stderr and "Traceback" not in done.stderr


def test_odma_serve_ray_stops_on_a_burst_of_signals_and_gives_ctrl_c_back():
    """A wrapper (timeout, a shell) forwards Ctrl-C while the user's own arrives too: the wait must end, not
    deadlock in its own handler (it did, with a threading.Event), and a second Ctrl-C must reach the teardown."""
    code = ("import signal, sys\n"
            "from odma.serve_ray.app import wait_for_stop_signal\n"
            "got = wait_for_stop_signal(poll_s=0.5, on_ready=lambda: print('waiting', flush=True))\n"
            "print('stopped', got, signal.getsignal(signal.SIGINT) is signal.default_int_handler, flush=True)\n")
    # as from an interactive shell: a shell's background job (pytest run with `&`) starts with SIGINT ignored, and
    # Python then keeps it ignored instead of installing its default handler
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline().strip() == "waiting"
        for _ in range(300):  # back to back: the old handler deadlocked in about one run of six like this
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert f"stopped {int(signal.SIGINT)} True" in out, err


def test_the_ray_bench_gives_its_single_server_every_option_odma_bench_serve_does():
    """odma-bench ray starts its `single` server with odma-bench serve's helper: every option that helper reads
    must be in odma-bench ray's arguments (main added --schedule: the single mode crashed on it)."""
    import argparse
    import inspect
    import re

    from odma.bench import ray_bench, serve_bench

    p = argparse.ArgumentParser()
    ray_bench.add_arguments(p)
    args = ray_bench._server_args(p.parse_args([]), "64MiB")
    read = set(re.findall(r"args\.(\w+)", inspect.getsource(serve_bench._server_process)))
    assert read and read <= set(vars(args)), sorted(read - set(vars(args)))
    config = ray_bench._engine_config(p.parse_args(["--schedule", "sjf", "--growth-hint", "pred"]), "64MiB")
    # the replicas get the same options
    assert config.schedule == "sjf" and config.kv_budget == "64MiB" and config.pool.growth_hint == "pred"


def test_odma_serve_ray_flags_reach_the_settings():
    from odma.server.cli import build_parser, ray_settings_from_args

    default = ray_settings_from_args(build_parser().parse_args(["--ray"]))
    assert default.max_hold_s == 0 and default.router == "odma" and default.predict_at == "front"
    set_ = ray_settings_from_args(build_parser().parse_args(
        ["--ray", "--replicas", "3", "--router", "pow2", "--predict-at", "replica", "--router-max-hold-s", "5",
         "--threads", "2", "--max-queue", "9", "--ray-ingress", "engines"]))
    assert (set_.replicas, set_.router, set_.predict_at, set_.max_hold_s, set_.replica_cpus, set_.max_queue,
            set_.ingress) == (3, "pow2", "replica", 5.0, 2.0, 9, "engines")
    assert default.ingress == "front"


def test_the_ray_bench_can_drive_guidellm_and_compares_its_points():
    """`odma-bench ray --guidellm` calls the peer bench's guidellm driver with its own arguments: every option
    that driver reads must exist there; its ratios pair the points by concurrency."""
    import argparse
    import inspect
    import re

    from odma.bench import peer_bench, ray_bench

    p = argparse.ArgumentParser()
    ray_bench.add_arguments(p)
    args = p.parse_args(["--guidellm", "4:16,16:64"])
    read = set(re.findall(r"args\.(\w+)", inspect.getsource(peer_bench.guidellm_point)))
    assert read and read <= set(vars(args)), sorted(read - set(vars(args)))
    assert peer_bench.sweep(args.guidellm) == [(4, 16), (16, 64)]
    point = lambda streams, tps: {"streams": streams, "output_tps": tps}  # noqa: E731
    base = {"throughput_tps": 10.0, "ttft_p99_s": 1.0, "ttft_p50_s": 0.5}
    rounds = [{"odma": {**base, "guidellm": [point(4, 30.0), point(16, 60.0)]},
               "pow2": {**base, "guidellm": [point(4, 20.0), point(16, 40.0)]}}]
    ratios = ray_bench._ratios(rounds)["odma/pow2"]
    assert ratios["guidellm_output_tps"] == {"4": [1.5], "16": [1.5]} and ratios["throughput"] == [1.0]


def test_the_peer_bench_reads_both_servers_prefix_reuse_and_gives_each_concurrency_its_own_prompts(tmp_path):
    """vLLM's prefix-cache counters and odma's copied-prefix counters are read from /metrics; each guidellm point
    draws its own prompts (a shared seed re-sent earlier points' prompts, which vLLM then served from cache)."""
    import argparse

    from odma.bench import peer_bench

    text = ('vllm:prefix_cache_hits_total{engine="0",model_name="m"} 11264.0\n'
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 40063.0\n'
            "odma_prefix_copied_tokens_total 24.0\nodma_engine_prefill_tokens_total 1000.0\n")
    assert peer_bench._server_counters(text) == {"prefix_cache_hits": 11264.0, "prefix_cache_queries": 40063.0,
                                                 "odma_prefix_copied_tokens": 24.0, "odma_engine_prefill_tokens": 1000.0}
    fake = tmp_path / "bin" / "guidellm"  # a guidellm that fails at once: the point reports its command
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
    args = argparse.Namespace(shape="128/128", seed=5, stage_timeout=30)
    points = [peer_bench.guidellm_point("http://127.0.0.1:9", "x", streams, 4, tmp_path, fake.parent / "python",
                                        tmp_path, args) for streams in (1, 4)]
    assert [p["seed"] for p in points] == [6, 9] and all("exited with 3" in p["error"] for p in points)
    assert "kind=static,value=9" in points[1]["command"]


def test_a_port_for_a_late_binding_server_lies_below_the_ephemeral_range():
    import socket

    from odma.server.threaded import _ephemeral_low, free_port

    for _ in range(5):
        port = free_port(below_ephemeral=True)
        assert 1024 <= port < _ephemeral_low()
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free, as promised


# -- a replica that dies under a request -------------------------------------------------------------


class _Call:
    """One streaming call to the engine deployment as the ingress sees it: batches of wire events, and the
    replica's process dying after `dies_after` of them (None: never)."""

    def __init__(self, batches: list, dies_after: int | None = None) -> None:
        self.batches, self.dies_after = batches, dies_after

    def __aiter__(self):
        return self._events()

    async def _events(self):
        from ray.exceptions import ActorDiedError

        for i, batch in enumerate(self.batches + [None]):
            if i == self.dies_after:
                raise ActorDiedError()
            if batch is not None:
                yield batch

    def cancel(self) -> None:
        pass


class _Engines:
    """The engine deployment's handle: each call takes the next scripted `_Call` and records the job."""

    def __init__(self, calls: list[_Call]) -> None:
        self.calls, self.jobs = calls, []

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, job):
        self.jobs.append(job)
        return self.calls.pop(0)


def _answer(tokens: list[int]) -> list:
    last = len(tokens) - 1
    return [[(0, t, i == last, "length" if i == last else None, None, i + 1, None, None)] for i, t in enumerate(tokens)]


def _run_on(folder, calls: list[_Call]):
    """((token, finished) per event, (finish_reason, error)), the runtime and the deployment handle after one
    request over scripted calls."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'odma[ray]')")
    import asyncio

    from odma.serve_ray.front import RemoteRuntime

    engine = tiny_engine(folder, kv_budget="1MiB")
    view = ClusterView(engine.config)
    view.apply({"replicas": {"r0": load(max_request_tokens=engine.max_request_tokens).as_dict(),
                             "r1": load(max_request_tokens=engine.max_request_tokens).as_dict()}})
    front = FrontEngine(engine.config, None, ModelConfig.from_folder(folder), view)
    engines = _Engines(calls)
    runtime = RemoteRuntime(front, engines, None, RaySettings(), None)

    async def one():
        handle = runtime.submit([1, 2, 3], SamplingParams(max_tokens=3))
        events = [e async for e in runtime.events(handle)]  # the sample's view is shared: its end is read last
        return [(e.token, e.finished) for e in events], (events[-1].seq.finish_reason, events[-1].seq.error)

    return asyncio.run(one()), runtime, engines


def test_a_request_whose_replica_dies_before_answering_goes_to_another(folder):
    (events, end), runtime, engines = _run_on(folder, [_Call([], dies_after=0), _Call(_answer([7, 8, 9]))])
    assert events == [(7, False), (8, False), (9, True)] and end == ("length", None)
    assert len(engines.jobs) == 2 and engines.jobs[0] == engines.jobs[1]  # the same job, sent again
    assert runtime.retried == 1 and runtime.failed_streams == 0


def test_a_request_whose_replica_dies_after_answering_fails_with_the_reason(folder):
    # a token reached the client: sending it again would repeat or change what the client already has
    (events, end), runtime, engines = _run_on(folder, [_Call(_answer([7, 8, 9]), dies_after=1), _Call(_answer([5]))])
    assert events == [(7, False), (None, True)]
    assert end[0] == "error" and end[1].startswith("replica failed: ActorDiedError")
    assert len(engines.jobs) == 1 and runtime.retried == 0 and runtime.failed_streams == 1


def test_a_request_is_sent_again_at_most_twice(folder):
    calls = [_Call([], dies_after=0) for _ in range(3)] + [_Call(_answer([5]))]
    (events, end), runtime, engines = _run_on(folder, calls)
    assert events == [(None, True)] and end[0] == "error" and "ActorDiedError" in end[1]
    assert len(engines.jobs) == 3 and runtime.retried == 2 and runtime.failed_streams == 1
