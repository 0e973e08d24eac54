"""odma-bench batched: the engine without its server at llama-batched-bench's shape, every token accounted for."""

from __future__ import annotations

import pytest

from odma.bench import batched_bench
from odma.engine.testing import tiny_engine
from odma.models.tiny import make_tiny_model


def test_each_batch_reports_prefill_decode_and_the_whole_run(tmp_path):
    engine = tiny_engine(make_tiny_model(tmp_path / "m", "llama"), kv_budget="8MiB")
    rows = batched_bench.measure(engine, [1, 3], 12, 6, repeats=2)
    assert [r["batch"] for r in rows] == [1, 3]
    assert engine.pool.stats().live_blocks == 0  # every request ran to its end
    for row in rows:
        assert len(row["runs"]) == 2 and (row["pp"], row["tg"]) == (12, 6)
        for run in row["runs"]:
            # every request's first token ends the prefill phase; the whole run holds both phases
            assert 0 < run["t_pp_s"] <= run["t_s"]
            assert abs(run["t_tg_s"] - (run["t_s"] - run["t_pp_s"])) < 1e-3
            # rates from the unrounded times; the times kept to 0.1 ms
            assert run["output_tps"] == pytest.approx(row["batch"] * 6 / run["t_s"], rel=2e-4 / run["t_s"] + 1e-3)
            assert run["s_pp"] == pytest.approx(row["batch"] * 12 / run["t_pp_s"], rel=2e-4 / run["t_pp_s"] + 1e-3)


def test_a_malformed_shape_or_batch_is_refused_in_words():
    from odma.errors import ConfigError

    assert batched_bench.parse_shape("128/64", "1,16") == (128, 64, [1, 16])
    for shape, batch in (("128", "1"), ("128/x", "1"), ("128/64", "0"), ("0/64", "4")):
        with pytest.raises(ConfigError, match="--shape"):
            batched_bench.parse_shape(shape, batch)


def test_odma_bench_prints_a_refused_setting_without_a_traceback(capsys):
    from odma.bench.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["batched", "--shape", "12"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "odma-bench batched: error: --shape '12'" in err and "Traceback" not in err
