"""The realized-length log survives a crash mid-append: a torn last line is repaired on open, and readers
skip what they cannot parse, with a warning."""

from __future__ import annotations

import json
import logging

from odma.engine.length_log import LengthLog, read_realized_lengths
from odma.engine.sampling import SamplingParams
from odma.engine.sequence import Sequence


def _finished(rid: str, generated: int) -> Sequence:
    seq = Sequence(rid, [1, 2, 3], SamplingParams(max_tokens=64))
    seq.output_ids = list(range(generated))
    seq.finish_reason = "stop"
    return seq


def _write(path, *seqs) -> None:
    log = LengthLog(path, policy="odma", model="m")
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
    assert "skipped 3 unreadable" in caplog.text
