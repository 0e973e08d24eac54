"""scripts/gpu_check.sh's CPU dry run (tiny shapes, Triton's interpreter): every part of `odma-bench gpu` runs and
reports what a GPU run would, so the one command a lent GPU gets cannot rot unnoticed. Timings here mean nothing."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_check_dry_run_covers_every_part(tmp_path):
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["tiny"] and result["interpreted"]
    rows = result["kernels"]["rows"]
    assert {(r["context"], r["batch"]) for r in rows} == {(64, 1), (64, 4), (256, 1), (256, 4)}
    for r in rows:
        assert r["max_abs_diff"] == 0.0  # pages hold the same K/V as the blocks: the same numbers come out
        assert r["contiguous_us"] > 0 and r["paged_us"] > 0
    assert any(r["splits"] > 1 for r in rows)
    assert "skipped" in result["vmm"]  # virtual memory needs CUDA
    engine = result["engine"]
    assert set(engine["policies"]) == {"static", "odma", "paged", "odma-map"}
    assert engine["policies"]["odma-map"]["growth"] == "map"  # the host's virtual memory on CPU
    for policy, r in engine["policies"].items():
        assert r["errors"] == 0 and r["short"] == 0, policy
        assert r["output_tokens"] == engine["forced_output_tokens"], policy
    assert engine["odma_vs_static"] > 0 and engine["odma_vs_paged"] > 0
