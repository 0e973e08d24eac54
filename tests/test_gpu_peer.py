"""The peer part of `odma-bench gpu` (transformers' continuous batching on the burst odma's engine runs): its cache
holds the KV budget's bytes and no more, and on the tiny model on CPU every request generates exactly its forced
length, with real timings. Timings here mean nothing."""

from __future__ import annotations

import argparse

import pytest

from odma.bench import gpu_bench, gpu_peer, gpu_report

pytest.importorskip("transformers")
if gpu_peer.unavailable() is not None:
    pytest.skip(gpu_peer.unavailable(), allow_module_level=True)


def test_kv_blocks_fill_the_budget_with_the_reserved_blocks_counted():
    # the 7B shape in bf16: 16 tokens x 28 layers x K,V x 4 heads x 128 x 2 bytes = 917,504 bytes a block
    block = 16 * 28 * 2 * 4 * 128 * 2
    blocks = gpu_peer.kv_blocks(4 << 30, 16, 28, 4, 128, 2)
    assert (blocks + gpu_peer.RESERVED_BLOCKS) * block <= 4 << 30 < (blocks + gpu_peer.RESERVED_BLOCKS + 1) * block
    assert blocks == 4679
    with pytest.raises(ValueError, match="holds no block"):
        gpu_peer.kv_blocks(2 * block, 16, 28, 4, 128, 2)  # only the reserved blocks


def _args(tmp_path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    gpu_bench.add_arguments(parser)
    return parser.parse_args(["--device", "cpu", "--tiny", "--rounds", "1", "--out", str(tmp_path / "r.json"),
                              *extra])


def test_the_peer_generates_every_forced_token_on_the_budget(tmp_path):
    args = _args(tmp_path)
    report = gpu_report.Report({}, args.out)
    out = gpu_peer.bench_peer(args, "cpu", "float32", report, gpu_report.Cap(120),
                              lambda vocab: gpu_bench.peer_work(args, vocab))
    assert "error" not in out and "skipped" not in out, out
    work = gpu_bench.peer_work(args, 256)
    assert out["requests"] == work.requests == 8 and out["completed"] == 8 and not out["cut_at_cap"]
    assert out["output_tokens"] == out["forced_output_tokens"] == work.output_tokens > work.requests
    assert out["exact_length"] == 8 and out["errors"] == 0 and out["all_forced"]
    assert out["tokens_per_s"] > 0 and out["seconds"] > 0
    assert 0 < out["ttft_s_p50"] <= out["ttft_s_p99"] <= out["seconds"]
    assert out["settings"]["num_blocks"] == out["num_blocks"] == gpu_peer.kv_blocks(48 << 10, 16, 2, 2, 16, 4)
    assert out["kv_cache_bytes"] is None or out["kv_cache_bytes"] <= out["kv_budget_bytes"]
    assert report.result["peer"] is out  # saved as it goes


def test_a_burst_past_its_cap_is_reported_cut_not_complete(tmp_path):
    args = _args(tmp_path)
    out = gpu_peer.bench_peer(args, "cpu", "float32", gpu_report.Report({}, None), gpu_report.Cap(0),
                              lambda vocab: gpu_bench.peer_work(args, vocab))
    assert out.get("cut_at_cap") is True and not out.get("all_forced"), out


def test_the_peer_is_a_part_of_the_bench_with_a_cap():
    assert "peer" in gpu_bench.PARTS and gpu_bench.DEFAULT_CAPS["peer"] == 75
