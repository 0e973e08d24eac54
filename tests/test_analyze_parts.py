"""odma-analyze parts: profiles and the cost model, the paged model, policy names, boundaries, the CLI."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from odma.analyze import cli
from odma.analyze.boundaries import BoundarySpec, analyze
from odma.kv import KVRequest, PagedKV
from odma.analyze.policies import BuildContext, bucket_manager, parse_policies, parse_policy
from odma.analyze.profiles import GIB, PROFILES, CostModel, StepWork, load_profile
from odma.config import ReservationTable
from odma.errors import ConfigError, InvalidRequestError, UnknownRequestError

FIXTURE = Path(__file__).resolve().parent.parent / "datasets" / "fixtures" / "analyze_trace.jsonl"


def test_qwen7b_profile_matches_its_config():
    p = PROFILES["mlu370-qwen7b"]
    assert p.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2  # K and V, 28 layers, 4 KV heads, head_dim 128, bf16
    assert p.model.params == pytest.approx(7.62e9, rel=0.01)
    assert p.kv_budget_bytes == int(24 * GIB * 0.9) - p.model.weight_bytes


def test_cost_model_is_a_roofline_with_a_paged_read_penalty():
    p = PROFILES["mlu370-qwen7b"]
    bw = p.device.bandwidth_bytes_s
    weights = p.model.streamed_weight_bytes / bw
    contiguous, paged = CostModel(p), CostModel(p, paged=True)
    kv = 10_000 * p.kv_bytes_per_token / bw
    assert contiguous.step_seconds(StepWork(10, 10_000, 0)) == pytest.approx(weights + kv)
    assert paged.step_seconds(StepWork(10, 10_000, 0)) == pytest.approx(weights + kv / 0.5)
    copy = 2 * 100 * p.kv_bytes_per_token / bw
    assert contiguous.step_seconds(StepWork(10, 10_000, 0, 100)) == pytest.approx(weights + kv + copy)
    flops = p.model.flops_per_token / (p.device.peak_flops * p.device.compute_efficiency)
    assert contiguous.step_seconds(StepWork(1, 0, 50_000)) == pytest.approx(50_001 * flops)  # prefill-bound


def test_profile_from_a_json_file(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}))
    prof = tmp_path / "dev.json"
    device = {"name": "d", "memory_gib": 1, "bandwidth_bytes_s": 1e10, "peak_flops": 1e12}
    prof.write_text(json.dumps({"name": "tiny", "model_config": "config.json", "device": device}))
    p = load_profile(str(prof))
    assert p.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2
    assert p.kv_budget_tokens > 0
    with pytest.raises(ConfigError):
        load_profile(str(tmp_path / "missing.json"))


def test_paged_counts_pages_and_keeps_a_watermark():
    kv = PagedKV(total_tokens=160, page_tokens=16, watermark=0.1)  # 10 pages, 1 held back at admission
    a = kv.admit(KVRequest("a", 15, 100))
    assert a.capacity == 16 and a.block is None  # prompt + first token = 16 → one page; pages are no range
    assert kv.admit(KVRequest("b", 16, 100)).capacity == 32  # 17 tokens → two pages
    assert kv.grow("a", 17).capacity == 32 and a.capacity == 32  # the handle follows
    assert kv.grow("a", 18).capacity == 32  # same page, nothing allocated
    assert not kv.can_admit(KVRequest("c", 80, 100))
    assert kv.admit(KVRequest("c", 80, 100)) is None  # 6 pages would leave 0 < watermark 1
    assert kv.grow("b", 33 + 16 * 5).capacity == 16 * 8  # growth may use the watermark
    assert kv.reserved_tokens == 16 * 10
    assert kv.grow("b", 33 + 16 * 6) is None
    kv.release("a", 3)
    kv.evict("b")
    kv.check()
    assert kv.free_pages == 10
    with pytest.raises(UnknownRequestError):
        kv.release("a", 1)


def test_paged_maps_whole_shared_pages_and_frees_each_with_its_last_holder():
    kv = PagedKV(total_tokens=160, page_tokens=16, watermark=0.0)  # 10 pages
    kv.admit(KVRequest("a", 40, 100))  # 41 tokens → 3 pages
    assert kv.shareable_tokens(37) == 32
    b = kv.admit_sharing(KVRequest("b", 50, 100), "a", 32)  # 2 pages mapped + 2 fresh for the other 19 tokens
    assert b.pages[:2] == kv._pages["a"][:2] and b.capacity == 64 and kv.free_pages == 10 - 3 - 2
    for bad in (20, 64):  # not whole pages; more than a holds
        with pytest.raises(InvalidRequestError):
            kv.admit_sharing(KVRequest("c", 50, 100), "a", bad)
    with pytest.raises(UnknownRequestError):
        kv.admit_sharing(KVRequest("c", 50, 100), "gone", 16)
    assert kv.admit_sharing(KVRequest("c", 200, 400), "a", 32) is None  # 11 fresh pages: refused, nothing taken
    kv.check()
    assert kv.free_pages == 5 and "c" not in kv._pages
    kv.release("a", 1)  # its third page is free now, the two it shares stay with b
    kv.check()
    assert kv.free_pages == 6
    kv.evict("b")
    kv.check()
    assert kv.free_pages == 10 and kv.reserved_tokens == 0


def test_policy_names_and_overrides():
    spec = parse_policy("odma/growth=double/large=0.2/alpha=0.5/scale=0.7/bounds=quantile")
    assert (spec.growth, spec.large_share, spec.alpha, spec.scale, spec.bounds) == ("double", 0.2, 0.5, 0.7, "quantile")
    assert [p.name for p in parse_policies("static, paged")] == ["static", "paged"]
    assert len(parse_policies("all")) >= 9
    bad_names = ("nope", "odma/colour=red", "odma/growth=sideways", "oracle/growth=next", "odma/large=1.5",
                 "static,static", "odma/full=sometimes", "odma/ceiling=0", "odma/ceiling=many")
    for bad in bad_names:
        with pytest.raises(ConfigError):
            parse_policies(bad)


def test_only_policies_that_take_the_calibration_take_its_ceiling():
    ctx = BuildContext(total_tokens=1 << 16, max_new_tokens=2048, bootstrap=tuple(range(16, 2048, 8)),
                       predictor_alpha=3.0, predictor_ceiling=500.0)
    published = bucket_manager(parse_policy("odma-published"), ctx)
    assert (published.alpha, published.ceiling) == (3.0, 500.0)
    assert published.select(1500.0, 0.5).bound == published.next_above(500).bound  # not the large bucket
    for name in ("s3", "odma", "oracle-bucketed"):  # S3 has no ceiling; odma reserves half of the raw L̂
        assert bucket_manager(parse_policy(name), ctx).ceiling == math.inf
    assert bucket_manager(parse_policy("odma/ceiling=300"), ctx).ceiling == 300.0
    assert bucket_manager(parse_policy("odma/alpha=cal"), ctx).ceiling == 500.0  # α and ceiling come together
    assert bucket_manager(parse_policy("odma/alpha=cal/ceiling=inf"), ctx).ceiling == math.inf


def test_the_reservation_table_comes_with_the_calibration_only():
    table = ReservationTable((100.0,), (200, 1000))
    ctx = BuildContext(total_tokens=1 << 16, max_new_tokens=2048, bootstrap=tuple(range(16, 2048, 8)),
                       predictor_alpha=3.0, predictor_ceiling=500.0, predictor_table=table)
    published = bucket_manager(parse_policy("odma-published"), ctx)
    assert (published.table, published.alpha, published.ceiling) == (table, 0.0, math.inf)
    assert published.select(50.0, 0.5).bound == published.next_above(200).bound
    assert bucket_manager(parse_policy("odma/alpha=cal"), ctx).table == table
    assert bucket_manager(parse_policy("odma/table=on"), ctx).table == table
    for name in ("s3", "odma", "oracle-bucketed", "grow-buckets", "odma-published/table=off",
                 "odma-published/alpha=1", "odma/alpha=cal/ceiling=300"):
        assert bucket_manager(parse_policy(name), ctx).table is None, name
    assert bucket_manager(parse_policy("odma-published/table=off"), ctx).alpha == 3.0
    no_table = dataclasses.replace(ctx, predictor_table=None)
    assert bucket_manager(parse_policy("odma-published"), no_table).alpha == 3.0
    with pytest.raises(ConfigError, match="no reservation table"):
        bucket_manager(parse_policy("odma/table=on"), no_table)
    with pytest.raises(ConfigError):
        parse_policy("odma/table=maybe")


def test_boundaries_of_constant_lengths_are_known():
    result = analyze([20] * 1000, BoundarySpec(buckets=4, window=500, step=100, max_new_tokens=512))
    for m in result["methods"].values():
        last = m["epochs"][-1]
        assert last["bounds"] == [32]  # align 16 of 20, duplicates merged
        assert last["efficiency"] == pytest.approx(20 / 32)
        assert last["occupancy"] == [1.0, 0.0]  # everything in bucket 0, nothing in the large bucket


def test_optimal_bounds_never_reserve_more_than_quantiles():
    lengths = [int(math.exp(3 + 2 * ((i * 7919) % 1000) / 1000)) for i in range(3000)]
    result = analyze(lengths, BoundarySpec(buckets=6, window=1000, step=250, max_new_tokens=2048))
    m = result["methods"]
    assert m["optimal"]["mean_efficiency"] >= m["quantile"]["mean_efficiency"] - 1e-9


def test_cli_replay_and_boundaries(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert cli.main(["replay", "--trace", str(FIXTURE), "--policies", "static,odma,oracle,paged", "--predictor",
                     "noisy-oracle:0.8", "--budget-tokens", "3000", "--no-progress", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["policies"]) == {"static", "odma", "oracle", "paged"}
    assert all(r["lost"] == 0 for r in data["policies"].values())
    assert "x oracle" in capsys.readouterr().out
    png, bj = tmp_path / "b.png", tmp_path / "b.json"
    assert cli.main(["boundaries", "--trace", str(FIXTURE), "--buckets", "3", "--window", "20", "--step", "10",
                     "--plot", str(png), "--json", str(bj)]) == 0
    assert png.stat().st_size > 0 and json.loads(bj.read_text())["requests"] == 60


def test_cli_reports_bad_input_without_a_traceback(capsys):
    assert cli.main(["replay", "--trace", "no-such-trace", "--no-progress"]) == 2
    assert "unknown trace" in capsys.readouterr().err
