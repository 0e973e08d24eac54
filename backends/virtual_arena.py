"""A KV arena over reserved virtual memory: blocks are viewed and copied as in any `Arena`, but only the granules
mapped behind them hold memory, so a block grows by mapping more granules where it lies, never by a copy.

The physical granules (the KV budget) are made once, at start (CUDA: cuMemCreate; the host commits pages on first
write) and then move between blocks: `map(byte_offset, n)` backs n granules of the range with free ones,
`unmap(byte_offset, n)` returns them. Which bytes to map is the KV manager's decision (odma/kv/mapped.py).
"""

from __future__ import annotations

from typing import Any

from backends.base import Arena, KVLayout
from backends.errors import BackendError
from backends.virtual_memory import VirtualMemory


class VirtualArena(Arena):
    def __init__(self, vm: VirtualMemory, virtual_tokens: int, layout: KVLayout, physical_granules: int) -> None:
        if virtual_tokens < 1 or physical_granules < 1:
            raise BackendError("a virtual arena needs address space and at least one physical granule")
        self.vm = vm
        self.granule_bytes = vm.granularity
        self.virtual_bytes = virtual_tokens * layout.bytes_per_token
        self.ptr = vm.reserve(self.virtual_bytes)
        try:
            self._free = vm.create(physical_granules)
        except BackendError:
            vm.free_range(self.ptr, self.virtual_bytes)
            raise
        self.physical_granules = physical_granules
        self._mapped: dict[int, int] = {}  # granule index in the range → its physical handle
        super().__init__(vm.tensor(self.ptr, self.virtual_bytes, layout.dtype), layout, virtual_tokens)

    @property
    def nbytes(self) -> int:
        """The physical memory the arena holds (mapped or not): what it costs the device."""
        return self.physical_granules * self.granule_bytes

    @property
    def mapped_granules(self) -> int:
        return len(self._mapped)

    def map(self, byte_offset: int, n: int) -> None:
        """Back n granules from byte_offset (granule-aligned, none mapped yet) with free physical granules."""
        first = self._granule(byte_offset)
        if n > len(self._free):
            raise BackendError(f"{n} granules asked, {len(self._free)} free")
        if any(first + i in self._mapped for i in range(n)):
            raise BackendError(f"granules {first}..{first + n - 1} are mapped already")
        handles = self._free[len(self._free) - n:]
        self.vm.map(self.ptr + byte_offset, handles)
        del self._free[len(self._free) - n:]
        for i, h in enumerate(handles):
            self._mapped[first + i] = h

    def unmap(self, byte_offset: int, n: int) -> None:
        """Return n mapped granules from byte_offset to the free ones (their content is gone)."""
        first = self._granule(byte_offset)
        handles = [self._mapped.get(first + i) for i in range(n)]
        if None in handles:
            raise BackendError(f"granules {first}..{first + n - 1} are not all mapped")
        self.vm.unmap(self.ptr + byte_offset, n)
        for i in range(n):
            del self._mapped[first + i]
        self._free += handles

    def _granule(self, byte_offset: int) -> int:
        if byte_offset % self.granule_bytes or not 0 <= byte_offset < self.virtual_bytes:
            raise BackendError(f"byte offset {byte_offset} is not a granule of this range")
        return byte_offset // self.granule_bytes

    def release(self) -> None:
        """Unmap everything, give the physical granules and the range back."""
        for g in sorted(self._mapped):
            self.vm.unmap(self.ptr + g * self.granule_bytes, 1)
        self._free += self._mapped.values()
        self._mapped.clear()
        self.vm.release(self._free)
        self._free = []
        super().release()
        self.vm.free_range(self.ptr, self.virtual_bytes)


def create_virtual_arena(backend: Any, virtual_tokens: int, layout: KVLayout,
                         physical_bytes: int) -> VirtualArena | None:
    """An arena of `virtual_tokens` token slots of address space on `backend`'s device, backed by `physical_bytes` of
    memory (whole granules) that the KV manager maps where blocks grow; None where the backend has no virtual
    memory (`Backend.virtual_memory`)."""
    vm = backend.virtual_memory()
    if vm is None:
        return None
    return VirtualArena(vm, virtual_tokens, layout, physical_bytes // vm.granularity)
