"""The small value types that cross the door between scheduling and memory (no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

MAIN, LARGE_REGION = "main", "large"


class Block(NamedTuple):
    """An immutable block handle (a named tuple: created on every reservation, so it must be cheap)."""

    offset: int  # first token slot
    capacity: int  # token slots, a multiple of the pool's alignment
    bucket: int  # bucket index at reservation, LARGE for the large bucket
    region: str = MAIN

    @property
    def end(self) -> int:
        return self.offset + self.capacity


class BlockMover(Protocol):
    def copy(self, src: Block, dst: Block, n_tokens: int) -> None:
        """Copy the first n_tokens of src's KV into dst (a sequential copy on the device)."""


@dataclass(slots=True, eq=False)
class KVHandle:
    """A request's KV memory as its holder sees it. The manager that handed it out keeps it current: when a
    block grows or moves (growth, relocation, ballooning), `block` and `capacity` change in place, so the
    holder never re-reads anything after a move."""

    request_id: str
    capacity: int  # tokens the request may hold now
    block: Block | None = None  # the contiguous range (None for the paged model, which has no ranges)
    pages: list[int] | None = None  # the paged model's page ids, in token order (its holder reads them in place)
    # a shared prompt prefix read in place (odma.kv.shared_rows): (the handle of a block that holds rows, the first
    # row that block holds, the row after the piece), in row order; `block` then holds the rows after the last piece
    pieces: list[tuple["KVHandle", int, int]] | None = None

    @property
    def first_row(self) -> int:
        """The first row `block` holds: after the pieces read from other blocks (0 without)."""
        return self.pieces[-1][2] if self.pieces else 0


@dataclass(frozen=True, slots=True)
class Growth:
    """What `grow` did."""

    capacity: int  # tokens the request may now hold
    # tokens the growth copied: moved to a new block, or re-laid in a block grown in place (0: it was big enough,
    # or a page was added)
    copied_tokens: int
    moved: bool = False  # the request's KV now starts elsewhere (its offset changed)
