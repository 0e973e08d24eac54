"""Ballooning rules, one at a time: inflate adds usable space, deflate evacuates through the mover and
frees, rollback when a block cannot move, fences withhold what is given back, metrics count it all."""

from __future__ import annotations

import pytest
import torch

from backends import CPUBackend, KVLayout
from odma.kv import ActivationProfile, BalloonPool, KVPool, KVRequest, StaticPolicy
from odma.kv.balloon import Segment
from odma.kv.reclaim import clear_window
from odma.errors import ConfigError, InvalidRequestError

LAYOUT = KVLayout(layers=1, kv_heads=1, head_dim=2)


def _pool(total=256, **kw) -> KVPool:
    return KVPool(total, StaticPolicy(), large_share=0.0, align=16, bytes_per_token=LAYOUT.bytes_per_token, **kw)


def _req(rid: str, prompt=16, new=16) -> KVRequest:
    return KVRequest(rid, prompt, new)


def _device_balloon(total=256, segment=128):
    pool = _pool(total)
    backend = CPUBackend()
    base = backend.create_arena(pool.total_tokens, LAYOUT)
    return pool, BalloonPool(pool, segment, backend=backend, base_arena=base, layout=LAYOUT)


def _write(balloon, pool, rid, value):
    block = pool.block_of(rid)
    balloon.arena.view(block)[:, :, : pool.length_of(rid)] = value


def _read(balloon, pool, rid):
    return balloon.arena.view(pool.block_of(rid))[:, :, : pool.length_of(rid)]


def test_inflate_adds_space_after_a_gap():
    pool = _pool(256)
    balloon = BalloonPool(pool, 128)
    for i in range(8):
        assert pool.reserve(_req(f"a{i}")) is not None
    assert pool.reserve(_req("full")) is None
    seg = balloon.inflate()
    assert seg.offset == 256 + 16 and seg.tokens == 128  # one 16-token unit of gap
    assert pool.capacity_tokens == 384
    blocks = [pool.reserve(_req(f"b{i}")) for i in range(4)]
    assert all(b is not None and seg.offset <= b.offset < seg.offset + 128 for b in blocks)
    seg2 = balloon.inflate()
    assert seg2.start_unit == seg.start_unit + seg.units + 1
    pool.check_invariants()
    assert balloon.metrics.inflations == 2 and balloon.metrics.segment_bytes_now == 256 * LAYOUT.bytes_per_token


def test_no_block_spans_two_segments():
    pool = _pool(64)
    balloon = BalloonPool(pool, 32)
    balloon.inflate(), balloon.inflate()
    assert pool.reserve(KVRequest("base", 48, 16)) is not None  # fills the 64-token first range
    assert pool.capacity_tokens - pool.stats().reserved_tokens == 64  # two free 32-token segments...
    assert pool.reserve(KVRequest("wide", 32, 16)) is None  # ...but no 48-token block across the gap
    assert pool.reserve(KVRequest("fits", 16, 16)) is not None
    pool.check_invariants()


def test_deflate_moves_live_blocks_out_intact_and_frees_the_segment():
    pool, balloon = _device_balloon(256, 128)
    seg = balloon.inflate()
    for i in range(16):  # fill base (8 blocks of 32) and segment (4 blocks)
        rid = f"r{i}"
        if pool.reserve(_req(rid)) is None:
            break
        _write(balloon, pool, rid, float(i + 1))
    in_seg = balloon.live_in(seg)
    assert len(in_seg) == 4
    for rid in [r for r in pool.live_requests() if r not in in_seg][:4]:  # room in the base for the evacuation
        pool.release(rid, 0)
    result = balloon.deflate()
    assert result.ok and result.moved_blocks == 4 and result.moved_tokens == 4 * 16
    assert result.freed_bytes == 128 * LAYOUT.bytes_per_token
    for rid in in_seg:
        assert pool.block_of(rid).end <= 256 and torch.all(_read(balloon, pool, rid) == float(rid[1:]) + 1)
    assert balloon.segments() == [] and [b for b, _ in balloon.arena.segments()] == [0]
    assert pool.capacity_tokens == 256
    m = balloon.metrics
    assert (m.deflations, m.moved_blocks, m.moved_bytes, m.segment_bytes_now) == (1, 4, 64 * LAYOUT.bytes_per_token, 0)
    pool.check_invariants()


def test_deflate_rolls_back_when_a_block_cannot_move():
    pool, balloon = _device_balloon(128, 128)
    seg = balloon.inflate()
    for i in range(8):
        assert pool.reserve(_req(f"r{i}")) is not None
        _write(balloon, pool, f"r{i}", float(i + 1))
    pool.release("r0", 0)  # room for one block outside the segment, not for four
    before = {rid: pool.block_of(rid) for rid in pool.live_requests()}
    result = balloon.deflate(seg)
    assert not result.ok and "no room" in result.reason and result.moved_blocks == 1
    assert balloon.metrics.deflate_rollbacks == 1 and balloon.metrics.segment_bytes_now == 128 * LAYOUT.bytes_per_token
    assert set(pool.live_requests()) == set(before)  # nobody lost
    for rid in before:
        assert torch.all(_read(balloon, pool, rid) == float(rid[1:]) + 1)  # bytes intact, moved or not
    assert pool.capacity_tokens == 256 and seg in balloon.segments()
    pool.check_invariants()
    pool.release("r7", 0)  # the segment is usable again after the rollback
    assert pool.reserve(_req("again")) is not None


def test_blocks_given_back_inside_a_fence_are_withheld():
    pool = _pool(128)
    balloon = BalloonPool(pool, 64)
    seg = balloon.inflate()
    for i in range(6):
        assert pool.reserve(_req(f"r{i}")) is not None
    in_seg = balloon.live_in(seg)
    balloon.fence(seg)
    pool.release(in_seg[0], 0)
    assert pool.reserve(_req("x")) is None  # the freed block in the fence is not handed out
    pool.check_invariants()
    balloon.unfence(seg)
    assert pool.reserve(_req("x")) is not None
    pool.check_invariants()


def test_remove_segment_refuses_while_blocks_live():
    pool = _pool(64)
    balloon = BalloonPool(pool, 64)
    seg = balloon.inflate()
    pool.reserve(_req("a")), pool.reserve(_req("b")), pool.reserve(_req("c"))
    balloon.fence(seg)
    with pytest.raises(InvalidRequestError, match="in use"):
        balloon._remove(seg)
    with pytest.raises(InvalidRequestError):
        balloon._add(Segment(seg.start_unit + seg.units, 4, seg.region, seg.align))  # touches the segment
    with pytest.raises(InvalidRequestError):
        balloon._add(Segment(0, 4, seg.region, seg.align))


def test_deflate_without_segments_and_bad_arguments():
    pool = _pool(64)
    balloon = BalloonPool(pool, 32)
    assert not balloon.deflate().ok and balloon.deflate_bytes(1000) == []
    with pytest.raises(ConfigError):
        BalloonPool(pool, 20)
    with pytest.raises(ConfigError):
        balloon.inflate(tokens=8)


def test_deflate_bytes_frees_enough_segments():
    pool = _pool(64)
    balloon = BalloonPool(pool, 32)
    for _ in range(3):
        balloon.inflate()
    results = balloon.deflate_bytes(50 * LAYOUT.bytes_per_token)
    assert [r.ok for r in results] == [True, True] and len(balloon.segments()) == 1


def test_activation_profile_interpolates_and_plans_deflation():
    prof = ActivationProfile({512: 1000, 2048: 4000})
    assert prof.peak_bytes(100) == 1000 and prof.peak_bytes(1280) == 2500 and prof.peak_bytes(4096) == 8000
    assert prof.deflate_needed(2048, free_device_bytes=3000) == 1000
    assert prof.deflate_needed(512, free_device_bytes=3000) == 0
    with pytest.raises(ConfigError):
        ActivationProfile({})


def test_clear_window_moves_the_blocks_in_a_large_requests_way_into_a_segment():
    pool, balloon = _device_balloon(total=256, segment=128)
    small = [f"s{i}" for i in range(8)]
    for i, rid in enumerate(small):  # the base range full of 32-token blocks
        assert pool.reserve(_req(rid)) is not None
        _write(balloon, pool, rid, float(i + 1))
    big = _req("big", prompt=96, new=32)  # 128 tokens: no range of that size is free
    assert clear_window(pool, big) == (0, False)  # no room outside any window: nothing moves
    assert not balloon.draining and pool.capacity_tokens == pool.total_tokens  # nothing left fenced or withheld
    balloon.inflate()  # 128 tokens of lent room
    moved, cleared = clear_window(pool, big)
    assert (moved, cleared) == (4, True)
    block = pool.reserve(big)
    assert block is not None and block.end <= 256  # in the base range the blocks left
    for i, rid in enumerate(small):
        assert torch.all(_read(balloon, pool, rid) == float(i + 1))  # moved or not, intact
    assert sum(pool.block_of(rid).offset >= 256 for rid in small) == 4
    pool.check_invariants()


def test_clear_window_refuses_what_reserve_would_refuse():
    pool, _ = _device_balloon(total=256, segment=128)
    assert clear_window(pool, _req("huge", prompt=250, new=32)) == (0, False)
    pool.check_invariants()
