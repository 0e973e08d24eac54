"""Growth by mapping: the bookkeeping (which granules a block maps, when it is refused, that nothing leaks or
overlaps) against a recording mapper, the host's real virtual memory (mmap), and the engine on it: the same
greedy tokens as copy migration, blocks that grow without ever moving, memory back to zero."""

from __future__ import annotations

import random

import pytest
import torch

from odma.errors import InvalidRequestError, RequestTooLargeError, UnknownRequestError
from odma.kv import ExactPolicy, KVRequest, MappedKV, PlaneGeometry


class RecordingMapper:
    """Maps nothing; records which granules are mapped and refuses double maps, stray unmaps and overdraws."""

    guard_bytes = 0

    def __init__(self, granule_bytes: int, physical_granules: int) -> None:
        self.granule_bytes, self.physical_granules = granule_bytes, physical_granules
        self.mapped: set[int] = set()
        self.fail_next = False

    def map(self, byte_offset: int, n: int) -> None:
        assert byte_offset % self.granule_bytes == 0
        first = byte_offset // self.granule_bytes
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("driver says no")
        assert not self.mapped & set(range(first, first + n)), "mapped twice"
        assert len(self.mapped) + n <= self.physical_granules, "more granules than exist"
        self.mapped |= set(range(first, first + n))

    def unmap(self, byte_offset: int, n: int) -> None:
        first = byte_offset // self.granule_bytes
        assert set(range(first, first + n)) <= self.mapped, "unmapping what is not mapped"
        self.mapped -= set(range(first, first + n))


def _kv(granules: int = 240, geometry=PlaneGeometry(layers=2, row_bytes=768, granule_bytes=4096)):
    """Mapped memory that reserves exactly the predicted length first; 4 planes of 16-token steps (3 granules)."""
    mapper = RecordingMapper(geometry.granule_bytes, granules)
    return MappedKV(ExactPolicy(), geometry, mapper, virtual_tokens=64 * 1024), mapper


def test_geometry_steps_fill_whole_granules():
    smollm2 = PlaneGeometry(layers=30, row_bytes=3 * 64 * 4, granule_bytes=4096)  # fp32 on a 4 KiB page host
    assert smollm2.step_tokens == 16 and smollm2.step_granules == 3
    seven_b = PlaneGeometry(layers=28, row_bytes=4 * 128 * 2, granule_bytes=2 << 20)  # bf16 on a GPU
    assert seven_b.step_tokens == 2048 and seven_b.step_granules == 1
    for g in (smollm2, seven_b):
        assert g.unit_tokens * g.bytes_per_token % g.granule_bytes == 0  # every block starts on a granule
        assert g.unit_tokens % g.step_tokens == 0  # and so does every plane of it


def test_a_block_grows_in_place_by_mapping_each_plane():
    kv, mapper = _kv()
    g = kv.geometry
    h = kv.admit(KVRequest("a", prompt_tokens=10, max_new_tokens=200, predicted_tokens=4))  # 14 tokens: 1 step
    assert h is not None and h.block.capacity == g.layout_tokens(210) and h.capacity == 16
    assert len(mapper.mapped) == g.planes * g.step_granules
    offset = h.block.offset
    growth = kv.grow("a", 17)
    assert growth.capacity == 32 and growth.copied_tokens == 0 and not growth.moved
    assert h.block.offset == offset and h.capacity == 32  # the handle follows, the block never moves
    assert len(mapper.mapped) == 2 * g.planes * g.step_granules
    assert kv.grow("a", 30).capacity == 32  # within what is mapped: nothing new
    kv.check()
    kv.release("a", 20)
    assert not mapper.mapped and kv.free_granules == mapper.physical_granules
    kv.check()


def test_no_room_refuses_without_mapping_anything():
    kv, mapper = _kv(granules=36)  # 3 steps of every plane (4 planes x 3 granules per step): 48 tokens
    assert kv.admit(KVRequest("a", 10, 30, predicted_tokens=10)) is not None  # 20 tokens: 2 steps
    assert kv.admit(KVRequest("b", 20, 20, predicted_tokens=1)) is None  # 21 tokens: 2 steps, 1 left
    assert kv.admit(KVRequest("c", 5, 20, predicted_tokens=1)) is not None  # 6 tokens: the last step
    before = set(mapper.mapped)
    assert kv.grow("a", 33) is None  # a third step for a: none left
    assert mapper.mapped == before and len(before) == 36 and kv.counters()["pool_refusals"] == 2
    with pytest.raises(RequestTooLargeError):
        kv.admit(KVRequest("d", 20, 40))  # 60 tokens could never be mapped here
    kv.evict("a")
    assert kv.admit(KVRequest("b", 20, 20, predicted_tokens=1)) is not None
    kv.check()


def test_a_driver_refusal_unmaps_the_partial_growth_and_reports_no_room():
    kv, mapper = _kv()
    kv.admit(KVRequest("a", 10, 100, predicted_tokens=1))
    before = set(mapper.mapped)
    mapper.fail_next = True
    assert kv.grow("a", 40) is None
    assert mapper.mapped == before and kv.counters()["map_failures"] == 1
    assert kv.grow("a", 40) is not None  # the next try maps
    kv.check()


def test_bad_calls_are_refused_cleanly():
    kv, _ = _kv()
    kv.admit(KVRequest("a", 10, 20))
    with pytest.raises(InvalidRequestError, match="past its worst case"):
        kv.grow("a", 10_000)
    with pytest.raises(UnknownRequestError):
        kv.grow("nobody", 5)
    with pytest.raises(InvalidRequestError):
        kv.release("a", 21)  # more than max_new_tokens
    kv.release("a", 20)
    kv.check()


def test_random_traffic_conserves_granules_and_never_overlaps():
    kv, mapper = _kv(granules=360)
    rng = random.Random(3)
    live: dict[str, int] = {}
    for i in range(400):
        if live and rng.random() < 0.4:
            rid = rng.choice(sorted(live))
            if rng.random() < 0.5:
                kv.release(rid, 0)
            else:
                kv.evict(rid)
            live.pop(rid)
        elif live and rng.random() < 0.5:
            rid = rng.choice(sorted(live))
            new = min(live[rid] + rng.randint(1, 40), kv._live[rid].block.capacity)
            if kv.grow(rid, new) is not None:
                live[rid] = new
        else:
            req = KVRequest(f"r{i}", rng.randint(1, 60), rng.randint(1, 100), predicted_tokens=rng.randint(1, 80))
            if kv.admit(req) is not None:
                live[req.request_id] = req.prompt_tokens
        kv.check()
        assert len(mapper.mapped) + kv.free_granules == mapper.physical_granules
    for rid in list(live):
        kv.evict(rid)
    assert not mapper.mapped


# -- the host's virtual memory and the engine on it ------------------------------------------------------------------

host = pytest.mark.skipif(not __import__("backends").get_backend("cpu").capabilities.supports_vmm,
                          reason="no host virtual memory (Linux mmap) here")


def _resident_bytes() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@host
def test_host_virtual_arena_holds_memory_only_where_blocks_write():
    from backends import KVLayout, create_virtual_arena, get_backend

    layout = KVLayout(layers=2, kv_heads=2, head_dim=16)
    arena = create_virtual_arena(get_backend("cpu"), 1 << 22, layout, physical_bytes=8193 * 4096)
    try:
        # 2 GiB of address space; one granule of the 8,193 guards the range's start
        assert arena.total_tokens == 1 << 22 and arena.physical_granules == 8192
        g = arena.granule_bytes
        assert arena.guard_bytes == g
        before = _resident_bytes()
        arena.map(g, 8192)
        arena.storage[g // 4: 8193 * g // 4].fill_(2.5)  # 32 MiB written
        assert _resident_bytes() - before > 24 << 20
        arena.unmap(g, 8190)  # the memory goes back; two granules stay
        assert _resident_bytes() - before < 8 << 20
        assert float(arena.storage[8191 * g // 4]) == 2.5
        arena.map(g, 1)  # a granule mapped again holds zeros, not what a former block wrote
        assert float(arena.storage[g // 4]) == 0.0
        with pytest.raises(Exception, match="mapped already"):
            arena.map(g, 1)
        with pytest.raises(Exception, match="free"):
            arena.map(20 * g, 8190)  # 8,189 are free
        with pytest.raises(Exception, match="guard"):
            arena.map(0, 1)  # the guard is never a block's
    finally:
        arena.release()


class CudaLikeVM:
    """Host memory behind the VirtualMemory calls, refusing as CUDA does: viewing a range as a tensor asks about its
    first address (torch's pointer query), which must be mapped; every handle and range is counted so that a leak
    shows. `fail` names a call that raises as the driver or torch would."""

    def __init__(self, granularity: int = 4096, fail: str | None = None) -> None:
        from backends.host_vmm import HostVMM

        self.host = HostVMM()
        self.granularity = granularity
        self.fail = fail
        self.mapped: set[int] = set()  # addresses of mapped granules
        self.handles = self.ranges = 0

    def granules(self, nbytes):
        return -(-nbytes // self.granularity)

    def create(self, n):
        self.handles += n
        return list(range(n))

    def release(self, handles):
        self.handles -= len(handles)

    def reserve(self, nbytes):
        self.ranges += 1
        return self.host.reserve(nbytes)

    def free_range(self, ptr, nbytes):
        self.ranges -= 1
        self.host.free_range(ptr, nbytes)

    def map(self, ptr, handles):
        if self.fail == "map":
            raise RuntimeError("CUDA_ERROR_OUT_OF_MEMORY")
        new = {ptr + i * self.granularity for i in range(len(handles))}
        assert not new & self.mapped, "mapped twice"
        self.mapped |= new

    def unmap(self, ptr, n):
        gone = {ptr + i * self.granularity for i in range(n)}
        assert gone <= self.mapped, "unmapping what is not mapped"
        self.mapped -= gone

    def is_mapped(self, address: int) -> bool:
        return address - address % self.granularity in self.mapped

    def tensor(self, ptr, nbytes, dtype):
        if self.fail == "tensor" or not self.is_mapped(ptr):
            raise RuntimeError("The specified pointer resides on host memory and is not registered with any CUDA "
                               "device.")
        return self.host.tensor(ptr, nbytes, dtype)


@host
def test_the_range_start_is_mapped_before_torch_or_a_kernel_looks_at_it():
    from backends import KVLayout, VirtualArena

    vm = CudaLikeVM()
    arena = VirtualArena(vm, 4096, KVLayout(layers=2, kv_heads=2, head_dim=16), physical_granules=64)
    assert vm.is_mapped(arena.storage.data_ptr())  # what a kernel's pointer argument is
    arena.map(8 * 4096, 4)
    arena.unmap(8 * 4096, 4)
    assert vm.is_mapped(arena.storage.data_ptr())  # no block holds memory: the guard still does
    arena.release()
    assert vm.handles == vm.ranges == 0 and not vm.mapped


@host
@pytest.mark.parametrize("fail", ["tensor", "map"])
def test_a_refused_range_gives_everything_back_and_the_engine_copies(tmp_path_factory, monkeypatch, caplog, fail):
    from backends import BackendError, KVLayout, VirtualArena
    from backends.cpu import CPUBackend
    from odma.engine import SamplingParams
    from odma.engine.testing import tiny_engine
    from odma.models.tiny import make_tiny_model

    vm = CudaLikeVM(fail=fail)
    with pytest.raises(BackendError, match="CUDA|tensor"):
        VirtualArena(vm, 4096, KVLayout(layers=2, kv_heads=2, head_dim=16), physical_granules=64)
    assert vm.handles == vm.ranges == 0 and not vm.mapped
    monkeypatch.setattr(CPUBackend, "virtual_memory", lambda self: vm)
    folder = make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")
    engine = tiny_engine(folder, kv_budget="1MiB", kv_growth="map")
    assert type(engine.workers[0].kv).__name__ == "ContiguousKV"
    assert "virtual memory refused" in caplog.text and "copy migration" in caplog.text
    assert vm.handles == vm.ranges == 0
    seqs = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(seqs[0].output_ids) == 4


@host
def test_the_engine_on_a_cuda_like_driver_keeps_its_kernel_pointer_mapped(tmp_path_factory, monkeypatch):
    from backends.cpu import CPUBackend
    from odma.engine import SamplingParams
    from odma.engine.testing import tiny_engine
    from odma.models.tiny import make_tiny_model

    vm = CudaLikeVM()
    monkeypatch.setattr(CPUBackend, "virtual_memory", lambda self: vm)
    folder = make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")
    greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7], list(range(10, 40)), [3]]
    reference = [s.output_ids for s in tiny_engine(folder, kv_budget="1MiB").generate(prompts, greedy)]
    engine = tiny_engine(folder, kv_budget="64KiB", kv_growth="map", policy="s3", s3_buckets=16, predicted=1)
    kv = engine.workers[0].kv
    assert type(kv).__name__ == "MappedKV"
    storage = engine.workers[0].runner.arena.storage
    seqs = [engine.add_request(p, greedy) for p in prompts]
    while engine.has_work():
        assert vm.is_mapped(storage.data_ptr())
        engine.step()
        kv.check()
    assert [s.output_ids for s in seqs] == reference
    assert kv.counters()["growths_by_mapping"] > 0
    assert vm.mapped == {storage.data_ptr()}  # only the guard once every block is released


@host
@pytest.mark.parametrize("attention", ["auto", "triton"])
def test_the_engine_on_mapped_memory_gives_the_copy_paths_tokens(tmp_path_factory, attention):
    if attention == "triton":
        pytest.importorskip("triton")
        from backends.triton_attention import available

        if available(torch.device("cpu")) is not None:  # a GPU machine: the kernels compile for it, not the host
            pytest.skip("Triton on CPU tensors needs its interpreter")
    from odma.engine import SamplingParams
    from odma.engine.testing import tiny_engine
    from odma.models.tiny import make_tiny_model

    folder = make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7], list(range(10, 40)), [100] * 17, [3], list(range(200, 222))]
    reference = [s.output_ids for s in tiny_engine(folder, kv_budget="1MiB").generate(prompts, greedy)]
    # tight memory, 8-token buckets for 40-token outputs: every request grows by mapping, some are swapped out
    engine = tiny_engine(folder, kv_budget="64KiB", kv_growth="map", policy="s3", s3_buckets=16, predicted=1,
                         preempt="swap", attention=attention)
    kv = engine.workers[0].kv
    assert type(kv).__name__ == "MappedKV" and kv.geometry.step_tokens == 32  # 128-byte rows, 4 KiB pages
    seqs = [engine.add_request(p, greedy) for p in prompts]
    offsets: dict[str, set[int]] = {s.request_id: set() for s in seqs}
    while engine.has_work():
        engine.step()
        for s in seqs:
            if s.block is not None:
                offsets[s.request_id].add(s.block.offset)
        kv.check()
    assert [s.output_ids for s in seqs] == reference
    counters = kv.counters()
    assert counters["growths_by_mapping"] > 0 and engine.scheduler.counters.migrations == 0
    assert engine.scheduler.counters.preemptions > 0
    unswapped = [s for s in seqs if not s.preemptions]
    assert unswapped and all(len(offsets[s.request_id]) == 1 for s in unswapped)  # grew where they were
    assert kv.free_granules == kv.mapper.physical_granules and kv.mapper.mapped_granules == 0


@pytest.mark.parametrize("how", ["no virtual memory", "range refused"])
def test_without_virtual_memory_blocks_grow_by_copy(tmp_path_factory, monkeypatch, caplog, how):
    from backends import BackendError
    from backends.cpu import CPUBackend
    from odma.engine import SamplingParams
    from odma.engine.testing import tiny_engine
    from odma.models.tiny import make_tiny_model

    if how == "no virtual memory":
        monkeypatch.setattr(CPUBackend, "virtual_memory", lambda self: None)
    else:
        class Refusing:
            granularity = 4096

            def reserve(self, nbytes):
                raise BackendError("address space exhausted")

        monkeypatch.setattr(CPUBackend, "virtual_memory", lambda self: Refusing())
    folder = make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")
    engine = tiny_engine(folder, kv_budget="1MiB", kv_growth="map")
    assert type(engine.workers[0].kv).__name__ == "ContiguousKV"
    assert "blocks grow by copy migration" in caplog.text
    seqs = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(seqs[0].output_ids) == 4


@host
def test_auto_maps_where_the_granule_wastes_nothing(tmp_path_factory):
    """The tiny model's 128-byte K rows fill a 4 KiB page in 32 tokens: with a 16-token pool unit that is coarser
    than copy's, so auto copies; with a 32-token unit it maps. Ballooning always copies."""
    from odma.engine.testing import tiny_engine
    from odma.models.tiny import make_tiny_model

    folder = make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")
    kinds = {align: type(tiny_engine(folder, kv_budget="1MiB", kv_growth="auto", align=align).workers[0].kv).__name__
             for align in (16, 32)}
    assert kinds == {16: "ContiguousKV", 32: "MappedKV"}
    balloon = tiny_engine(folder, kv_budget="1MiB", kv_growth="auto", align=32, balloon=True,
                          balloon_segment_tokens=64, max_prefill_tokens=64)
    assert type(balloon.workers[0].kv).__name__ == "ContiguousKV"
