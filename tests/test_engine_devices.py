"""Several devices in one engine: one pool each, one set of bucket bounds, placement by load and pressure.
On CPU, cpu:0 and cpu:1 are two pools over the same weights: the placement and routing logic is what runs."""

from __future__ import annotations

import pytest
import torch

from odma.engine import SamplingParams
from odma.engine.config import EngineConfig
from odma.engine.testing import tiny_engine
from odma.errors import ConfigError
from odma.models.tiny import make_tiny_model

torch.set_num_threads(2)
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7], list(range(10, 70)), [100] * 17, [3], list(range(200, 240)), [9, 8] * 10]
TWO = ("cpu:0", "cpu:1")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def test_requests_spread_over_devices_and_get_the_tokens_they_get_on_one(folder):
    one = tiny_engine(folder, predicted=20).generate(PROMPTS, GREEDY)
    engine = tiny_engine(folder, predicted=20, devices=TWO)
    assert [w.device for w in engine.workers] == list(TWO)
    assert engine.workers[0].pool.policy is engine.workers[1].pool.policy  # one set of bucket bounds
    assert engine.workers[0].runner.model is engine.workers[1].runner.model  # same torch device: shared weights
    seqs = engine.generate(PROMPTS, GREEDY)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in one]
    load = {d: sum(len(p) for p, s in zip(PROMPTS, seqs) if s.device == d) for d in TWO}
    assert min(load.values()) > 0  # both used, balanced by tokens (the compute load), not by count
    assert abs(load["cpu:0"] - load["cpu:1"]) <= max(len(p) for p in PROMPTS)
    for w in engine.workers:
        assert w.pool.stats().live_blocks == 0
        w.pool.check_invariants()


def test_placement_prefers_the_device_with_room_and_less_work(folder):
    engine = tiny_engine(folder, predicted=20, devices=TWO)
    first = engine.add_request(list(range(3, 90)), SamplingParams(max_tokens=8, temperature=0))
    engine.step()  # placed and prefilled: cpu:0 now holds a block and attends 87 tokens
    assert first.device == "cpu:0" and engine.workers[0].pool.stats().live_blocks == 1
    second = engine.add_request([4, 5], SamplingParams(max_tokens=8, temperature=0))
    engine.step()
    assert second.device == "cpu:1"
    while engine.has_work():
        engine.step()
    assert first.finished and second.finished


def test_cancel_and_errors_release_on_the_request_s_own_device(folder):
    engine = tiny_engine(folder, predicted=20, devices=TWO)
    seqs = [engine.add_request(p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)) for p in PROMPTS[:4]]
    engine.step()
    engine.step()
    assert {s.device for s in seqs} == set(TWO)
    for s in seqs[:2]:
        engine.abort(s.request_id)
    engine.step()
    assert all(s.finish_reason == "abort" for s in seqs[:2])
    engine.fail_all("shutting down")
    assert all(s.finished for s in seqs) and engine.num_running == 0 and engine.num_waiting == 0
    for w in engine.workers:
        assert w.pool.stats().live_blocks == 0
        w.pool.check_invariants()


def test_device_lists_are_checked():
    with pytest.raises(ConfigError, match="distinct"):
        EngineConfig(devices=("cpu:0", "cpu:0"))
    with pytest.raises(ConfigError, match="one kind"):
        EngineConfig(devices=("cpu:0", "cuda:0"))
    assert EngineConfig().device_list == ("cpu",)


def test_server_on_two_pools_reports_each_and_their_sum(folder):
    import httpx

    from odma.server.app import create_app
    from odma.server.metrics import Metrics
    from odma.server.runtime import AsyncEngine
    from odma.server.threaded import ThreadedServer

    metrics = Metrics()
    engine = tiny_engine(folder, predicted=20, devices=TWO)
    engine.metrics = metrics
    runtime = AsyncEngine(engine, max_queue=16)
    metrics.attach(runtime)
    with ThreadedServer(create_app(runtime, metrics, "tiny")) as srv:
        for prompt in ([5, 6, 7] * 20, [8, 9], [10] * 30, [11]):
            r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                                             "ignore_eos": True}, timeout=30)
            assert r.status_code == 200, r.text
        text = httpx.get(srv.url + "/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line.startswith("odma_")}
    budget = sum(w.pool.total_tokens * w.pool.bytes_per_token for w in engine.workers)
    assert values["odma_kv_budget_bytes"] == budget
    for d in TWO:
        assert f'odma_device_kv_reserved_bytes{{device="{d}"}}' in values
    assert values["odma_running_requests"] == 0 and all(w.pool.stats().live_blocks == 0 for w in engine.workers)


def test_parallel_device_steps_give_the_same_tokens(folder):
    """parallel_devices (the default on accelerators) runs each device's model step in its own thread;
    scheduling and bookkeeping stay in the engine's thread, so the tokens are those of the serial run."""
    import threading

    serial = tiny_engine(folder, predicted=20, devices=TWO).generate(PROMPTS, GREEDY)
    engine = tiny_engine(folder, predicted=20, devices=TWO, parallel_devices=True)
    threads = set()
    for w in engine.workers:
        run = w.runner.run

        def traced(work, run=run):
            threads.add(threading.current_thread().name)
            return run(work)

        w.runner.run = traced
    seqs = engine.generate(PROMPTS, GREEDY)
    engine.close()
    assert [s.output_ids for s in seqs] == [s.output_ids for s in serial]
    assert any(name.startswith("odma-device") for name in threads)
    assert EngineConfig(devices=("cuda:0", "cuda:1")).parallel_devices_resolved
    assert not EngineConfig(devices=TWO).parallel_devices_resolved
