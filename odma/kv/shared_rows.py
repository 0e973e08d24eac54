"""Shared prompt prefixes read in place: who reads which rows of whose block (bookkeeping only, no tensors).

Chat traffic repeats itself at the front (a template's system prompt, a conversation's earlier turns). A paged pool
maps a holder's pages into a new request's table; a contiguous block cannot point into another, so by default odma
copies the prefix into each block (`odma.engine.prefix_share`). Read in place instead, a request admitted behind a
running holder that has cached its first `tokens` rows reads those rows where they lie and its own block holds only
the rows after them: a smaller block, nothing copied or computed. A holder that itself read its first rows elsewhere
passes those pieces on as they are, so a request's first rows may lie in several blocks (`KVHandle.pieces`, which the
attention kernels read as a short table), and a block is held only for rows somebody reads in it.

A holder that ends while others read its rows is parked: its block shrinks in place to the rows they read
(`KVPool.keep_front`, under an id of its own) until its last reader is gone. The replay measured the design before it
was built (docs/results/gpu/replay_policy.md, "A shared prefix read in place": chat turns at 4 GiB 0.964 → 1.089× the
paged pool with prefix maps).

The same pieces serve a block that cannot grow where it lies (`PoolConfig.continue_growth`): its rows so far stay
where they are, under an id of their own (`KVPool.continue_elsewhere`), the request goes on in a new block and reads
them as a piece, and so does everyone who read them in its old block (`continued`); they are parked at once, freed
with their last reader (docs/results/gpu/replay_policy.md, "Blocks continued elsewhere").
"""

from __future__ import annotations

from odma.kv.blocks import KVHandle


class Shifted:
    """A request as its own block sees it: `rows` fewer prompt tokens (they are read from other blocks)."""

    __slots__ = ("_req", "rows")

    def __init__(self, req, rows: int) -> None:
        self._req, self.rows = req, rows

    def __getattr__(self, name):
        return getattr(self._req, name)

    @property
    def prompt_tokens(self) -> int:
        return self._req.prompt_tokens - self.rows


class SharedRows:
    """Readers and the blocks they read. Handles are the keys (their request ids change when a block is parked)."""

    def __init__(self) -> None:
        self.readers: dict[KVHandle, dict[KVHandle, int]] = {}  # block's handle -> reader -> the row after its read
        self.parked: set[KVHandle] = set()  # blocks of ended requests, kept for their readers

    def pieces_for(self, holder: KVHandle, tokens: int) -> list[tuple[KVHandle, int, int]]:
        """What a request reading `holder`'s first `tokens` rows reads: the holder's own pieces up to `tokens`, then
        the rest from the holder's block."""
        pieces, previous = [], 0
        for owner, first, end in holder.pieces or ():
            if previous >= tokens:
                break
            pieces.append((owner, first, min(end, tokens)))
            previous = end
        own = holder.first_row
        if tokens > own:
            pieces.append((holder, own, tokens))
        return pieces

    def add(self, reader: KVHandle, pieces: list[tuple[KVHandle, int, int]]) -> None:
        """`reader` was admitted reading `pieces` (from `pieces_for`); its block holds the rows after them."""
        if not pieces:
            raise ValueError("a reader reads at least one piece")
        reader.pieces = pieces
        for owner, _, end in pieces:
            self.readers.setdefault(owner, {})[reader] = end

    def continued(self, handle: KVHandle, left: KVHandle, rows: int) -> None:
        """`handle`'s request went on in a new block and left its rows so far in `left`'s (`KVPool.continue_elsewhere`):
        it reads them there from now on, as does everyone who read them in its old block; `left` is parked (freed
        with its last reader)."""
        first = handle.first_row
        readers = self.readers.pop(handle, {})
        for reader in readers:
            reader.pieces = [(left if owner is handle else owner, a, b) for owner, a, b in reader.pieces]
        self.add(handle, [*(handle.pieces or ()), (left, first, first + rows)])
        self.readers[left].update(readers)
        self.park(left)

    def rows_to_keep(self, handle: KVHandle) -> int | None:
        """Rows of `handle`'s block others still read (from its first), None when nobody does."""
        readers = self.readers.get(handle)
        return max(readers.values()) - handle.first_row if readers else None

    def park(self, handle: KVHandle) -> None:
        """`handle`'s request ended while others read its rows: its block stays (shrunk) until they are gone."""
        self.parked.add(handle)

    def drop(self, handle: KVHandle) -> list[KVHandle]:
        """`handle`'s block is gone (released, or evicted with nobody reading it): the blocks it read lose a
        reader. Returns the parked ones whose last reader it was, and so on up their own pieces: the caller
        frees their blocks."""
        freed: list[KVHandle] = []
        stack = [handle]
        while stack:
            gone = stack.pop()
            for owner, _, _ in gone.pieces or ():
                readers = self.readers.get(owner)
                if readers is None:
                    continue
                readers.pop(gone, None)
                if readers:
                    continue
                del self.readers[owner]
                if owner in self.parked:
                    self.parked.discard(owner)
                    freed.append(owner)
                    stack.append(owner)
            gone.pieces = None
        return freed

    def __len__(self) -> int:
        """Blocks read by someone."""
        return len(self.readers)

