"""Memory pressure never loses a request: it waits, migrates or is recomputed; bad input is refused cleanly."""

from __future__ import annotations

import pytest
import torch

from odma.engine import SamplingParams
from odma.engine.testing import tiny_engine
from odma.errors import InvalidRequestError, RequestTooLargeError
from odma.models.tiny import make_tiny_model

torch.set_num_threads(2)
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
PROMPTS = [list(range(3 + i, 13 + i)) for i in range(8)]  # 8 prompts of 10 tokens


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def reference(folder):
    return [s.output_ids for s in tiny_engine(folder, kv_budget="1MiB").generate(PROMPTS, GREEDY)]


# 64 KiB at 512 B/token = 128 token slots: room for two or three 50-token requests at a time
@pytest.mark.parametrize("preempt", ["wait", "recompute", "swap"])
@pytest.mark.parametrize("policy,predicted", [("static", None), ("s3", 1), ("odma", 8)])
def test_every_request_completes_under_pressure(folder, reference, preempt, policy, predicted):
    engine = tiny_engine(folder, kv_budget="64KiB", policy=policy, predicted=predicted, preempt=preempt, align=4)
    peak = 0
    seqs = [engine.add_request(p, GREEDY) for p in PROMPTS]
    while engine.has_work():
        engine.step()
        peak = max(peak, engine.num_running)
        engine.pool.check_invariants()
    assert 1 < peak < len(PROMPTS)  # memory, not the batch cap, limited concurrency
    assert [s.output_ids for s in seqs] == reference
    assert all(s.finish_reason == "length" for s in seqs)
    stats = engine.pool.stats()
    assert stats.live_blocks == 0 and stats.reserved_tokens == 0
    if policy == "s3":  # L̂ = 1: every request outgrows its 16-token bucket
        assert engine.scheduler.counters.preemptions + stats.migrations > 0
    if preempt == "swap":
        c = engine.scheduler.counters
        assert c.swap_outs == c.swap_ins and engine.swap.held_bytes == 0  # every swapped K/V came back
        assert c.swap_outs == c.preemptions  # the 1 GiB host buffer took every preempted request
        if policy == "s3":
            assert c.swap_outs > 0


def test_swap_falls_back_to_recompute_when_the_host_buffer_is_full(folder, reference):
    engine = tiny_engine(folder, kv_budget="64KiB", policy="s3", predicted=1, preempt="swap", swap_space="1KiB", align=4)
    seqs = engine.generate(PROMPTS, GREEDY)
    c = engine.scheduler.counters
    assert [s.output_ids for s in seqs] == reference
    assert c.preemptions > 0 and c.swap_outs == 0  # 1 KiB holds no request's K/V (512 B per token)


def test_a_request_cancelled_while_swapped_out_frees_its_host_copy(folder):
    engine = tiny_engine(folder, kv_budget="64KiB", policy="s3", predicted=1, preempt="swap", align=4)
    seqs = [engine.add_request(p, GREEDY) for p in PROMPTS]
    swapped = None
    while engine.has_work() and swapped is None:
        engine.step()
        swapped = next((s for s in seqs if s.swapped), None)
    assert swapped is not None and engine.swap.held_bytes > 0
    engine.abort(swapped.request_id)
    while engine.has_work():
        engine.step()
    assert swapped.finish_reason == "abort" and engine.swap.held_bytes == 0
    assert engine.pool.stats().live_blocks == 0


def test_prompt_that_can_never_fit_is_refused_up_front(folder):
    engine = tiny_engine(folder, kv_budget="64KiB")
    with pytest.raises(RequestTooLargeError, match="cannot fit"):
        engine.add_request(list(range(3, 120)), SamplingParams(max_tokens=40))
    assert not engine.has_work() and engine.pool.stats().live_blocks == 0


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ([], SamplingParams(max_tokens=4), "empty"),
        ([1, 2, 999], SamplingParams(max_tokens=4), "token ids"),
        ([1, 2], SamplingParams(max_tokens=129), "cap"),
        (list(range(3, 250)) * 2, SamplingParams(max_tokens=100), "context"),
    ],
)
def test_bad_requests_are_refused_with_a_reason(folder, prompt, params, match):
    engine = tiny_engine(folder, kv_budget="1MiB")
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request(prompt, params)
    assert not engine.has_work()


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(max_tokens=-1), dict(temperature=-1.0),
                                 dict(top_p=0.0), dict(top_k=-2), dict(min_tokens=50, max_tokens=10)])
def test_bad_sampling_params(bad):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad)


def test_abort_releases_the_block_waiting_or_running(folder):
    engine = tiny_engine(folder, kv_budget="64KiB", policy="static")
    seqs = [engine.add_request(p, GREEDY) for p in PROMPTS]
    engine.step()
    running = [s for s in seqs if s.block is not None]
    waiting = [s for s in seqs if s.block is None]
    assert running and waiting
    for s in (running[0], waiting[0]):
        engine.abort(s.request_id)
    engine.step()
    assert running[0].finish_reason == "abort" and waiting[0].finish_reason == "abort"
    while engine.has_work():
        engine.step()
    assert engine.pool.stats().live_blocks == 0
    assert sum(s.finish_reason == "length" for s in seqs) == len(PROMPTS) - 2


def test_a_failing_step_fails_its_requests_and_frees_their_blocks(folder, monkeypatch):
    engine = tiny_engine(folder, kv_budget="1MiB")
    seqs = [engine.add_request(p, GREEDY) for p in PROMPTS[:3]]

    def boom(work):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "run", boom)
    engine.step()
    assert all(s.finish_reason == "error" and "device lost" in s.error for s in seqs)
    assert engine.pool.stats().live_blocks == 0 and not engine.has_work()


def test_released_lengths_feed_the_bucket_manager_and_the_log(folder, tmp_path):
    import json

    log = tmp_path / "lengths.jsonl"
    engine = tiny_engine(folder, kv_budget="1MiB", length_log=log)
    engine.generate(PROMPTS[:3], GREEDY)
    engine.close()
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["output_tokens"] for r in rows] == [40, 40, 40]
    assert {"request_id", "prompt_tokens", "output_tokens", "finished", "predicted", "bucket"} <= rows[0].keys()
    assert engine.policy.buckets.window_lengths() == [40, 40, 40]


def test_bucket_bounds_are_bootstrapped_from_this_models_log(folder, tmp_path):
    import json

    from odma.kv.buckets import default_bounds

    log = tmp_path / "lengths.jsonl"
    rows = [{"request_id": f"r{i}", "prompt_tokens": 5, "output_tokens": 20 + i % 5, "model": str(folder)} for i in range(80)]
    rows += [{"request_id": f"x{i}", "prompt_tokens": 5, "output_tokens": 120, "model": "another"} for i in range(80)]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"torn line\n')
    engine = tiny_engine(folder, kv_budget="1MiB", length_log=log)
    buckets = engine.policy.buckets
    assert buckets.bounds != default_bounds(buckets.config)
    assert max(buckets.bounds) <= 32  # learned from this model's 20-24 token answers, not the other's 120


def test_tpot_violations_shrink_the_swap_buffer_and_tokens_stay(folder, reference):
    # every decode step is slower than a 1 ns TPOT SLO: eLLM Algorithm 2 shrinks the buffer by α each
    # 3 violations in a window of 5 steps; new swaps stop once it is too small, tokens are unchanged
    engine = tiny_engine(folder, kv_budget="64KiB", policy="s3", predicted=1, preempt="swap", align=4,
                         slo_tpot_s=1e-9)
    capacity = engine.swap.controller.config.capacity_bytes
    seqs = engine.generate(PROMPTS, GREEDY)
    assert [s.output_ids for s in seqs] == reference
    m = engine.swap.controller.metrics
    assert m.buffer_shrinks > 0 and engine.swap.controller.logical_bytes < capacity
    assert engine.swap.held_bytes == 0


def test_slo_must_be_positive(folder):
    from odma.errors import ConfigError

    with pytest.raises(ConfigError, match="slo_tpot_s"):
        tiny_engine(folder, slo_tpot_s=0.0)


def test_the_predictor_sees_request_metadata_and_the_log_keeps_it(folder, tmp_path):
    """What the predictor reads (temperature, the served model as `generator`, chat depth, system-prompt id)
    is what the length log records, under TraceRecord's names, so a retrain on the log has the same features."""
    from odma.engine.length_predictor import LoadedPredictor
    from odma.engine.sequence import RequestTags
    from odma.models.weights import model_name
    from odma.traces import load_trace

    seen = []

    class Recording:
        def predict(self, requests):
            seen.extend(requests)
            return [(8.0, 0.1) for _ in requests]

    log = tmp_path / "lengths.jsonl"
    engine = tiny_engine(folder, kv_budget="1MiB", length_log=log)
    engine.predictor = LoadedPredictor(Recording(), "recording", None)
    sampled = SamplingParams(max_tokens=6, temperature=0.5, ignore_eos=True, seed=1)
    engine.add_request(PROMPTS[0], sampled, request_id="deep", tags=RequestTags(depth=2, system_prompt_id="sys-x"))
    engine.add_request(PROMPTS[1], GREEDY, request_id="plain")
    while engine.has_work():
        engine.step()
    engine.close()
    assert len(seen) == 2 and {r.prompt_tokens for r in seen} == {10}
    deep, plain = sorted(seen, key=lambda r: r.depth is None)
    assert (deep.temperature, deep.depth, deep.system_prompt_id) == (0.5, 2, "sys-x")
    assert (plain.temperature, plain.depth, plain.system_prompt_id) == (0.0, None, None)
    assert deep.generator == plain.generator == model_name(str(folder))

    records = {r.request_id: r for r in load_trace(str(log)).records}
    assert set(records) == {"deep", "plain"}
    assert (records["deep"].temperature, records["deep"].depth, records["deep"].system_prompt_id) == (0.5, 2, "sys-x")
    assert records["deep"].generator == model_name(str(folder)) and records["deep"].output_tokens == 6
    assert records["plain"].depth is None and records["plain"].output_tokens == 40
