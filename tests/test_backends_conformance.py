"""Every available backend passes the same suite: CPU always, each visible CUDA device when present.
(MLU cannot run here: tests/test_backends_errors.py pins its error message.)"""

from __future__ import annotations

import pytest
import torch

from backends import (
    Arena, Backend, Capabilities, KVLayout, MemoryInfo, SegmentedArena, available_devices, create_virtual_arena,
    get_backend,
)
from odma.kv import Block  # the pool's blocks are what arenas view
from backends import BackendError

DEVICES = available_devices()
LAYOUT = KVLayout(layers=2, kv_heads=3, head_dim=4)


@pytest.fixture(params=DEVICES)
def backend(request) -> Backend:
    return get_backend(request.param)


def _fill(arena: Arena, block: Block, seed: float) -> torch.Tensor:
    view = arena.view(block)
    values = torch.arange(view.numel(), dtype=view.dtype, device=view.device).view_as(view) + seed
    view.copy_(values)
    return values


def test_backend_identity(backend):
    assert isinstance(backend.capabilities, Capabilities)
    assert backend.capabilities.supports_vmm is (backend.virtual_memory() is not None)
    assert backend.device.type == backend.name


def test_a_virtual_arena_holds_data_only_where_mapped(backend):
    """Where the backend has virtual memory: views and copies as in any arena, over granules mapped on demand; a
    block's range grows by mapping the granules after it without touching what it holds."""
    import math

    if not backend.capabilities.supports_vmm:
        assert create_virtual_arena(backend, 64, LAYOUT, 1 << 20) is None
        return
    g = backend.virtual_memory().granularity
    bpt = LAYOUT.bytes_per_token
    unit = g // math.gcd(g, bpt)  # the fewest tokens that fill whole granules
    per = unit * bpt // g  # granules per unit
    arena = create_virtual_arena(backend, 64 * unit, LAYOUT, physical_bytes=(3 * per + 1) * g)
    try:
        # one granule guards the range's start (mapped for the arena's life): blocks map the other 3 units
        assert arena.physical_granules == 3 * per and arena.nbytes == (3 * per + 1) * g
        block = Block(offset=unit, capacity=unit, bucket=0)
        at = per * g  # block's first byte: the first whole unit after the guard
        arena.map(at, per)
        values = _fill(arena, block, 1.0)
        arena.map(at + per * g, per)  # grow behind it: the data stays where it is
        e = LAYOUT.elements_per_token
        assert torch.equal(arena.storage[unit * e: 2 * unit * e].view_as(values), values)
        far = Block(offset=32 * unit, capacity=unit, bucket=1)
        arena.map(32 * per * g, per)
        arena.copy(block, far, unit // 2)
        assert torch.equal(arena.view(far)[:, :, : unit // 2], values[:, :, : unit // 2])
        with pytest.raises(BackendError):
            arena.map(40 * per * g, 1)  # every physical granule is in use
        with pytest.raises(BackendError):
            arena.map(0, 1)  # the guard's granule is never a block's
        arena.unmap(at, 2 * per)
        arena.unmap(32 * per * g, per)
        assert arena.mapped_granules == 0
        with pytest.raises(BackendError):
            arena.unmap(at, 1)  # not mapped
    finally:
        arena.release()


def test_arena_view_is_a_view_of_one_contiguous_range(backend):
    arena = backend.create_arena(64, LAYOUT)
    assert arena.storage.device.type == backend.device.type and arena.total_tokens == 64
    block = Block(offset=16, capacity=8, bucket=0)
    view = arena.view(block)
    assert view.shape == (2, 2, 8, 3, 4) and view.dtype == LAYOUT.dtype
    view.fill_(7.0)
    e = LAYOUT.elements_per_token
    assert torch.all(arena.storage[16 * e : 24 * e] == 7.0)
    assert torch.all(arena.storage[: 16 * e] == 0) and torch.all(arena.storage[24 * e :] == 0)
    with pytest.raises(BackendError):
        arena.view(Block(offset=60, capacity=8, bucket=0))


def test_migration_copy_moves_first_n_tokens_only(backend):
    arena = backend.create_arena(64, LAYOUT)
    src, dst = Block(0, 16, 0), Block(32, 32, 1)
    values = _fill(arena, src, 1.0)
    arena.copy(src, dst, 10)
    assert torch.equal(arena.view(dst)[:, :, :10], values[:, :, :10])
    assert torch.all(arena.view(dst)[:, :, 10:] == 0)
    assert torch.equal(arena.view(src), values)  # the source is untouched
    with pytest.raises(BackendError):
        arena.copy(src, dst, 17)


def test_segments_allocate_and_free(backend):
    seg = backend.create_segment(32, LAYOUT)
    assert seg.total_tokens == 32 and seg.nbytes == 32 * LAYOUT.bytes_per_token
    assert backend.free_arena(seg) == 32 * LAYOUT.bytes_per_token
    assert seg.released and seg.nbytes == 0
    with pytest.raises(BackendError):
        seg.view(Block(0, 16, 0))
    backend.free_arena(backend.create_segment(16, LAYOUT), return_to_driver=True)
    with pytest.raises(BackendError):
        backend.create_segment(0, LAYOUT)


def test_segmented_arena_views_and_copies_across_segments(backend):
    seg = SegmentedArena(LAYOUT)
    seg.add(0, backend.create_arena(32, LAYOUT))
    seg.add(48, backend.create_segment(32, LAYOUT))  # a 16-token gap between the two
    a, b = Block(8, 16, 0), Block(56, 24, 0)
    values = _fill(seg, a, 3.0)  # type: ignore[arg-type]
    seg.copy(a, b, 16)
    assert torch.equal(seg.view(b)[:, :, :16], values)
    for bad in (Block(24, 16, 0), Block(32, 16, 0), Block(72, 16, 0)):  # spans, in the gap, past the end
        with pytest.raises(BackendError):
            seg.view(bad)
    with pytest.raises(BackendError):
        seg.add(40, backend.create_segment(16, LAYOUT))  # overlaps the second segment
    arena = seg.remove(48)
    assert backend.free_arena(arena) > 0 and [base for base, _ in seg.segments()] == [0]
    with pytest.raises(BackendError):
        seg.remove(48)


@pytest.mark.parametrize("use_stream", [False, True])
def test_offload_then_fetch_round_trips(backend, use_stream):
    arena = backend.create_arena(64, LAYOUT)
    src, dst = Block(0, 32, 0), Block(32, 32, 0)
    values = _fill(arena, src, 5.0)
    stream = backend.new_stream() if use_stream else None
    if stream is not None:
        stream.wait_stream(backend.current_stream())  # the fill above ran on the current stream
    host = backend.offload(arena, src, 20, stream=stream)
    if stream is not None:
        stream.synchronize()
    assert host.device.type == "cpu" and host.shape == (2, 2, 20, 3, 4)
    assert host.is_pinned() == backend.capabilities.pinned_host
    assert torch.equal(host, values[:, :, :20].cpu())
    backend.fetch(host, arena, dst, 20, stream=stream)
    if stream is not None:
        stream.synchronize()
    backend.synchronize()
    assert torch.equal(arena.view(dst)[:, :, :20], values[:, :, :20])
    assert torch.all(arena.view(dst)[:, :, 20:] == 0)


def test_offload_into_a_given_buffer_and_bad_sizes(backend):
    arena = backend.create_arena(32, LAYOUT)
    block = Block(0, 16, 0)
    values = _fill(arena, block, 2.0)
    buf = backend.host_buffer(16, LAYOUT)
    assert backend.offload(arena, block, 16, out=buf) is buf and torch.equal(buf, values.cpu())
    with pytest.raises(BackendError):
        backend.offload(arena, block, 17)
    with pytest.raises(BackendError):
        backend.offload(arena, block, 16, out=backend.host_buffer(8, LAYOUT))
    with pytest.raises(BackendError):
        backend.fetch(backend.host_buffer(8, LAYOUT), arena, block, 9)


def test_streams_and_events(backend):
    stream, event = backend.new_stream(), backend.new_event()
    with backend.use_stream(stream):
        x = torch.ones(8, device=backend.device) * 2
        event.record(stream)
    event.synchronize()
    assert event.query() and stream.query()
    backend.synchronize()
    assert float(x.sum()) == 16.0


def test_memory_info(backend):
    info = backend.memory_info()
    assert isinstance(info, MemoryInfo)
    assert info.total_bytes > 0 and 0 <= info.free_bytes <= info.total_bytes
    assert 0 <= info.framework_bytes <= info.framework_reserved_bytes
    free, total = info  # the old (free, total) tuple still unpacks
    assert (free, total) == (info.free_bytes, info.total_bytes)
    if backend.name != "cpu":  # a 64 MiB arena shows up in the framework's bytes
        before = backend.memory_info().framework_bytes
        arena = backend.create_arena((64 << 20) // LAYOUT.bytes_per_token, LAYOUT)
        assert backend.memory_info().framework_bytes >= before + arena.nbytes
        backend.free_arena(arena)


@pytest.mark.parametrize("segmented", [False, True])
def test_growth_in_place_lays_the_kv_out_again_intact(backend, segmented):
    arena = backend.create_arena(64, LAYOUT)
    if segmented:  # the engine's arena with ballooning: the same copy through the segment map
        seg = SegmentedArena(LAYOUT)
        seg.add(0, arena)
        arena = seg
    old, grown = Block(8, 16, 0), Block(8, 40, 1)
    values = _fill(arena, old, 1.0)
    arena.copy(old, grown, 12)
    assert torch.equal(arena.view(grown)[:, :, :12], values[:, :, :12])
    with pytest.raises(BackendError, match="overlapping"):
        arena.copy(Block(8, 40, 0), Block(16, 16, 0), 8)  # overlapping, into a smaller block


@pytest.mark.parametrize("temp_bytes", [1, 1 << 30])  # one slice per temporary, or all of them in one
@pytest.mark.parametrize("segmented", [False, True])
@pytest.mark.parametrize("src, dst", [
    (Block(16, 16, 0), Block(8, 16, 0)),  # slid down over a gap smaller than itself
    (Block(8, 16, 0), Block(16, 16, 0)),  # slid up
    (Block(16, 16, 0), Block(4, 40, 1)),  # grown over the gaps before and after it
    (Block(16, 16, 0), Block(12, 20, 1)),  # grown over a few tokens before it: every slice moves a little
    (Block(16, 8, 0), Block(0, 48, 1)),  # grown a lot: the later slices move past the block's old end
    (Block(8, 40, 0), Block(8, 16, 0)),  # shrunk in place (KVPool.keep_front): every slice moves toward the start
])
def test_overlapping_moves_keep_the_kv_intact(backend, segmented, src, dst, temp_bytes, monkeypatch):
    """Compaction slides blocks over gaps smaller than themselves and grows them over the gaps beside them: the
    source and destination of the copy overlap, and every layer's K and V must arrive intact, whatever the groups of
    slices each temporary holds."""
    import backends.base

    monkeypatch.setattr(backends.base, "OVERLAP_TEMP_BYTES", temp_bytes)
    arena = backend.create_arena(64, LAYOUT)
    if segmented:
        seg = SegmentedArena(LAYOUT)
        seg.add(0, arena)
        arena = seg
    values = _fill(arena, src, 1.0)
    n = min(src.capacity, 7)
    arena.copy(src, dst, n)
    assert torch.equal(arena.view(dst)[:, :, :n], values[:, :, :n])
