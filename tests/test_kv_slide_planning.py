"""The slide planner (odma.kv.reclaim.cheapest_slides) against the plain statement of what it chooses: every run of
each shape tried in order, its cost summed item by item. The planner finds the same run with prefix sums and
bisection; it must choose exactly the same plan (cost, moves, their order) on every pool state, ties included."""

from __future__ import annotations

import random

import pytest

from odma.kv.reclaim import cheapest_slides


def reference_slides(blocks, gaps, units, own, extra):
    """The cheapest run, each candidate tried in turn: from every gap (lowest first) the shortest run to a gap
    holding `units`, packed down; the shortest from a gap below `own` to `own` holding `extra` with the gap after
    it, packed down; the shortest from right after `own` to a gap above holding `extra`, packed up. A candidate
    replaces the best so far when it costs less, the last shape also when it costs the same."""
    items = sorted([*blocks, *((s, n, None, 0) for s, n in gaps)])

    def is_gap(i):
        return items[i][2] is None

    def cost(a, b):  # live tokens and blocks among items[a:b]
        inside = [item for item in items[a:b] if item[2] is not None]
        return sum(item[3] for item in inside), len(inside)

    def gap_room(a, b):  # free units among items[a:b]
        return sum(item[1] for item in items[a:b] if item[2] is None)

    candidates = []  # (cost, first item, last item, direction, wins a tie)
    for a in (i for i in range(len(items)) if is_gap(i)):
        b = next((b for b in range(a, len(items)) if is_gap(b) and gap_room(a, b + 1) >= units), None)
        if b is not None:
            candidates.append((cost(a, b), a, b, "down", False))
    k = next((i for i, item in enumerate(items) if own is not None and item[2] == own), None)
    if k is not None:
        after = items[k + 1][1] if k + 1 < len(items) and is_gap(k + 1) else 0
        a = next((a for a in range(k - 1, -1, -1) if is_gap(a) and gap_room(a, k) + after >= extra), None)
        if a is not None:
            tokens, count = cost(a, k)
            candidates.append(((tokens + items[k][3], count + 1), a, k, "down", False))
        b = next((b for b in range(k + 1, len(items)) if is_gap(b) and gap_room(k + 1, b + 1) >= extra), None)
        if b is not None:
            candidates.append((cost(k + 1, b), k + 1, b, "up", True))
    best = None
    for run in candidates:
        if best is None or run[0] < best[0] or (run[4] and run[0] == best[0]):
            best = run
    if best is None:
        return None
    run, a, b, direction, _ = best
    placed = []  # (request id, new offset unit) of every block of the run, in the order it is moved
    if direction == "down":
        cursor = items[a][0]
        for offset, size, rid, _ in items[a:b + 1]:
            if rid is not None:
                placed.append((rid, cursor, offset))
                cursor += size
    else:
        cursor = items[b][0] + items[b][1]
        for offset, size, rid, _ in reversed(items[a:b + 1]):
            if rid is not None:
                cursor -= size
                placed.append((rid, cursor, offset))
    return run, [(rid, at) for rid, at, offset in placed if at != offset]


def random_region(rng: random.Random):
    """Blocks and gaps tiling a region in a random order; tokens drawn from a few values so that runs tie."""
    blocks, gaps, at = [], [], 0
    last_gap = False
    for n in range(rng.randint(0, 40)):
        if not last_gap and rng.random() < 0.35:
            size = rng.randint(1, 6)
            gaps.append((at, size))
            last_gap = True
        else:
            size = rng.randint(1, 8)
            blocks.append((at, size, f"r{n}", rng.choice([0, 16, 32, 48, rng.randint(1, 128)])))
            last_gap = False
        at += size
    rng.shuffle(blocks)  # callers pass them in the pool's order, not by offset
    return blocks, gaps


@pytest.mark.parametrize("seed", range(6))
def test_the_planner_chooses_what_the_plain_statement_chooses(seed):
    rng = random.Random(seed)
    for _ in range(100):
        blocks, gaps = random_region(rng)
        free = sum(n for _, n in gaps)
        own = rng.choice([None, *(rid for _, _, rid, _ in blocks)]) if blocks else None
        units = rng.randint(1, free + 2)
        extra = rng.randint(1, free + 2)
        assert cheapest_slides(blocks, gaps, units, own, extra) == reference_slides(blocks, gaps, units, own, extra)


def test_a_tie_keeps_the_first_run_found_and_lets_own_stay():
    # two gap-to-gap runs of one 10-token block each: the lower one wins
    blocks = [(1, 2, "a", 10), (4, 2, "b", 10)]
    gaps = [(0, 1), (3, 1), (6, 1)]
    assert cheapest_slides(blocks, gaps, 2, None, 0) == ((10, 1), [("a", 0)])
    # growing "a" by 1: sliding "a" down or "b" up cost the same; packed up, "a" stays
    blocks = [(1, 2, "a", 10), (3, 2, "b", 10)]
    assert cheapest_slides(blocks, [(0, 1), (5, 1)], 4, "a", 1) == ((10, 1), [("b", 4)])
    assert reference_slides(blocks, [(0, 1), (5, 1)], 4, "a", 1) == ((10, 1), [("b", 4)])
