"""odma-serve on a local Ray Serve (CPU, the tiny model, one Ray start for the module): the same answers, errors
and metrics as odma-serve through one endpoint; realized lengths from both replicas feed one window whose bounds
every replica reserves from; a replica killed mid-stream fails its own streams with a clear error, the others
finish, new requests go to the survivor, Ray restarts it and the new replica picks up the shared bounds."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (the optional extra: pip install 'odma[ray]')")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'odma[ray]')")

from odma.config import BucketConfig, PoolConfig  # noqa: E402
from odma.engine import EngineConfig  # noqa: E402
from odma.server.testing import MODEL, tiny_model_folder, tiny_server  # noqa: E402
from odma.server.threaded import free_port  # noqa: E402
from odma.serve_ray.app import build_application  # noqa: E402
from odma.serve_ray.settings import RaySettings  # noqa: E402

APP = "odma"
CONFIG = dict(kv_budget="8MiB", predictor="median", max_tokens_cap=512, default_max_tokens=16, threads=1,
              pool=PoolConfig(align=16), buckets=BucketConfig(min_samples=16, refresh_every_n=16, refresh_every_s=1.0))


@contextlib.contextmanager
def deadline(seconds: int, what: str):
    """Fail instead of hanging (pytest runs tests in the main thread, where SIGALRM lands)."""
    def expired(*_):
        raise TimeoutError(f"{what} took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def cluster(folder, tmp_path_factory):
    config = EngineConfig(model=str(folder), length_log=tmp_path_factory.mktemp("logs") / "lengths.jsonl", **CONFIG)
    settings = RaySettings(replicas=2, replica_cpus=0.5, report_period_s=0.25, health_check_period_s=1.0,
                           app_name=APP)
    port = free_port(below_ephemeral=True)  # Ray's processes take ephemeral ports before the proxy binds
    try:
        with deadline(300, "starting Ray Serve with two replicas"):
            # address="local": a fresh Ray for this module, never a cluster RAY_ADDRESS points at
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                     object_store_memory=256 << 20)
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(build_application(config, settings, served_name=MODEL), name=APP, route_prefix="/")
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}", config=config,
                              state=serve.get_deployment_handle("OdmaCluster", app_name=APP))
    finally:  # also after a failed or timed-out start: no Ray outlives the module
        with deadline(120, "shutting Ray down"):
            if ray.is_initialized():
                serve.shutdown()
            ray.shutdown()


@pytest.fixture(scope="module")
def single(folder):
    """odma-serve in one process over the same model and config: the reference."""
    with tiny_server(folder, **CONFIG) as srv:
        yield srv


def snapshot(cluster) -> dict:
    return cluster.state.snapshot.remote(True).result(timeout_s=30)


def comparable(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


BODIES = [
    ("/v1/completions", {"model": MODEL, "prompt": "The rivers of Europe", "max_tokens": 12, "temperature": 0}),
    ("/v1/completions", {"model": MODEL, "prompt": "Count: one two", "max_tokens": 6, "temperature": 0, "echo": True,
                         "logprobs": 2}),
    ("/v1/completions", {"model": MODEL, "prompt": "Seeded", "max_tokens": 8, "n": 2, "seed": 7, "temperature": 0.9}),
    ("/v1/completions", {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 0, "echo": True, "logprobs": 1}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Name three rivers."}],
                              "max_tokens": 10, "temperature": 0, "logprobs": True, "top_logprobs": 2}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40,
                              "temperature": 0, "stop": ["e"]}),
]


def test_the_ray_endpoint_answers_as_odma_serve(cluster, single):
    with deadline(120, "the answers"):
        for path, body in BODIES:
            ray_answer = httpx.post(cluster.url + path, json=body, timeout=60)
            one_answer = httpx.post(single.url + path, json=body, timeout=60)
            assert ray_answer.status_code == one_answer.status_code == 200, ray_answer.text
            assert comparable(ray_answer.json()) == comparable(one_answer.json()), path


def stream_events(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_streams_carry_the_same_chunks(cluster, single):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me more."}], "max_tokens": 20,
            "temperature": 0, "n": 2, "stream_options": {"include_usage": True}}
    with deadline(120, "the streams"):
        got, want = stream_events(cluster.url, body), stream_events(single.url, body)
    strip = lambda events: sorted(json.dumps(comparable(e), sort_keys=True) for e in events)  # noqa: E731
    assert strip(got) == strip(want) and got[-1]["usage"]["completion_tokens"] == 40


def test_errors_are_odma_serves(cluster, single):
    cases = [("/v1/completions", {"model": MODEL, "prompt": "x", "bogus": 1}),
             ("/v1/completions", {"model": "nope", "prompt": "x"}),
             ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 513}),
             ("/v1/completions", {"model": MODEL, "prompt": [1] * 4000, "max_tokens": 500}),
             ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]})]
    with deadline(60, "the errors"):
        for path, body in cases:
            raw = {"content": json.dumps(body), "headers": {"content-type": "application/json"}, "timeout": 30}
            a, b = httpx.post(cluster.url + path, **raw), httpx.post(single.url + path, **raw)  # \ud800 as JSON sends it
            got, want = a.json()["error"], b.json()["error"]
            if a.status_code == 404:  # odma-serve (as the Ray app) also answers to the model's path and "default"
                got["message"] = want["message"] = got["message"].split("; available")[0]
            assert (a.status_code, got) == (b.status_code, want) and a.status_code in (400, 404)
        assert httpx.get(cluster.url + "/v1/models").json()["data"][0]["id"] == MODEL
        assert httpx.get(cluster.url + "/openapi.json").json()["info"]["title"] == "odma-serve"


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_shared_bounds_learned_from_both_replicas_reach_both(cluster):
    before = snapshot(cluster)
    lengths = [3, 3, 3, 3, 3, 3, 3, 3, 90, 90, 90, 90, 90, 90, 90, 90, 200, 200]
    results = []

    def one(n):
        body = {"model": MODEL, "prompt": f"length {n}", "max_tokens": n, "temperature": 0, "ignore_eos": True}
        results.append(httpx.post(cluster.url + "/v1/completions", json=body, timeout=120).json())

    with deadline(180, "the shared window"):
        threads = [threading.Thread(target=one, args=(n,)) for n in lengths]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(r["usage"]["completion_tokens"] for r in results) == sorted(lengths)
        while True:  # both replicas report, the cluster refreshes, both install
            snap = snapshot(cluster)
            texts = snap["metrics"]
            bounds_of = {name: sorted(int(float(l.rsplit(" ", 1)[1])) for l in text.splitlines()
                                      if l.startswith("odma_bucket_bound_tokens{") and 'bucket="-1"' not in l)
                         for name, text in texts.items()}
            learned = {96, 208} <= set(snap["bounds"])  # 90 and 200 (from both replicas), aligned to 16
            reported = snap["lengths_seen"] >= before["lengths_seen"] + len(lengths)  # the bounds may come first
            if learned and reported and len(bounds_of) == 2 and all(b == snap["bounds"] for b in bounds_of.values()):
                break
            time.sleep(0.25)
    assert snap["lengths_seen"] >= before["lengths_seen"] + len(lengths) and snap["bounds"] != before["bounds"]
    finished = [sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith("odma_requests_finished_total"))
                for text in texts.values()]
    assert len(finished) == 2 and all(n > 0 for n in finished)  # the router used both replicas
    m = httpx.get(cluster.url + "/metrics").text
    assert metric(m, "odma_ray_replicas") == 2 and metric(m, "odma_router_routed_total") >= len(lengths)


def engine_actors(cluster) -> dict:
    return {name: ray.get_actor(f"SERVE_REPLICA::{APP}#OdmaEngine#{name}", namespace="serve")
            for name in snapshot(cluster)["replicas"]}


def test_a_replica_killed_mid_stream(cluster):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Go on."}], "max_tokens": 480,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    outcomes: dict[int, dict] = {}
    started = [threading.Event() for _ in range(4)]

    def stream(i):
        got = {"tokens": 0, "error": None, "finish": None, "usage": None}
        try:
            with httpx.stream("POST", cluster.url + "/v1/chat/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        got["error"] = chunk["error"]["message"]
                        break
                    got["usage"] = chunk.get("usage") or got["usage"]
                    for ch in chunk["choices"]:
                        got["tokens"] += bool(ch["delta"].get("content"))
                        got["finish"] = ch["finish_reason"] or got["finish"]
                    if got["tokens"] >= 3:
                        started[i].set()
        finally:
            started[i].set()
            outcomes[i] = got

    with deadline(240, "the replica failure"):
        actors = engine_actors(cluster)
        assert len(actors) == 2
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for e in started:
            e.wait()
        while True:  # the replicas' reports show all four streams running, on both replicas (the router spread them)
            running = {n: metric(t, "odma_running_requests") for n, t in snapshot(cluster)["metrics"].items()}
            if sum(running.values()) == 4:
                break
            time.sleep(0.1)
        assert sorted(running.values()) == [2, 2], running
        victim, actor = next(iter(actors.items()))
        ray.kill(actor, no_restart=True)
        killed_at = time.monotonic()
        for t in threads:
            t.join()
        failed_within = time.monotonic() - killed_at
        errors = [o for o in outcomes.values() if o["error"]]
        finished = [o for o in outcomes.values() if o["finish"] == "length"]
        assert len(errors) + len(finished) == 4 and errors and finished  # each stream ended, one way or the other
        assert all("replica failed" in o["error"] and "Actor" in o["error"] for o in errors)
        assert all(o["usage"]["completion_tokens"] == 480 for o in finished)  # the survivor's streams are whole
        # new requests go to the survivor while Ray replaces the dead one
        for i in range(3):
            r = httpx.post(cluster.url + "/v1/completions", timeout=60,
                           json={"model": MODEL, "prompt": f"after {i}", "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        while True:  # Ray starts a new replica; it joins with the cluster's bounds
            snap = snapshot(cluster)
            if len(snap["replicas"]) == 2 and victim not in snap["replicas"] and len(snap["metrics"]) == 2:
                new = next(n for n in snap["replicas"] if n not in actors)
                bounds = sorted(int(float(l.rsplit(" ", 1)[1])) for l in snap["metrics"][new].splitlines()
                                if l.startswith("odma_bucket_bound_tokens{") and 'bucket="-1"' not in l)
                if bounds == snap["bounds"]:
                    break
            time.sleep(0.5)
    assert failed_within < 60
    m = httpx.get(cluster.url + "/metrics").text
    assert metric(m, "odma_ray_failed_requests_total") == len(errors)
