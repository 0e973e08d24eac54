"""The free-extent map against a plain set-of-units model."""

from __future__ import annotations

import random

import pytest

from odma.kv.extents import ExtentMap, class_floor, size_class


def test_size_classes_are_monotone_and_floors_are_tight():
    prev = -1
    for size in range(1, 5000):
        c = size_class(size)
        assert c >= prev
        assert class_floor(c) <= size
        prev = c
    for c in range(1, size_class(5000)):
        assert size_class(class_floor(c)) == c


@pytest.mark.parametrize("seed", range(20))
def test_random_allocate_free_matches_model(seed):
    rng = random.Random(seed)
    total = rng.randint(10, 3000)
    em = ExtentMap()
    em.add_range(0, total)
    free_units = set(range(total))
    held: list[tuple[int, int]] = []
    for _ in range(400):
        if held and rng.random() < 0.45:
            start, size = held.pop(rng.randrange(len(held)))
            em.free(start, size)
            free_units |= set(range(start, start + size))
        else:
            size = rng.randint(1, max(1, total // 8))
            start = em.allocate(size)
            # a fit exists iff some run of `size` free units exists
            runs, run = [], 0
            for u in range(total + 1):
                if u in free_units:
                    run += 1
                else:
                    runs.append(run)
                    run = 0
            if start is None:
                assert max(runs) < size, "refused although a fitting extent existed"
            else:
                block = set(range(start, start + size))
                assert block <= free_units
                free_units -= block
                held.append((start, size))
        em.check()
        assert em.free_units == len(free_units)
    for start, size in held:
        em.free(start, size)
    em.check()
    assert list(em.extents()) == [(0, total)]
