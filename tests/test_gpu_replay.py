"""The GPU bench's burst replayed (odma.analyze.gpu_burst), its step-time profile and fit (gpu_profile, gpu_fit), and
growth by compaction (odma.kv.reclaim.clear_for_growth), which the replay chose for odma on GPUs."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from odma.analyze.gpu_burst import BurstConfig, bench_prompts, odma_memory, run_burst
from odma.analyze.gpu_fit import FITTED, RawRun, fit_profile, read_raw_run
from odma.analyze.gpu_profile import GpuProfile, gpu_profile_names, load_gpu_profile
from odma.errors import ConfigError
from odma.kv import ContiguousKV, ExactPolicy, KVPool, KVRequest

ROOT = Path(__file__).resolve().parent.parent
RAW = ROOT / "docs" / "results" / "gpu"
SMALL = BurstConfig(requests=40, max_tokens=256, max_prompt=512, kv_budget_bytes=160 << 20,
                    swap_space_bytes=64 << 20)


def _needs_trace():
    try:
        bench_prompts(replace(SMALL, requests=1))
    except Exception as exc:  # noqa: BLE001 - the shared datasets are absent on this machine
        pytest.skip(f"azure-conv trace unavailable: {exc}")


def test_the_replay_gives_the_raw_runs_counts():
    """The counts of the H100 and H200 runs (the same on both) come out of the replayed scheduling exactly."""
    _needs_trace()
    run = read_raw_run(RAW / "gpu_rerun_h100.json")
    prompts = bench_prompts(run.config)
    for policy in ("odma", "paged"):
        replayed = run_burst(run.config, policy, prompts=prompts).summary()
        measured = run.policies[policy]
        for key in ("steps", "preemptions", "swap_outs", "migrations", "migrated_tokens", "mean_running",
                    "peak_running"):
            assert replayed[key] == measured[key], (policy, key)


def test_the_fit_recovers_known_parameters():
    _needs_trace()
    truth = GpuProfile(name="truth", device="X", step_ms=5.0, ms_per_1k_context=0.04, paged_read_factor=1.4,
                       ms_per_1k_prefill=20.0, host_ms=1.2, paged_host_ms=2.0, copy_ms_per_gib=1.3, swap_gbps=25.0,
                       ms_per_slide=2.0, prefill_span=16256.0)
    prompts = bench_prompts(SMALL)
    # the same burst twice: odma swapping (the first runs) and packing (it slides blocks, whose cost is fitted too)
    bursts = {(SMALL, memory, True): {p: run_burst(SMALL, p, prompts=prompts,
                                                   engine_overrides=odma_memory(memory) if p == "odma" else None)
                                      for p in ("static", "odma", "paged")} for memory in ("swap", "packed")}
    runs = []
    for (config, memory, _), replayed in bursts.items():
        measured = {}
        for policy, b in replayed.items():
            seconds = truth.breakdown(b.steps, b.paged)["seconds"]
            measured[policy] = {"seconds": seconds, "tokens_per_s": b.output_tokens / seconds,
                                "device_ms_p50": truth.device_p50_ms(b.steps, b.paged),
                                "host_ms_p50": truth.paged_host_ms if b.paged else truth.host_ms}
        runs.append(RawRun(f"synthetic-{memory}.json", "X", config, measured,
                           truth.step_ms + truth.ms_per_1k_context * 16.384, 16384, truth.copy_ms_per_gib, memory,
                           paged_prefixes=True))
    assert sum(s.slides for s in bursts[SMALL, "packed", True]["odma"].steps) > 0
    fitted = fit_profile(runs, bursts, "fitted")
    for name in FITTED:
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.05), name
    assert fitted.paged_host_ms == pytest.approx(truth.paged_host_ms)
    assert fitted.copy_ms_per_gib == truth.copy_ms_per_gib


def test_a_shipped_profile_loads_and_replays_deterministically():
    _needs_trace()
    assert {"h100-7b", "h200-7b"} <= set(gpu_profile_names())
    profile = load_gpu_profile("h100-7b")
    assert profile.device == "H100" and profile.paged_read_factor > 1
    first, second = (run_burst(SMALL, "odma") for _ in range(2))
    assert first.summary() == second.summary()
    assert profile.breakdown(first.steps, False) == profile.breakdown(second.steps, False)
    assert 0 < profile.breakdown(first.steps, False)["seconds"] < math.inf


def test_profiles_refuse_bad_values(tmp_path):
    with pytest.raises(ConfigError, match="unknown GPU profile"):
        load_gpu_profile("no-such-gpu")
    bad = json.loads((Path(__file__).resolve().parent.parent / "odma/analyze/gpu_profiles/h200-7b.json").read_text())
    bad["swap_gbps"] = -1
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match="swap_gbps"):
        load_gpu_profile(str(tmp_path / "bad.json"))
    with pytest.raises(ConfigError, match="odma memory"):
        odma_memory("teleport")


def _fragmented(compact: bool) -> ContiguousKV:
    """Five blocks of 32 tokens filling 160; the first and fourth end: 64 tokens free, in two holes of 32."""
    kv = ContiguousKV(KVPool(160, ExactPolicy(), align=16, large_share=0.0), compact_growth=compact)
    for i in range(5):
        assert kv.admit(KVRequest(f"r{i}", 16, 100, predicted_tokens=16)) is not None
        kv.grow(f"r{i}", 32)
    kv.evict("r0")
    kv.evict("r3")
    return kv


def test_growth_that_fragmentation_refuses_compacts_instead():
    # r1 must grow to 48 tokens (its neighbour r2 is live): 64 are free, but no range of 48
    assert _fragmented(compact=False).grow("r1", 33) is None  # without compaction: preempt or wait
    kv = _fragmented(compact=True)
    growth = kv.grow("r1", 33)
    assert growth is not None and growth.capacity >= 48 and growth.copied_tokens == 32  # r1's own tokens, once
    assert kv.compactions == 1
    assert kv.relocated_tokens == 32  # one 32-token block was moved out of the way (here: its neighbour)
    kv.check()


def test_compaction_never_makes_room_that_is_not_there():
    kv = _fragmented(compact=True)
    kv.admit(KVRequest("r5", 16, 100, predicted_tokens=16))  # 32 more held: 32 free, fewer than a growth needs
    assert kv.grow("r1", 33) is None
    assert kv.compactions == 0 and kv.relocated_tokens == 0
    kv.check()


def test_the_memory_modes_change_what_they_say():
    _needs_trace()
    prompts = bench_prompts(SMALL)
    runs = {m: run_burst(SMALL, "odma", engine_overrides=odma_memory(m), prompts=prompts).summary()
            for m in ("swap", "compact", "wait")}
    assert runs["swap"]["swap_outs"] > 0 and runs["swap"]["compactions"] == 0
    assert runs["compact"]["compactions"] > 0 and runs["compact"]["swap_outs"] < runs["swap"]["swap_outs"]
    assert runs["wait"]["swap_outs"] == 0


def test_the_bench_default_packs_and_headroom_waits_instead_of_preempting():
    """odma-bench gpu's default memory (the first of ODMA_MEMORY) packs odma's blocks, as the engine does on an
    accelerator; "headroom" admits within θ of the pool and lets a block that cannot grow wait. On a small burst both
    preempt fewer requests than compaction alone, which swaps them out."""
    from odma.analyze.gpu_burst import HEADROOM_THETA, ODMA_MEMORY
    from odma.engine.config import PACKED_THETA, EngineConfig

    assert ODMA_MEMORY[0] == "packed"
    packed = odma_memory("packed")
    assert packed["packing"] and packed["admission_theta"] == PACKED_THETA and packed["preempt"] == "wait"
    engine = EngineConfig(device="cuda", **packed)
    assert engine.pool == engine.resolved_pool  # the preset spells out what packing sets: a run's config says it
    assert engine.resolved_preempt == "wait" == EngineConfig(device="cuda").resolved_preempt
    assert EngineConfig(device="cpu").resolved_preempt == "swap"  # a CPU pool does not pack: it swaps as before
    assert EngineConfig(device="cuda", policy="static").resolved_preempt == "swap"
    first = odma_memory("packed-swap")  # the first packed runs: the same pool and θ, swapping
    assert not first["packing"] and first["pool"] == packed["pool"] and "preempt" not in first
    assert EngineConfig(device="cuda", **first).resolved_preempt == "swap"
    assert EngineConfig(device="cuda", **odma_memory("swap")).resolved_pool == EngineConfig(device="cpu").pool
    headroom = odma_memory("headroom")
    assert headroom["preempt"] == "wait" and headroom["admission_theta"] == HEADROOM_THETA < 1
    assert headroom["pool"].compact_growth and not headroom["packing"]
    _needs_trace()
    prompts = bench_prompts(SMALL)
    old = run_burst(SMALL, "odma", engine_overrides=odma_memory("compact"), prompts=prompts).summary()
    assert old["preemptions"] > 0
    for fields in (packed, headroom, first):
        new = run_burst(SMALL, "odma", engine_overrides=fields, prompts=prompts).summary()
        assert new["preemptions"] < old["preemptions"] / 4
        assert new["output_tokens"] == old["output_tokens"]  # every request still finishes
        if fields is packed:
            assert new["preemptions"] == 0  # a block that finds no room waits
    assert run_burst(SMALL, "odma", engine_overrides=packed, prompts=prompts).summary()["slides"] > 0


def test_a_study_layer_over_the_kv_sees_every_admission_and_release():
    """`run_burst(wrap_kv=...)`: a layer a study puts over the engine's KV manager (another memory design, modelled)
    stands where the manager stood, for the scheduler too; one that only forwards changes nothing."""

    class Forwarding:
        def __init__(self, kv, scheduler) -> None:
            self._kv, self.scheduler, self.calls = kv, scheduler, {"admit": 0, "release": 0, "evict": 0}

        def __getattr__(self, name):
            return getattr(self._kv, name)

        def admit(self, req):
            handle = self._kv.admit(req)
            self.calls["admit"] += handle is not None
            return handle

        def release(self, request_id, realized_output):
            self.calls["release"] += 1
            return self._kv.release(request_id, realized_output)

        def evict(self, request_id):
            self.calls["evict"] += 1
            return self._kv.evict(request_id)

    _needs_trace()
    prompts = bench_prompts(SMALL)
    layers = []

    def wrap(kv, scheduler):
        layers.append(Forwarding(kv, scheduler))
        return layers[-1]

    plain = run_burst(SMALL, "odma", engine_overrides=odma_memory("packed"), prompts=prompts)
    wrapped = run_burst(SMALL, "odma", engine_overrides=odma_memory("packed"), prompts=prompts, wrap_kv=wrap)
    assert wrapped.summary() == plain.summary() and wrapped.steps == plain.steps
    (layer,) = layers
    assert layer.scheduler.kv is layer and not layer.scheduler.maps_prefixes  # it maps nothing: prefixes are copied
    # every request (and the six warm-up ones) admitted and released once: packing preempts nobody
    assert layer.calls == {"admit": SMALL.requests + 6, "release": SMALL.requests + 6, "evict": 0}


def test_a_raw_run_is_replayed_with_the_odma_memory_it_ran(tmp_path):
    """fit-gpu replays each run's odma as the run ran it: the recorded --odma-memory, "swap" for the first runs (no
    compaction, no waiting), and a clear error where a compacting run does not say which preset it was."""
    from odma.analyze.gpu_fit import read_raw_run

    assert read_raw_run(RAW / "gpu_rerun_h100.json").odma_memory == "swap"
    raw = json.loads((RAW / "gpu_rerun_h100.json").read_text())
    raw["engine"]["policies"]["odma"]["compact_growth"] = True
    (tmp_path / "unsaid.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="odma-memory"):
        read_raw_run(tmp_path / "unsaid.json")
    raw["engine"]["odma_memory"] = "packed"
    (tmp_path / "packed.json").write_text(json.dumps(raw))
    assert read_raw_run(tmp_path / "packed.json").odma_memory == "packed"


def test_a_run_of_several_traces_gives_one_raw_run_each(tmp_path):
    """The bench's runs keyed by trace (`engine.runs`) read as one RawRun each, equal to the one-run format's;
    odma under another predictor (the learned one, the oracle) is left out, odma:median is the replay's odma."""
    from odma.analyze.gpu_fit import read_raw_runs

    old = json.loads((RAW / "gpu_rerun_h100.json").read_text())
    engine = old["engine"]
    work = {k: engine[k] for k in ("requests", "max_tokens", "kv_budget")}
    median = dict(engine["policies"]["odma"], predictor="running-median")
    runs = {"azure-conv": {"trace": "azure-conv", "work": work, "policies": dict(engine["policies"])},
            "again": {"trace": "azure-conv", "work": work,
                      "policies": {"odma:median": median, "odma:default": dict(median, tokens_per_s=1.0),
                                   "paged": engine["policies"]["paged"]}},
            "broken": {"trace": "nq", "error": "no data"}}
    new = dict(old, engine={"model": engine["model"], "runs": runs})
    (tmp_path / "runs.json").write_text(json.dumps(new))
    first, second = read_raw_runs(tmp_path / "runs.json")
    one = read_raw_run(RAW / "gpu_rerun_h100.json")
    assert read_raw_runs(RAW / "gpu_rerun_h100.json") == [one]
    assert replace(first, path=one.path, several=False) == one
    assert first.name == "runs azure-conv" and one.name == "gpu_rerun_h100"  # a file of several runs names the trace
    assert set(second.policies) == {"odma", "paged"} and second.policies["odma"]["tokens_per_s"] != 1.0
    assert second.config == first.config
    # the paged pool of these runs shared no prefixes (no prefix_maps recorded): replayed so; a run that records
    # its maps is replayed with them
    assert not first.paged_prefixes and not second.paged_prefixes
    runs["again"]["policies"]["paged"] = dict(engine["policies"]["paged"], prefix_maps=0)
    (tmp_path / "runs.json").write_text(json.dumps(dict(old, engine={"model": engine["model"], "runs": runs})))
    first, second = read_raw_runs(tmp_path / "runs.json")
    assert not first.paged_prefixes and second.paged_prefixes and first.burst_key != second.burst_key


def test_a_file_that_is_not_a_raw_run_is_named(tmp_path):
    """A JSON that is not a bench result (a replay's rows, a list) stops the fit with its name, not a traceback."""
    from odma.analyze.gpu_fit import read_raw_runs

    (tmp_path / "rows.json").write_text(json.dumps([{"policy": "paged"}]))
    with pytest.raises(ConfigError, match="rows.json: not a raw odma-bench gpu result"):
        read_raw_runs(tmp_path / "rows.json")
    with pytest.raises(ConfigError, match="rows.json: no engine part"):
        read_raw_run(tmp_path / "rows.json")


def test_the_replay_builds_the_bench_prompts():
    """The replay's prompts are the bench's (`gpu_work.burst_from_records`, a layer above the replay): random ids
    for a trace without text, the chat-templated, tokenized texts for one with text (its prefix sharing depends on
    them)."""
    from odma.analyze.gpu_burst import bench_records
    from odma.bench.gpu_work import burst_from_records

    _needs_trace()
    for config in (replace(SMALL, requests=8), replace(SMALL, trace="sharegpt", requests=8),
                   replace(SMALL, trace="sharegpt-chat", requests=24, max_prompt=1 << 20)):
        try:
            records = bench_records(config)
            prompts, lengths = bench_prompts(config)
        except Exception as exc:  # noqa: BLE001 - the shared datasets or the tokenizer are absent here
            pytest.skip(f"{config.trace} unavailable: {exc}")
        tokenizer = None
        if records[0].prompt:
            from odma.tokenizer import load_tokenizer

            tokenizer = load_tokenizer("smollm2")
        work = burst_from_records(config.trace, records, max_prompt=config.max_prompt, max_tokens=config.max_tokens,
                                  kv_budget="1GiB", vocab_size=config.vocab_size, tokenizer=tokenizer)
        assert prompts == [list(p) for p in work.prompts] and lengths == list(work.lengths)
        if config.trace == "sharegpt-chat":  # turns sent with their history: the lengths the trace counted for it
            assert any(r.depth for r in records)
            for p, r in zip(prompts, records):
                assert abs(len(p) - r.prompt_tokens) <= 0.02 * r.prompt_tokens + 2, (r.request_id, len(p))


def test_a_move_over_its_own_place_is_copied_twice():
    """The replay's mover counts what `copy_kv` copies: a move apart once, a move that overlaps its old place (in
    place with a new capacity, a slide) twice, through a temporary; a move onto itself nothing."""
    from odma.analyze.gpu_burst import CopyCounter
    from odma.kv.blocks import Block

    counter = CopyCounter()
    counter.copy(Block(0, 64, 0), Block(128, 64, 0), 40)  # apart
    assert counter.tokens == 40
    counter.copy(Block(0, 64, 0), Block(0, 128, 0), 40)  # grown in place: its layout changes
    counter.copy(Block(64, 64, 0), Block(32, 64, 0), 10)  # slid down over a gap of 32
    assert counter.tokens == 40 + 80 + 20
    counter.copy(Block(0, 64, 0), Block(0, 64, 0), 40)
    assert counter.tokens == 140


def test_a_slide_costs_its_planning_beside_the_step():
    from odma.analyze.gpu_burst import StepRecord

    profile = load_gpu_profile("h200-7b")
    assert profile.ms_per_slide > 0  # fitted on the packing runs
    plain = StepRecord(decodes=4, context=4000, prefill=(), copied_tokens=0, swap_tokens=0, swaps=0, running=4)
    slid = replace(plain, slides=3)
    extra = profile.breakdown([slid], False)["host_s"] - profile.breakdown([plain], False)["host_s"]
    assert extra == pytest.approx(3 * profile.ms_per_slide / 1e3)
    assert profile.device_ms(slid, False) == profile.device_ms(plain, False)


def test_a_shipped_profile_is_checked_against_runs_outside_its_fit(capsys, tmp_path):
    """fit-gpu --profile fits nothing: it replays the runs of the profile's device and prints measured against
    replayed; runs of another device only are a clear error."""
    from odma.analyze.cli import main

    assert main(["fit-gpu", "--profile", "h100-7b", str(RAW / "gpu_rerun_h100.json"),
                 "--json", str(tmp_path / "rows.json")]) == 0
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert {r["policy"] for r in rows} >= {"static", "odma", "paged"}
    assert all(abs(r["error"]) < 0.1 for r in rows if r["policy"] in ("static", "odma", "paged"))
    assert "| gpu_rerun_h100 (H100) | odma/paged |" in capsys.readouterr().out
    assert main(["fit-gpu", "--profile", "h200-7b", str(RAW / "gpu_rerun_h100.json")]) == 2
    assert "no H200 run" in capsys.readouterr().err


def test_a_run_of_odma_continuing_blocks_is_replayed_and_compared_but_not_fitted():
    """odma-continue (--continue-growth) reads pieces, whose cost no profile models: fit-gpu checks its counts and
    compares its tok/s (and its ratio to paged) but fits nothing on it."""
    from odma.analyze.gpu_fit import compare, replay_runs

    _needs_trace()
    config = replace(SMALL, kv_budget_bytes=64 << 20)
    profile = load_gpu_profile("h200-7b")
    continuing = {**odma_memory("packed")}
    continuing["pool"] = replace(continuing["pool"], continue_growth=True)
    prompts = bench_prompts(config)
    measured = {}
    for policy, overrides in (("odma", odma_memory("packed")), ("paged", None), ("static", None),
                              ("odma-continue", continuing)):
        b = run_burst(config, "odma" if policy == "odma-continue" else policy, prompts=prompts,
                      engine_overrides=overrides)
        # the decode context read through pieces: only where blocks went on elsewhere
        assert (sum(s.piece_context for s in b.steps) > 0) == (policy == "odma-continue"), policy
        assert all(s.piece_context <= s.context for s in b.steps)
        seconds = profile.breakdown(b.steps, b.paged)["seconds"]
        measured[policy] = {**b.summary(), "seconds": seconds, "tokens_per_s": b.output_tokens / seconds}
    assert measured["odma-continue"]["continued"] > 0 and measured["odma"]["continued"] == 0
    assert measured["odma-continue"]["slides"] < measured["odma"]["slides"]  # it continued where odma slid
    run = RawRun("synthetic.json", "H200", config, measured, None, 0, 1.3, "packed", paged_prefixes=True)
    bursts = replay_runs([run])  # the counts checked: equal
    rows = {r["policy"]: r for r in compare(profile, [run], bursts)}
    assert rows["odma-continue"]["error"] == pytest.approx(0, abs=1e-9)
    assert rows["odma-continue/paged"]["measured_tps"] > rows["odma/paged"]["measured_tps"]
    ran = measured["odma-continue"]
    with pytest.raises(ConfigError, match="odma-continue"):  # a count the replay does not give is an error
        replay_runs([replace(run, policies={**measured, "odma-continue": {**ran, "steps": ran["steps"] + 1}})])
    slow = {**measured, "odma-continue": {**ran, "seconds": 1e6}}  # the fit ignores it: the other three decide
    fitted = fit_profile([replace(run, policies=slow)], bursts, "fitted", copy_ms_per_gib=1.3)
    alone = fit_profile([replace(run, policies={k: v for k, v in measured.items() if k != "odma-continue"})],
                        bursts, "fitted", copy_ms_per_gib=1.3)
    assert fitted.step_ms == pytest.approx(alone.step_ms)
