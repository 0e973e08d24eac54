"""`--max-queue` holds for any arrival pattern: a place in the queue is taken when a request is admitted (before
its prompt is tokenized), so a burst of requests arriving at once gets no more places than requests sent one by
one; the place is given back once, when the request starts running or ends however it ends."""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from types import SimpleNamespace

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from odma.engine import SamplingParams
from odma.engine.testing import tiny_engine
from odma.errors import InvalidRequestError
from odma.models.config import ModelConfig
from odma.server.admission import RETRY_AFTER_S, Door
from odma.server.runtime import SHUTTING_DOWN, AsyncEngine
from odma.server.testing import MODEL, tiny_server
from odma.serve_ray.front import ClusterView, FrontEngine, RemoteRuntime
from odma.serve_ray.scoring import ReplicaLoad
from odma.serve_ray.settings import RaySettings

torch.set_num_threads(1)
MAX_QUEUE = 4
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 8,
        "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_folder):
    # two requests run at a time: the rest of a burst waits, and the queue's bound is what refuses it
    with tiny_server(tiny_folder, max_queue=MAX_QUEUE, max_n=8, max_num_seqs=2) as srv:
        yield srv


@contextmanager
def held(engine):
    """No engine step runs inside the block: admitted requests stay waiting (no timing decides the outcome)."""
    go = threading.Event()
    step = engine.step

    def paused_step():
        go.wait()
        return step()

    engine.step = paused_step
    try:
        yield
    finally:
        go.set()
        del engine.step  # the class's step again


def wait_for(check, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def queue_depth(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "odma_queue_depth"]
    return family.samples[0].value


def assert_busy(r: httpx.Response) -> None:
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == str(RETRY_AFTER_S) and int(r.headers["retry-after"]) > 0
    assert r.json()["error"]["type"] == "rate_limit_exceeded"
    assert f"at most {MAX_QUEUE} waiting requests" in r.json()["error"]["message"]


def assert_idle(runtime) -> None:
    wait_for(lambda: not runtime.engine.has_work(), what="the engine to finish")
    assert runtime.waiting == 0 and not runtime._counted


async def fire(url: str, bodies: list[dict], done: list | None = None, path: str = "/v1/chat/completions"):
    """Every body posted at once; `done` collects the responses as they come."""
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=len(bodies))) as c:
        async def one(body):
            r = await c.post(path, json=body)
            if done is not None:
                done.append(r)
            return r

        return await asyncio.gather(*(one(b) for b in bodies))


# -- the door ----------------------------------------------------------------------------------------------


def test_the_door_counts_samples_and_keeps_the_empty_queue_rule():
    door = Door(4)
    three = door.admit(3)
    assert three is not None and door.waiting == 3
    assert door.admit(2) is None and door.waiting == 3  # 3 + 2 > 4: refused, nothing taken
    one = door.admit(1)
    assert one is not None and door.waiting == 4
    assert door.admit(1) is None
    three.release(1)
    three.release(5)  # more than it holds: what is left, once
    three.release()
    one.release()
    one.release()
    assert door.waiting == 0
    big = door.admit(9)  # one request always fits an empty queue, however many samples it has
    assert big is not None and door.waiting == 9 and door.admit(1) is None
    big.release()
    assert Door(0).admit(1) is None  # max_queue 0 refuses everything
    assert door.admit(2, also_waiting=3) is None and door.admit(1, also_waiting=3) is not None


def test_threads_racing_for_the_last_places_never_pass_the_bound():
    door = Door(MAX_QUEUE)
    start = threading.Barrier(16)
    passes = []

    def take():
        start.wait()
        for _ in range(200):
            p = door.admit(1)
            if p is not None:
                passes.append(p)

    threads = [threading.Thread(target=take) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(passes) == MAX_QUEUE and door.waiting == MAX_QUEUE


# -- the server ------------------------------------------------------------------------------------------


def test_a_burst_gets_max_queue_places_and_the_rest_429(server):
    engine, runtime = server.runtime.engine, server.runtime
    done: list[httpx.Response] = []

    async def burst():
        with held(engine):
            task = asyncio.ensure_future(fire(server.url, [CHAT] * 40, done))
            deadline = time.monotonic() + 20
            while len(done) < 40 - MAX_QUEUE:
                assert time.monotonic() < deadline, f"only {len(done)} answered while the engine was held"
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # a 37th answer would come now
            assert len(done) == 40 - MAX_QUEUE
            wait_for(lambda: engine.num_waiting == MAX_QUEUE, what="the admitted requests to be queued")
            assert runtime.waiting == MAX_QUEUE
            assert await asyncio.to_thread(queue_depth, server.url) == MAX_QUEUE
        return await task

    responses = asyncio.run(burst())
    for r in responses:
        if r.status_code != 200:
            assert_busy(r)
    assert sum(r.status_code == 200 for r in responses) == MAX_QUEUE
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in responses if r.status_code == 200)
    assert runtime.waiting == 0  # given back before the answers went out
    assert_idle(runtime)
    assert queue_depth(server.url) == 0


def test_while_the_engine_runs_a_burst_never_has_more_than_max_queue_waiting(server):
    engine, runtime = server.runtime.engine, server.runtime
    seen: list[int] = []
    step = engine.step

    def watched_step():
        seen.append(runtime.waiting)
        return step()

    engine.step = watched_step
    gauge: list[float] = []
    try:
        async def burst():
            task = asyncio.ensure_future(fire(server.url, [{**CHAT, "max_tokens": 16}] * 40))
            while not task.done():
                gauge.append(await asyncio.to_thread(queue_depth, server.url))
            return await task

        responses = asyncio.run(burst())
    finally:
        del engine.step
    ok = [r for r in responses if r.status_code == 200]
    busy = [r for r in responses if r.status_code != 200]
    for r in busy:
        assert_busy(r)
    assert ok and busy and len(ok) + len(busy) == 40
    assert all(r.json()["choices"][0]["finish_reason"] == "length" for r in ok)
    assert seen and max(seen) <= MAX_QUEUE and max(gauge) <= MAX_QUEUE
    assert runtime.waiting == 0
    assert_idle(runtime)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_while_waiting_gives_its_place_back(server, stream):
    engine, runtime = server.runtime.engine, server.runtime
    before = engine.metrics.finished.get("abort", 0)
    with held(engine):
        body = {**CHAT, "stream": stream}
        with pytest.raises(httpx.ReadTimeout):
            with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=1.0) as r:
                for _ in r.iter_lines():  # a stream's first chunk comes at once; then nothing while it waits
                    pass
        wait_for(lambda: runtime.waiting == 0, what="the place to be given back")
        assert engine.num_running == 0  # it never ran: its place came back while it waited
    wait_for(lambda: engine.metrics.finished.get("abort", 0) == before + 1, what="the engine to drop it")
    assert_idle(runtime)


def test_n_samples_take_n_places(server):
    runtime = server.runtime
    completion = {"model": MODEL, "prompt": "once upon a time", "max_tokens": 4, "ignore_eos": True}

    async def go():
        with held(runtime.engine):
            three = asyncio.ensure_future(fire(server.url, [{**completion, "n": 3}], path="/v1/completions"))
            await asyncio.to_thread(wait_for, lambda: runtime.waiting == 3, 10.0, "3 places")
            (two,) = await fire(server.url, [{**completion, "n": 2}], path="/v1/completions")
            assert_busy(two)  # 3 + 2 > 4
            one = asyncio.ensure_future(fire(server.url, [completion], path="/v1/completions"))
            await asyncio.to_thread(wait_for, lambda: runtime.waiting == MAX_QUEUE, 10.0, "4 places")
            assert await asyncio.to_thread(queue_depth, server.url) == MAX_QUEUE
        return (await three)[0], (await one)[0]

    three, one = asyncio.run(go())
    assert three.status_code == 200 and len(three.json()["choices"]) == 3
    assert one.status_code == 200 and len(one.json()["choices"]) == 1
    assert_idle(runtime)

    async def alone():  # one request fits an empty queue even with more samples than max_queue
        with held(runtime.engine):
            eight = asyncio.ensure_future(fire(server.url, [{**completion, "n": 8}], path="/v1/completions"))
            await asyncio.to_thread(wait_for, lambda: runtime.waiting == 8, 10.0, "8 places")
            (more,) = await fire(server.url, [completion], path="/v1/completions")
            assert_busy(more)
        return (await eight)[0]

    eight = asyncio.run(alone())
    assert eight.status_code == 200 and len(eight.json()["choices"]) == 8
    assert_idle(runtime)


def test_a_request_refused_after_admission_gives_its_place_back(server):
    runtime = server.runtime
    with held(runtime.engine):
        bad = {**CHAT, "min_tokens": 9}  # > max_tokens: refused while the job is built, after admission
        r = httpx.post(server.url + "/v1/chat/completions", json=bad)
        assert r.status_code == 400 and "min_tokens" in r.json()["error"]["message"]
        assert runtime.waiting == 0
    assert_idle(runtime)


def test_a_stopping_server_gives_every_place_back(tiny_folder):
    runtime = AsyncEngine(tiny_engine(tiny_folder, max_num_seqs=1), max_queue=MAX_QUEUE)

    async def go():
        runtime.start()
        passes = [runtime.admit() for _ in range(3)]
        spare = runtime.admit()
        assert all(passes) and spare is not None and runtime.admit() is None
        handles = [runtime.submit([5, 6, 7], SamplingParams(max_tokens=32, ignore_eos=True), admitted=p)
                   for p in passes]
        runtime.drain()
        errors = []
        for handle in handles:
            async for ev in runtime.events(handle):
                if ev.finished:
                    errors.append(ev.seq.error)
        assert runtime.waiting == 1  # only the pass never handed to submit holds a place
        spare.release()
        return errors

    try:
        errors = asyncio.run(go())
    finally:
        runtime.stop()
    assert errors == [SHUTTING_DOWN] * 3
    assert runtime.waiting == 0 and not runtime._counted
    runtime.engine.close()


# -- the Ray ingress ---------------------------------------------------------------------------------------


def test_the_ray_ingress_counts_a_burst_before_its_jobs_reach_a_replica(tiny_folder):
    engine = tiny_engine(tiny_folder)
    view = ClusterView(engine.config)
    view.apply({"replicas": {"r0": ReplicaLoad(
        capacity_tokens=4096, reserved_tokens=0, live_tokens=0, largest_free_tokens=4096, queued_tokens=0,
        queued_prompts=0, running=0, waiting=0, max_num_seqs=64, max_request_tokens=4096, at=100.0).as_dict()}})
    front = FrontEngine(engine.config, None, ModelConfig.from_folder(tiny_folder), view)

    class Silent:
        """A replica's stream that never answers: its jobs stay outstanding until cancelled."""

        def __aiter__(self):
            return self

        async def __anext__(self):
            await asyncio.Event().wait()

        def cancel(self):
            pass

    generate = SimpleNamespace(remote=lambda job: Silent())
    engines = SimpleNamespace(options=lambda stream: SimpleNamespace(generate=generate))
    runtime = RemoteRuntime(front, engines, None, replace(RaySettings(), max_queue=MAX_QUEUE), None)

    async def go():
        passes = [runtime.admit() for _ in range(40)]  # a burst: all admitted before any is tokenized
        assert sum(p is not None for p in passes) == MAX_QUEUE and runtime.waiting == MAX_QUEUE
        taken = [p for p in passes if p is not None]
        with pytest.raises(InvalidRequestError):  # refused by validation: the place comes back
            runtime.submit([], SamplingParams(max_tokens=4), admitted=taken.pop())
        assert runtime.waiting == MAX_QUEUE - 1
        handles = [runtime.submit([1, 2, 3], SamplingParams(max_tokens=4), admitted=p) for p in taken]
        assert runtime.waiting == MAX_QUEUE - 1 and runtime.door.waiting == 0  # now `outstanding` counts them
        assert runtime.admit(2) is None
        last = runtime.admit(1)
        assert last is not None and runtime.waiting == MAX_QUEUE
        last.release()
        for h in handles:
            runtime.cancel(h)
        await asyncio.sleep(0)
        await asyncio.gather(*(h.task for h in handles), return_exceptions=True)
        return runtime.waiting

    assert asyncio.run(go()) == 0
    engine.close()
