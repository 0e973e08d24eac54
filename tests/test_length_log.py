"""The realized-length log survives a crash mid-append: a torn last line is repaired on open, and readers
skip what they cannot parse, with a warning."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest

from odma.engine.length_log import LengthLog, read_realized_lengths
from odma.engine.sampling import SamplingParams
from odma.engine.sequence import Sequence
from odma.errors import ConfigError
from odma.traces import load_trace


def _finished(rid: str, generated: int) -> Sequence:
    seq = Sequence(rid, [1, 2, 3], SamplingParams(max_tokens=64))
    seq.output_ids = list(range(generated))
    seq.finish_reason = "stop"
    return seq


def _write(path, *seqs, model: str = "m", **options) -> None:
    log = LengthLog(path, policy="odma", model=model, **options)
    for seq in seqs:
        log.write(seq)
    log.close()


def test_a_torn_last_line_is_cut_and_the_next_record_is_kept(tmp_path):
    path = tmp_path / "lengths.jsonl"
    _write(path, _finished("a", 5), _finished("b", 7))
    whole = path.read_bytes()
    path.write_bytes(whole[:-20])  # a crash in the middle of the last record
    _write(path, _finished("c", 9))
    lines = path.read_text().splitlines()
    assert [json.loads(line)["request_id"] for line in lines] == ["a", "c"]
    assert read_realized_lengths(path, model="m") == [5, 9]


def test_a_whole_last_record_without_its_newline_is_kept(tmp_path):
    path = tmp_path / "lengths.jsonl"
    _write(path, _finished("a", 5))
    path.write_bytes(path.read_bytes().rstrip(b"\n"))
    _write(path, _finished("b", 6))
    assert read_realized_lengths(path) == [5, 6]


def test_unreadable_lines_are_skipped_with_a_warning(tmp_path, caplog):
    path = tmp_path / "lengths.jsonl"
    _write(path, _finished("a", 5))
    with path.open("a") as fh:
        fh.write("{not json\n[1, 2]\n\xff\xfe\n")
    _write(path, _finished("b", 6))
    with caplog.at_level(logging.WARNING, logger="odma.engine.length_log"):
        assert read_realized_lengths(path) == [5, 6]
    assert "skipped 3 line(s)" in caplog.text


# -- a damaged log never stops a start, and its damage never shifts the bucket bounds -----------------------

BAD_LENGTHS = ["Infinity", "-Infinity", "NaN", "-5", "1e300", "12.0", "true", "null", '"12"', "[3]"]


def _with_damaged_lines(path, model: str = "m") -> None:
    _write(path, *(_finished(f"ok{i}", 10 + i) for i in range(40)), model=model)
    with path.open("a") as fh:
        for bad in BAD_LENGTHS:
            fh.write(json.dumps({"model": model})[:-1] + f', "output_tokens": {bad}}}\n')
        fh.write(json.dumps({"model": model, "output_tokens": 7, "prompt_tokens": -1}) + "\n")


def test_lengths_that_are_not_integers_in_range_are_skipped_with_one_warning(tmp_path, caplog):
    path = tmp_path / "lengths.jsonl"
    _with_damaged_lines(path)
    with caplog.at_level(logging.WARNING, logger="odma.engine.length_log"):
        assert read_realized_lengths(path, model="m") == [10 + i for i in range(40)]
    assert len(caplog.records) == 1 and f"skipped {len(BAD_LENGTHS) + 1} line(s)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="odma.engine.length_log"):
        assert read_realized_lengths(path, model="m", max_length=30) == [10 + i for i in range(21)]
    assert f"skipped {len(BAD_LENGTHS) + 1 + 19} line(s)" in caplog.text


def test_an_engine_starts_over_a_damaged_log_with_the_bounds_of_its_good_lines(tmp_path):
    from odma.engine.testing import tiny_engine
    from odma.models.tiny import make_tiny_model

    folder = make_tiny_model(tmp_path / "tiny")
    damaged, clean = tmp_path / "damaged.jsonl", tmp_path / "clean.jsonl"
    _with_damaged_lines(damaged, model=str(folder))
    _write(clean, *(_finished(f"ok{i}", 10 + i) for i in range(40)), model=str(folder))
    bounds = []
    for path in (damaged, clean):
        engine = tiny_engine(folder, length_log=path)
        bounds.append(engine.policy.buckets.bounds)
        engine.close()
    assert bounds[0] == bounds[1]


# -- an unusable path is a configuration error; a torn line of any length is cut whole ----------------------

def test_a_log_path_that_is_a_directory_is_a_configuration_error(tmp_path, capsys):
    from odma.server.cli import main
    from odma.server.testing import tiny_model_folder

    with pytest.raises(ConfigError, match="is a directory"):
        LengthLog(tmp_path, policy="odma", model="m")
    with pytest.raises(ConfigError, match="is a directory"):
        read_realized_lengths(tmp_path)
    folder = tiny_model_folder(tmp_path / "tiny")
    assert main(["--model", str(folder), "--length-log", str(tmp_path), "--predictor", "median"]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_a_torn_last_line_longer_than_a_mebibyte_is_cut_whole(tmp_path):
    path = tmp_path / "lengths.jsonl"
    _write(path, _finished("a", 5))
    with path.open("a") as fh:
        fh.write('{"request_id": "torn", "prompt": "' + "x" * (3 << 20))  # a crash mid-write of a long prompt
    _write(path, _finished("c", 9))
    assert [json.loads(line)["request_id"] for line in path.read_text().splitlines()] == ["a", "c"]


# -- what the log keeps of a prompt, and how large it grows ---------------------------------------------------

def _prompted(rid: str, prompt: str) -> Sequence:
    seq = _finished(rid, 4)
    seq.prompt_text = prompt
    return seq


def test_the_log_keeps_of_each_prompt_what_the_operator_chose(tmp_path):
    secret = "my card number is 1234"
    for mode in ("text", "hash", "none"):
        path = tmp_path / f"{mode}.jsonl"
        _write(path, _prompted("a", secret), prompts=mode)
        raw = path.read_text()
        record = json.loads(raw)
        assert (secret in raw) == (mode == "text")
        assert record.get("prompt_sha256") == (hashlib.sha256(secret.encode()).hexdigest() if mode == "hash" else None)
        assert record["prompt_tokens"] == 3 and record["output_tokens"] == 4
        trace = load_trace(str(path))  # still a trace: lengths and metadata (the text only in "text" mode)
        assert [r.output_tokens for r in trace.records] == [4]
        assert trace.records[0].prompt == (secret if mode == "text" else None)


def test_the_log_rotates_at_its_size_bound_keeping_its_backups(tmp_path):
    scratch = tmp_path / "one.jsonl"
    _write(scratch, _finished("r0", 0))
    one = scratch.stat().st_size  # bytes of one record
    path = tmp_path / "lengths.jsonl"
    _write(path, *(_finished(f"r{i}", i) for i in range(30)), max_bytes=3 * one, backups=2)
    files = sorted(p.name for p in tmp_path.glob("lengths.jsonl*"))
    assert files == ["lengths.jsonl", "lengths.jsonl.1", "lengths.jsonl.2"]
    assert all(p.stat().st_size <= 4 * one for p in tmp_path.glob("lengths.jsonl*"))
    kept = read_realized_lengths(path, model="m")
    assert kept == list(range(30 - len(kept), 30)) and len(kept) >= 6  # the newest, in order, across the files
