"""scripts/run_oracle_bound.py: a served burst's own lengths, in the order sent, become the replayed burst, and the
oracle's sjf on them beats fcfs exactly when the lengths differ."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from odma.traces import load_trace

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("run_oracle_bound", ROOT / "scripts" / "run_oracle_bound.py")
rob = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rob)


def _trace_file(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "burst.jsonl"
    with path.open("w") as f:
        for i in range(n):  # the recorded lengths are all 7: only the served ones may differ
            f.write(json.dumps({"request_id": f"r{i}", "prompt": f"question {i}", "prompt_tokens": 20,
                                "output_tokens": 7}) + "\n")
    return path


def test_the_served_lengths_replace_the_recorded_ones_in_the_order_sent(tmp_path):
    trace = load_trace(str(_trace_file(tmp_path, 5)))
    run = {"rate": math.inf, "output_tokens": [["r3", 40], ["r0", None], ["r1", 2], ["r4", 9]]}
    served = rob.realized_trace(run, trace)
    assert [(r.request_id, r.output_tokens) for r in served.records] == [("r3", 40), ("r1", 2), ("r4", 9)]
    assert all(r.arrival_s == 0.0 for r in served.records)


@pytest.mark.parametrize("run, words", [
    ({"rate": math.inf}, "no per-request lengths"),
    ({"rate": 4.0, "output_tokens": [["r0", 3]]}, "for bursts"),
    ({"rate": math.inf, "output_tokens": [["r0", 3], ["elsewhere", 5]]}, "not in the trace"),
])
def test_results_it_cannot_replay_are_refused_in_words(tmp_path, run, words):
    trace = load_trace(str(_trace_file(tmp_path, 2)))
    with pytest.raises(SystemExit, match=words):
        rob.realized_trace(run, trace)


def test_a_peer_result_gives_the_named_stage_and_system():
    result = {"stages": {"burst": {"vllm": {"a": 1}, "vllm+odma": {"a": 2}}}}
    assert rob.stage_result(result, "burst", "vllm+odma") == {"a": 2}
    assert rob.stage_result({"a": 3}, "burst", "vllm") == {"a": 3}  # an odma-bench serve result is one run
    with pytest.raises(SystemExit, match="no system 'odma'"):
        rob.stage_result(result, "burst", "odma")


def test_the_oracle_gains_on_mixed_lengths_and_not_on_equal_ones(tmp_path):
    trace = load_trace(str(_trace_file(tmp_path, 48)))
    mixed = [[f"r{i}", 300 if i % 4 == 0 else 10] for i in range(48)]  # a long one ahead of every three short
    gain = rob.bound(rob.realized_trace({"rate": math.inf, "output_tokens": mixed}, trace), None, 4, 512,
                     "cpu-smollm2")
    assert gain["requests"] == 48 and gain["predictor_gain"] is None
    assert gain["oracle_gain"] > 0.3  # the short ones no longer wait behind the long ones
    equal = [[f"r{i}", 50] for i in range(48)]
    flat = rob.bound(rob.realized_trace({"rate": math.inf, "output_tokens": equal}, trace), None, 4, 512,
                     "cpu-smollm2")
    assert abs(flat["oracle_gain"]) < 0.02
