"""Contiguous block runs over a paged block pool: which block ids a request gets (no torch, no vLLM).

A paged pool hands out any free block; here a request's blocks are steered into one run of consecutive ids:
- placement: a new request's first blocks start a run in a free extent that also holds its predicted size (its
  claim). "best-fit" takes the smallest such extent, leaving the large ones whole for runs that move; "halving"
  takes the largest and, when a live run ends right before it, starts halfway into its slack, so both have room
  to outgrow a low prediction in place (where runs cannot move, this kept more requests one run in a replay of
  144 NQ chats on vLLM's pool; with moves, best fit did);
- growth takes the next ids of its claim (in place); past the claim, the free ids right after it when nobody
  else claimed them (in place, the claim extends); otherwise, where the caller can copy blocks, the whole run
  moves to a new place with room to double (`move`: the caller copies the KV and hands the old ids back once the
  copy ran); otherwise the blocks come from elsewhere (appended: the request's KV is now more than one run,
  counted);
- a claim is not a hold: its unused ids stay free and count as free, so admission and preemption see exactly
  the pool a paged allocator would. Other requests take claimed ids only when no unclaimed id is left (stolen
  from the end of the largest claim, so its owner keeps its nearest growth);
- the prefix cache keeps its youngest entries: vLLM's free queue evicts the least recently freed block first,
  and a run taking ids by position would evict young ones. So the youngest free blocks that still hold an entry
  (their last holder let go of a full, hashed block), up to `keep` of all free blocks, are kept apart from the
  free ids runs are carved from; as more blocks are freed, the oldest of them join the rest. Runs never take a
  kept block while another will do (`_take` joins them oldest first when nothing else is left). A kept block
  joined but not handed out keeps its entry (vLLM drops it only when it hands the block out), and a prefix hit on
  any free block takes it out of the mirror.

The pool owns the truth about which blocks are free; this mirrors it (`give_back`, `taken_elsewhere`) and
`check` compares the two.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from odma.kv.extents import ExtentMap


@dataclass(slots=True)
class Run:
    start: int  # first id of the run the request grows from (its latest piece)
    used: int  # ids [start, start + used) are the request's
    end: int  # ids [start + used, end) are free, claimed for its growth
    pieces: int = 1  # contiguous pieces its blocks form; 1: its KV is one run

    @property
    def tail(self) -> int:
        return self.end - self.start - self.used


@dataclass(slots=True)
class RunStats:
    placed: int = 0  # runs started
    placed_whole: int = 0  # ... whose claim (the predicted size) fit in one free extent
    grown_in_place: int = 0  # growths that took the next ids
    moved: int = 0  # growths that moved the whole run to a larger place (its KV copied)
    moved_blocks: int = 0  # ... blocks copied by those moves
    appended: int = 0  # growths that took ids elsewhere (a new piece)
    appended_with_room: int = 0  # ... while a free unclaimed extent could have held the whole run (a move would
    # have kept it one run); the rest happened with no such extent anywhere: the pool was too full for one run
    stolen: int = 0  # claimed free ids handed to another request (no unclaimed id was left)
    finished: int = 0  # requests whose blocks were all returned
    finished_one_run: int = 0  # ... that held one run to the end
    finished_split_with_room: int = 0  # ... split at an append where a free extent could have held the whole run

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


@dataclass(slots=True)
class _Owner:
    run: Run
    split_with_room: bool = False


PLACEMENTS = ("halving", "best-fit")


class BlockRuns:
    """Runs over block ids [0, num_blocks); `reserved` ids are never free (vLLM's null block 0)."""

    def __init__(self, num_blocks: int, reserved: tuple[int, ...] = (), placement: str = "halving",
                 keep: float = 0.5) -> None:
        """keep: the share of free blocks the youngest cached ones may hold back from runs (0: none)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        if not 0 <= keep < 1:
            raise ValueError(f"keep must be in [0, 1), got {keep!r}")
        self.placement = placement
        self.keep = keep
        self.num_blocks = num_blocks
        self.avail = ExtentMap()  # free and unclaimed
        start = 0
        for r in sorted(set(reserved)) + [num_blocks]:
            self.avail.add_range(start, r - start)
            start = r + 1
        self.owners: dict[str, _Owner] = {}
        self.cached: dict[int, None] = {}  # the youngest free ids holding a prefix-cache entry, oldest freed first
        self.claimed_free = 0  # free ids inside claims
        self._run_ending_at: dict[int, str] = {}  # a live run's claim end -> its owner
        self.stats = RunStats()

    # -- what the pool asks --------------------------------------------------------------------------------

    @property
    def free(self) -> int:
        return self.avail.free_units + self.claimed_free + len(self.cached)

    def place(self, owner: str, n: int, claim: int) -> list[int]:
        """`owner`'s first `n` blocks, starting a run that keeps room for `claim` blocks in all."""
        self._need(n)
        self.stats.placed += 1
        self._make_room(n)
        ids, whole = self._open_run(owner, n, max(claim, n))
        self.stats.placed_whole += whole
        if ids is None:  # no free extent holds even its first blocks: scattered from the start
            ids = self._take(n)
            self._track(owner, Run(ids[-1], 1, ids[-1] + 1, _pieces(ids)))
        self._keep_within()
        return ids

    def fits_in_place(self, owner: str, n: int) -> bool:
        """Whether `n` more blocks for `owner` would extend its run in place (inside its claim or right after)."""
        o = self.owners.get(owner)
        if o is None:
            return False
        run = o.run
        return run.tail >= n or self.avail.size_at(run.end) >= n - run.tail

    def move(self, owner: str, held: int, n: int, claim: int | None = None) -> list[int] | None:
        """A new run for `owner`'s `held` blocks and `n` more, with room for `claim` in all (default: room to
        double, so a run is copied at most once per doubling), in a free unclaimed extent: its ids, the first `held`
        of them the copy targets (the caller copies the KV over and gives the old ids back once the copy ran). None
        when no extent holds the run, or when the pool, which holds both copies until then, would keep fewer than
        `held` unclaimed free blocks beside it."""
        total = held + n
        if self.avail.largest() < total or self.avail.free_units < total + held:  # (cached blocks stay: no move)
            return None
        self._release(owner)  # its claim's free rest goes back first: the new run may take it
        ids, _ = self._open_run(owner, total, max(claim or 2 * total, total))
        assert ids is not None
        self.stats.moved += 1
        self.stats.moved_blocks += held
        self._keep_within()
        return ids

    def grow(self, owner: str, n: int) -> list[int]:
        """`n` more blocks for `owner` (placed if it holds none yet)."""
        o = self.owners.get(owner)
        if o is None:
            return self.place(owner, n, n)
        self._need(n)
        run = o.run
        room = run.tail
        if room < n and self.avail.take_front(run.end, n - room):  # the ids after its claim are free: extend
            self._move_end(owner, run, run.end + n - room)
            self.claimed_free += n - room
            room = n
        if room >= n:
            first = run.start + run.used
            run.used += n
            self.claimed_free -= n
            self.stats.grown_in_place += 1
            self._keep_within()
            return list(range(first, first + n))
        # append: its claim's rest goes back, the blocks come from elsewhere
        with_room = self.avail.largest() >= run.used + n  # a move could have kept it one run
        if room:
            self.claimed_free -= room
            self._move_end(owner, run, run.end - room)  # its claim ends where its blocks do, before any stealing
            self.avail.free(run.end, room)
        ids = self._take(n)
        run.pieces += _pieces(ids)
        run.start, run.used = ids[-1], 1
        self._move_end(owner, run, ids[-1] + 1)
        self.stats.appended += 1
        self.stats.appended_with_room += with_room
        o.split_with_room |= with_room
        self._keep_within()
        return ids

    def take(self, n: int) -> list[int]:
        """`n` blocks for nobody in particular (a copy target, a block the pool hands out by itself)."""
        self._need(n)
        ids = self._take(n)
        self._keep_within()
        return ids

    def give_back(self, ids: list[int], cached: set[int] | frozenset[int] = frozenset()) -> None:
        """These blocks are free again (their last holder let go); those in `cached` still hold a prefix-cache
        entry, kept in the order given (vLLM's free queue order)."""
        for i in ids:
            if i in cached:
                self.cached[i] = None
            else:
                self.avail.free(i, 1)
        self._keep_within()

    def taken_elsewhere(self, ids: list[int]) -> None:
        """The pool handed out these free blocks by itself (a prefix-cache hit on a freed block)."""
        for i in ids:
            if i in self.cached:
                del self.cached[i]
            elif not self.avail.take(i, 1):
                self._cut_claim_at(i)
        self._keep_within()

    def drop(self, owner: str) -> None:
        """`owner` let go of all its blocks (finished, aborted, preempted): its claim's free ids return."""
        if owner not in self.owners:
            return
        o = self._release(owner)
        self.stats.finished += 1
        self.stats.finished_one_run += o.run.pieces == 1
        self.stats.finished_split_with_room += o.split_with_room

    def pieces(self, owner: str) -> int | None:
        o = self.owners.get(owner)
        return None if o is None else o.run.pieces

    # -- internals -----------------------------------------------------------------------------------------

    def _open_run(self, owner: str, n: int, claim: int) -> tuple[list[int] | None, bool]:
        """Start `owner`'s run of `n` ids with room for `claim` in all: its ids (None when no free extent holds
        `n`), and whether the whole claim fit."""
        if self.placement == "best-fit":  # the smallest extent that holds the claim, from its start
            start = self.avail.allocate(claim)
            if start is not None:
                self.claimed_free += claim - n
                self._track(owner, Run(start, n, start + claim))
                return list(range(start, start + n)), True
        extent = self.avail.largest_extent()
        if extent is None or extent[1] < n:
            return None, False
        at, size = extent
        whole = size >= claim
        if whole and self.placement == "halving":
            # a live run ends right before: leave it half the slack to outgrow its own claim in place
            start = at + (size - claim) // 2 if at in self._run_ending_at else at
        else:
            claim, start = size, at
        self.avail.carve(at, start, claim)
        self.claimed_free += claim - n
        self._track(owner, Run(start, n, start + claim))
        return list(range(start, start + n)), whole

    def _release(self, owner: str) -> _Owner:
        """Forget `owner`'s run; the free ids of its claim become unclaimed (the ids it holds stay held)."""
        o = self.owners.pop(owner)
        run = o.run
        if self._run_ending_at.get(run.end) == owner:
            del self._run_ending_at[run.end]
        if run.tail:
            self.claimed_free -= run.tail
            self.avail.free(run.start + run.used, run.tail)
        return o

    def _track(self, owner: str, run: Run) -> None:
        self.owners[owner] = _Owner(run)
        self._run_ending_at[run.end] = owner

    def _move_end(self, owner: str, run: Run, end: int) -> None:
        if self._run_ending_at.get(run.end) == owner:
            del self._run_ending_at[run.end]
        run.end = end
        self._run_ending_at[end] = owner

    def _need(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"asked for {n} blocks")
        if n > self.free:
            raise ValueError(f"cannot get {n} free blocks ({self.free} free)")
        self._keep_within()

    def _make_room(self, n: int) -> None:
        """Room for a new run's first `n` blocks in one piece, where other runs' claims can give it (they give back
        their free rest, the largest first); never from the kept cache: the run then starts in pieces (`_take`)."""
        while self.avail.largest() < n and self.claimed_free:
            victim = max((o.run for o in self.owners.values()), key=lambda r: r.tail)
            k = victim.tail
            self._move_end(self._owner_of(victim), victim, victim.end - k)
            self.claimed_free -= k
            self.avail.free(victim.end, k)

    def _keep_within(self) -> None:
        """The kept cached blocks are at most `keep` of the free ones (fewer free blocks: fewer kept)."""
        self._uncache_until(lambda: len(self.cached) <= self.keep * self.free)

    def _uncache_until(self, enough) -> None:
        """Join cached free blocks to the unclaimed free ids, oldest first, until `enough()` or none is left."""
        while self.cached and not enough():
            i = next(iter(self.cached))
            del self.cached[i]
            self.avail.free(i, 1)

    def _take(self, n: int) -> list[int]:
        """Unclaimed ids without a cache entry first (one extent when one fits: the smallest that does), then
        claimed ones, then cached ones, oldest first: a run's room for growth goes before the prefix cache."""
        ids: list[int] = []
        while len(ids) < n:
            need = n - len(ids)
            start = self.avail.allocate(need)
            if start is not None:
                ids.extend(range(start, start + need))
                break
            largest = self.avail.largest()
            if largest:
                start = self.avail.allocate(largest)
                ids.extend(range(start, start + largest))
            elif self.claimed_free:
                ids.extend(self._steal(min(need, self.claimed_free)))
            else:
                self._uncache_until(lambda: self.avail.free_units >= need)
                if not self.avail.free_units:
                    raise ValueError(f"pool mirror out of step: {need} blocks short")
        return ids

    def _steal(self, n: int) -> list[int]:
        ids: list[int] = []
        while len(ids) < n:
            victim = max((o.run for o in self.owners.values()), key=lambda r: r.tail, default=None)
            if victim is None or not victim.tail:
                raise ValueError(f"pool mirror out of step: {n - len(ids)} blocks short")
            k = min(victim.tail, n - len(ids))
            self._move_end(self._owner_of(victim), victim, victim.end - k)
            self.claimed_free -= k
            ids.extend(range(victim.end, victim.end + k))
            self.stats.stolen += k
        return ids

    def _owner_of(self, run: Run) -> str:
        return self._run_ending_at[run.end]

    def _cut_claim_at(self, i: int) -> None:
        for name, o in self.owners.items():
            run = o.run
            if run.start + run.used <= i < run.end:
                after = run.end - i - 1
                self.claimed_free -= run.end - i
                self._move_end(name, run, i)
                if after:
                    self.avail.free(i + 1, after)
                return
        raise ValueError(f"block {i} was not free in the mirror")

    # -- checks (tests) ------------------------------------------------------------------------------------

    def free_ids(self) -> set[int]:
        ids = {i for s, n in self.avail.extents() for i in range(s, s + n)} | set(self.cached)
        for o in self.owners.values():
            ids.update(range(o.run.start + o.run.used, o.run.end))
        return ids

    def check(self, pool_free: set[int] | None = None) -> None:
        """Claims disjoint, inside the pool, not overlapping unclaimed free ids; counts agree; when the pool's
        own free set is given, the mirror equals it."""
        self.avail.check()
        seen: set[int] = set()
        tails = 0
        for name, o in self.owners.items():
            r = o.run
            assert 0 <= r.start and r.used >= 1 and r.start + r.used <= r.end <= self.num_blocks, (name, r)
            span = set(range(r.start, r.end))
            assert not (span & seen), f"run of {name} overlaps another"
            seen |= span
            tails += r.tail
        assert tails == self.claimed_free, (tails, self.claimed_free)
        assert not any(i in seen for i in self.cached), "a cached free block inside a claim"
        assert self._run_ending_at == {o.run.end: name for name, o in self.owners.items()}
        free = self.free_ids()
        assert len(free) == self.free, (len(free), self.free)
        if pool_free is not None:
            assert free == pool_free, (sorted(free - pool_free)[:8], sorted(pool_free - free)[:8])


def _pieces(ids: list[int]) -> int:
    return 1 + sum(b != a + 1 for a, b in zip(ids, ids[1:]))
