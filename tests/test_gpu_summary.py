"""odma.bench.gpu_summary: the lines gpu_check prints from a bench result, including a result cut short (a burst
at its cap has no ratio, a failed policy says so, an older result without piece timings gives a dash)."""

from __future__ import annotations

import json

from odma.bench import gpu_summary


def _policy(tps: float, **kw) -> dict:
    return {"tokens_per_s": tps, "cut_at_cap": False, "preemptions": 0, "requests": 10, "continued": 0,
            "mean_running": 5.0, "ttft_p50_s": 0.5, **kw}


RESULT = {
    "device": "a GPU", "torch": "2.11", "triton": "3.6", "tests": {"summary": "9 passed in 1.0s"},
    "kernels": {"rows": [
        {"context": 4096, "batch": 64, "result": {"contiguous_us": 200.0, "contiguous_share_of_copy": 0.84,
                                                  "contiguous_vs_paged": 1.1, "contiguous_vs_pieces": 1.02}},
        {"context": 4096, "batch": 16, "result": {"contiguous_us": 150.0, "contiguous_vs_paged": 1.2}},
        {"context": 16384, "batch": 64, "result": {"error": "RuntimeError: out of memory"}},
    ]},
    "engine": {"runs": {"azure-conv": {"work": {"requests": 10}, "skipped": [{"policy": "static", "why": "time cap"}],
                                       "policies": {
        "odma": _policy(1200.0, continued=3),
        "paged": _policy(1000.0, preemptions=2),
        "odma-continue": _policy(1300.0, cut_at_cap=True),
        "odma-pieces": {"error": "RuntimeError: boom"},
    }}}},
    "http": {"http_vs_engine": 0.93, "http_b_vs_engine": 0.8, "server_b_flags": ["--no-engine-process"],
             "tokens_equal": True},
    "peer": {"skipped": "transformers missing"},
}


def test_every_part_in_a_line_or_a_table():
    lines = gpu_summary.summary(RESULT).splitlines()
    assert lines[1] == "tests: 9 passed in 1.0s"
    assert lines[2].endswith("time ÷ contiguous: paged 1.100, pieces 1.020")
    assert lines[3].endswith("paged 1.200, pieces –")  # a result from before piece timings
    assert lines[4] == "kernels 16384 x 64: RuntimeError: out of memory"
    rows = {line.split()[0]: line for line in lines if line.startswith("  ") and line.split()[0] != "policy"}
    assert rows["odma"].split()[1:5] == ["1200", "1.200", "–", "0/10"]  # no static burst: no ratio to it
    assert rows["paged"].split()[1:5] == ["1000", "1.000", "–", "2/10"]
    assert rows["odma-continue"].split()[2] == "–" and rows["odma-continue"].endswith("cut at its cap")
    assert rows["odma-pieces"].split()[1] == "error"
    assert rows["static:"] == "  static: not run (time cap)"
    assert "http ÷ engine 0.93, 0.8 with --no-engine-process; tokens equal: True" in lines
    assert lines[-1] == "peer: transformers missing"


def test_the_command_reads_a_file(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(RESULT))
    assert gpu_summary.main([str(path)]) == 0
    assert "engine azure-conv (10 requests):" in capsys.readouterr().out
    assert gpu_summary.main([]) == 2


def test_a_file_that_is_no_result_is_refused_clearly(tmp_path, capsys):
    """A replay check's list, a broken file or no file: a one-line reason and status 2, no traceback."""
    other, broken = tmp_path / "replay_check.json", tmp_path / "broken.json"
    other.write_text(json.dumps([{"run": "x", "policy": "odma"}]))
    broken.write_text("{")
    for path, reason in ((other, "is not an `odma-bench gpu` result"), (broken, "cannot read"),
                         (tmp_path / "none.json", "cannot read")):
        assert gpu_summary.main([str(path)]) == 2
        assert reason in capsys.readouterr().err
