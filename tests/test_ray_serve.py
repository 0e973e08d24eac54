"""odma-serve on a local Ray Serve (CPU, the tiny model, one Ray start for the module; with an ingress replica, then
with the engines as the ingress): the same answers, errors
and metrics as odma-serve through one endpoint; realized lengths from both replicas feed one window whose bounds
every replica reserves from; a replica killed mid-stream fails its own streams with a clear error, the others
finish, new requests go to the survivor, Ray restarts it and the new replica picks up the shared bounds."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from pathlib import Path
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
    ("/v1/completions", {"model": MODEL, "prompt": ["Rivers", "Mountains of Asia"], "max_tokens": 5, "n": 2,
                         "temperature": 0}),  # a batch of prompts, each on whichever replica the router picks
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Name three rivers."}],
                              "max_tokens": 10, "temperature": 0, "logprobs": True, "top_logprobs": 2}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40,
                              "temperature": 0, "stop": ["e"]}),
]


def assert_answers_as(url: str, single) -> None:
    for path, body in BODIES:
        ray_answer = httpx.post(url + path, json=body, timeout=60)
        one_answer = httpx.post(single.url + path, json=body, timeout=60)
        assert ray_answer.status_code == one_answer.status_code == 200, ray_answer.text
        assert comparable(ray_answer.json()) == comparable(one_answer.json()), path


def test_the_ray_endpoint_answers_as_odma_serve(cluster, single):
    with deadline(120, "the answers"):
        assert_answers_as(cluster.url, single)


def stream_events(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


STREAM_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me more."}], "max_tokens": 20,
               "temperature": 0, "n": 2, "stream_options": {"include_usage": True}}


def same_chunks(got: list[dict], want: list[dict]) -> bool:
    strip = lambda events: sorted(json.dumps(comparable(e), sort_keys=True) for e in events)  # noqa: E731
    return strip(got) == strip(want)


def test_streams_carry_the_same_chunks(cluster, single):
    with deadline(120, "the streams"):
        got, want = stream_events(cluster.url, STREAM_BODY), stream_events(single.url, STREAM_BODY)
    assert same_chunks(got, want) and got[-1]["usage"]["completion_tokens"] == 40


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


def total(text: str, name: str) -> float:
    """The sum over a family's labelled series."""
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith((name + " ", name + "{")))


LENGTHS = [3, 3, 3, 3, 3, 3, 3, 3, 90, 90, 90, 90, 90, 90, 90, 90, 200, 200]


def complete_at_once(url: str, lengths: list[int]) -> list[int]:
    """One completion of each length, all at once; the lengths they realized."""
    results = []

    def one(n):
        body = {"model": MODEL, "prompt": f"length {n}", "max_tokens": n, "temperature": 0, "ignore_eos": True}
        results.append(httpx.post(url + "/v1/completions", json=body, timeout=120).json())

    threads = [threading.Thread(target=one, args=(n,)) for n in lengths]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(r.get("usage", r)["completion_tokens"] for r in results)


def test_shared_bounds_learned_from_both_replicas_reach_both(cluster):
    before = snapshot(cluster)
    with deadline(180, "the shared window"):
        assert complete_at_once(cluster.url, LENGTHS) == sorted(LENGTHS)
        while True:  # both replicas report, the cluster refreshes, both install
            snap = snapshot(cluster)
            texts = snap["metrics"]
            bounds_of = {name: sorted(int(float(l.rsplit(" ", 1)[1])) for l in text.splitlines()
                                      if l.startswith("odma_bucket_bound_tokens{") and 'bucket="-1"' not in l)
                         for name, text in texts.items()}
            learned = {96, 208} <= set(snap["bounds"])  # 90 and 200 (from both replicas), aligned to 16
            reported = snap["lengths_seen"] >= before["lengths_seen"] + len(LENGTHS)  # the bounds may come first
            if learned and reported and len(bounds_of) == 2 and all(b == snap["bounds"] for b in bounds_of.values()):
                break
            time.sleep(0.25)
    assert snap["lengths_seen"] >= before["lengths_seen"] + len(LENGTHS) and snap["bounds"] != before["bounds"]
    finished = [total(text, "odma_requests_finished_total") for text in texts.values()]
    assert len(finished) == 2 and all(n > 0 for n in finished)  # the router used both replicas
    m = httpx.get(cluster.url + "/metrics").text
    assert metric(m, "odma_ray_replicas") == 2 and metric(m, "odma_router_routed_total") >= len(LENGTHS)


KILL_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Go on."}], "max_tokens": 480,
             "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def follow_stream(url: str, started: threading.Event) -> dict:
    """One stream of KILL_BODY: its tokens, finish reason, usage, and how it failed (an error event's message, or the
    connection cut under it)."""
    got = {"tokens": 0, "error": None, "cut": None, "finish": None, "usage": None}
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=KILL_BODY, timeout=120) as r:
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
                    started.set()
    except httpx.HTTPError as exc:
        got["cut"] = f"{type(exc).__name__}: {exc}"
    finally:
        started.set()
    return got


def kill_a_replica_mid_stream(url: str, app: str, state) -> tuple[list[dict], str, dict, float]:
    """Four streams spread 2/2 over the two replicas, one replica killed: (the streams' outcomes, the victim, the
    replicas before, seconds from the kill until every stream ended)."""
    actors = {name: ray.get_actor(f"SERVE_REPLICA::{app}#OdmaEngine#{name}", namespace="serve")
              for name in snapshot(state)["replicas"]}
    assert len(actors) == 2
    started = [threading.Event() for _ in range(4)]
    outcomes: dict[int, dict] = {}
    threads = [threading.Thread(target=lambda i=i: outcomes.__setitem__(i, follow_stream(url, started[i])))
               for i in range(4)]
    for t in threads:
        t.start()
    for e in started:
        e.wait()
    while True:  # the replicas' reports show all four streams running, on both replicas (the router spread them)
        running = {n: metric(t, "odma_running_requests") for n, t in snapshot(state)["metrics"].items()}
        if sum(running.values()) == 4:
            break
        time.sleep(0.1)
    # four streams sent together are placed on loads reported up to a period before: usually 2 + 2, 1 + 3 once
    # under the whole suite's load; what the test needs is streams on both, the victim's and the survivor's
    assert len(running) == 2 and min(running.values()) >= 1, running
    victim, actor = next(iter(actors.items()))
    ray.kill(actor, no_restart=True)
    killed_at = time.monotonic()
    for t in threads:
        t.join()
    return list(outcomes.values()), victim, actors, time.monotonic() - killed_at


def survivors_serve_and_a_new_replica_joins(url: str, state, victim: str, actors: dict) -> None:
    for i in range(3):  # new requests go to the survivor while Ray replaces the dead one
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": f"after {i}", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    while True:  # Ray starts a new replica; it joins with the cluster's bounds
        snap = snapshot(state)
        if len(snap["replicas"]) == 2 and victim not in snap["replicas"] and len(snap["metrics"]) == 2:
            new = next(n for n in snap["replicas"] if n not in actors)
            bounds = sorted(int(float(l.rsplit(" ", 1)[1])) for l in snap["metrics"][new].splitlines()
                            if l.startswith("odma_bucket_bound_tokens{") and 'bucket="-1"' not in l)
            if bounds == snap["bounds"]:
                return
        time.sleep(0.5)


def test_a_replica_killed_mid_stream(cluster):
    with deadline(240, "the replica failure"):
        outcomes, victim, actors, failed_within = kill_a_replica_mid_stream(cluster.url, APP, cluster)
        errors = [o for o in outcomes if o["error"]]
        finished = [o for o in outcomes if o["finish"] == "length"]
        assert len(errors) + len(finished) == 4 and errors and finished  # each stream ended, one way or the other
        assert all("replica failed" in o["error"] and "Actor" in o["error"] for o in errors)
        assert all(o["usage"]["completion_tokens"] == 480 for o in finished)  # the survivor's streams are whole
        survivors_serve_and_a_new_replica_joins(cluster.url, cluster, victim, actors)
    assert failed_within < 60
    m = httpx.get(cluster.url + "/metrics").text
    assert metric(m, "odma_ray_failed_requests_total") == len(errors)


# -- the engines as the ingress (RaySettings.ingress = "engines") ------------------------------------------------

ENGINES_APP = "odma-engines"


@pytest.fixture(scope="module")
def engines(cluster, folder, tmp_path_factory):
    """A second application in the same Ray: Ray's proxy routes straight to its engine replicas."""
    config = EngineConfig(model=str(folder), length_log=tmp_path_factory.mktemp("logs") / "lengths.jsonl", **CONFIG)
    settings = RaySettings(replicas=2, replica_cpus=0.5, report_period_s=0.25, health_check_period_s=1.0,
                           app_name=ENGINES_APP, ingress="engines", max_queue=64)
    with deadline(300, "deploying the engines as the ingress"):
        serve.run(build_application(config, settings, served_name=MODEL), name=ENGINES_APP, route_prefix="/engines")
    try:
        yield SimpleNamespace(url=cluster.url + "/engines", config=config,
                              state=serve.get_deployment_handle("OdmaCluster", app_name=ENGINES_APP))
    finally:
        with deadline(120, "deleting the engines' application"):
            serve.delete(ENGINES_APP)


def test_engines_as_the_ingress_answer_stream_and_refuse_as_odma_serve(engines, single):
    with deadline(180, "the answers through the engines"):
        assert_answers_as(engines.url, single)
        assert same_chunks(stream_events(engines.url, STREAM_BODY), stream_events(single.url, STREAM_BODY))
        bad = {"model": MODEL, "prompt": "x", "max_tokens": 513}
        a = httpx.post(engines.url + "/v1/completions", json=bad)
        b = httpx.post(single.url + "/v1/completions", json=bad)
        assert (a.status_code, a.json()) == (b.status_code, b.json()) == (400, b.json())


def test_engines_as_the_ingress_share_bounds_and_serve_the_clusters_metrics(engines):
    with deadline(180, "the engines' shared window"):
        assert complete_at_once(engines.url, LENGTHS) == sorted(LENGTHS)
        while True:  # both replicas report; the bounds come from both; each one's /metrics covers both, settled
            snap = snapshot(engines)
            finished = [total(text, "odma_requests_finished_total") for text in snap["metrics"].values()]
            m = httpx.get(engines.url + "/metrics").text
            if {96, 208} <= set(snap["bounds"]) and metric(m, "odma_ray_replicas") == 2 and \
                    total(m, "odma_requests_finished_total") == sum(finished) >= len(LENGTHS):
                break
            time.sleep(0.25)
    assert len(finished) == 2 and all(n > 0 for n in finished)  # the proxy's router used both replicas
    # the proxy routed with odma's router, not Ray's default (its log says so; Ray writes it under the session)
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs" / "serve"
    said = "".join(p.read_text(errors="replace") for p in logs.glob("proxy_*.log"))
    assert f"odma memory-aware router routes Deployment(name='OdmaEngine', app='{ENGINES_APP}')" in said


def test_an_engine_killed_mid_stream_when_the_engines_are_the_ingress(engines):
    """Its streams are cut (the client sees the connection close early, never a hang), the other replica's
    streams finish whole, new requests go to the survivor, Ray starts a new replica that joins the cluster."""
    with deadline(240, "the engine's failure"):
        outcomes, victim, actors, failed_within = kill_a_replica_mid_stream(engines.url, ENGINES_APP, engines)
        cut = [o for o in outcomes if o["finish"] != "length"]
        finished = [o for o in outcomes if o["finish"] == "length"]
        assert len(cut) == len(finished) == 2
        assert all(o["usage"]["completion_tokens"] == 480 for o in finished)  # the survivor's streams are whole
        # no replica in between to write an error event: the proxy cuts the dead replica's streams (no hang)
        assert all(o["cut"].startswith("RemoteProtocolError") and o["usage"] is None for o in cut), outcomes
        survivors_serve_and_a_new_replica_joins(engines.url, engines, victim, actors)
    assert failed_within < 60
