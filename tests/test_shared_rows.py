"""Who reads which rows of whose block (odma.kv.shared_rows): pieces passed on and cut, blocks kept only while read,
parked blocks freed with their last reader, up the chain."""

from __future__ import annotations

import pytest

from odma.kv import KVHandle
from odma.kv.shared_rows import SharedRows, Shifted


def _h(name: str) -> KVHandle:
    return KVHandle(name, 64)


def test_a_reader_reads_the_holders_pieces_up_to_its_share_then_the_holders_own_rows():
    rows = SharedRows()
    a, b, holder = _h("a"), _h("b"), _h("h")
    rows.add(holder, [(a, 0, 16), (b, 16, 40)])  # the holder's block holds rows from 40
    assert holder.first_row == 40
    assert rows.pieces_for(holder, 10) == [(a, 0, 10)]
    assert rows.pieces_for(holder, 30) == [(a, 0, 16), (b, 16, 30)]
    assert rows.pieces_for(holder, 50) == [(a, 0, 16), (b, 16, 40), (holder, 40, 50)]
    assert rows.pieces_for(_h("plain"), 12)[0][1:] == (0, 12)


def test_a_block_is_kept_for_the_rows_read_in_it_and_freed_with_its_last_reader_up_the_chain():
    rows = SharedRows()
    first, second, third = _h("first"), _h("second"), _h("third")
    rows.add(second, rows.pieces_for(first, 20))
    rows.add(third, rows.pieces_for(second, 30))  # rows 0..20 from first, 20..30 from second
    assert rows.rows_to_keep(first) == 20 and rows.rows_to_keep(second) == 10 and rows.rows_to_keep(third) is None
    rows.park(first)
    rows.park(second)
    assert rows.drop(third) == [second, first]  # second's last reader, then first's (second read it)
    assert len(rows) == 0 and not rows.parked and third.pieces is None


def test_a_block_read_by_a_running_request_is_not_freed():
    rows = SharedRows()
    holder, r1, r2 = _h("h"), _h("r1"), _h("r2")
    rows.add(r1, rows.pieces_for(holder, 16))
    rows.add(r2, rows.pieces_for(holder, 24))
    rows.park(holder)
    assert rows.drop(r1) == [] and rows.rows_to_keep(holder) == 24
    assert rows.drop(r2) == [holder]


def test_a_reader_reads_something_and_its_block_sees_fewer_prompt_rows():
    with pytest.raises(ValueError):
        SharedRows().add(_h("r"), [])

    class Req:
        request_id, prompt_tokens, max_new_tokens = "r", 50, 8

    shifted = Shifted(Req(), 20)
    assert (shifted.prompt_tokens, shifted.max_new_tokens, shifted.request_id) == (30, 8, "r")
