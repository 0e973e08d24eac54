"""A KV arena over reserved virtual memory: blocks are viewed and copied as in any `Arena`, but only the granules
mapped behind them hold memory, so a block grows by mapping more granules where it lies, never by a copy.

The physical granules (the KV budget) are made once, at start (CUDA: cuMemCreate; the host commits pages on first
write) and then move between blocks: `map(byte_offset, n)` backs n granules of the range with free ones,
`unmap(byte_offset, n)` returns them. Which bytes to map is the KV manager's decision (odma/kv/mapped.py).

The range's first granule is a guard, mapped for the arena's whole life and never given to a block: CUDA answers
questions about an address only where memory is mapped, and both torch (viewing the range as a tensor) and Triton's
launcher (checking a kernel's pointer arguments) ask about the range's first address. So the guard is mapped before
the tensor is built, and blocks start after it (`guard_bytes`).
"""

from __future__ import annotations

import logging
from typing import Any

from backends.base import Arena, KVLayout
from backends.errors import BackendError
from backends.virtual_memory import VirtualMemory

log = logging.getLogger(__name__)


class VirtualArena(Arena):
    def __init__(self, vm: VirtualMemory, virtual_tokens: int, layout: KVLayout, physical_granules: int) -> None:
        """physical_granules: the memory it holds, the guard included (so blocks map one fewer)."""
        if virtual_tokens < 1 or physical_granules < 2:
            raise BackendError("a virtual arena needs address space and at least two physical granules (one guards "
                               "the range's start)")
        self.vm = vm
        self.granule_bytes = vm.granularity
        self.guard_bytes = self.granule_bytes
        self.virtual_bytes = virtual_tokens * layout.bytes_per_token
        if self.virtual_bytes <= self.guard_bytes:
            raise BackendError(f"a virtual arena of {self.virtual_bytes} bytes has no room after its "
                               f"{self.guard_bytes}-byte guard")
        self.ptr = vm.reserve(self.virtual_bytes)
        handles: list[int] = []
        guard_mapped = False
        try:
            handles = vm.create(physical_granules)
            vm.map(self.ptr, handles[:1])
            guard_mapped = True
            storage = vm.tensor(self.ptr, self.virtual_bytes, layout.dtype)
        except Exception as exc:  # noqa: BLE001 - a driver or torch refusal: give everything back, say why
            if guard_mapped:
                vm.unmap(self.ptr, 1)
            vm.release(handles)
            vm.free_range(self.ptr, self.virtual_bytes)
            if isinstance(exc, BackendError):
                raise
            raise BackendError(f"virtual memory could not be viewed as a tensor: {type(exc).__name__}: {exc}") from exc
        self._guard = handles[0]
        self._free = handles[1:]
        self.physical_granules = physical_granules - 1  # what blocks can map
        self._mapped: dict[int, int] = {}  # granule index in the range → its physical handle
        super().__init__(storage, layout, virtual_tokens)

    @property
    def nbytes(self) -> int:
        """The physical memory the arena holds (mapped or not, the guard too): what it costs the device."""
        return (self.physical_granules + 1) * self.granule_bytes

    @property
    def mapped_granules(self) -> int:
        """Granules mapped behind blocks (the guard not counted)."""
        return len(self._mapped)

    def map(self, byte_offset: int, n: int) -> None:
        """Back n granules from byte_offset (granule-aligned, after the guard, none mapped yet) with free physical
        granules."""
        first = self._granule(byte_offset)
        if n > len(self._free):
            raise BackendError(f"{n} granules asked, {len(self._free)} free")
        if any(first + i in self._mapped for i in range(n)):
            raise BackendError(f"granules {first}..{first + n - 1} are mapped already")
        if (first + n) * self.granule_bytes > self.virtual_bytes:
            raise BackendError(f"granules {first}..{first + n - 1} run past the range")
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
        if byte_offset % self.granule_bytes or not self.guard_bytes <= byte_offset < self.virtual_bytes:
            raise BackendError(f"byte offset {byte_offset} is not a granule of this range after its guard")
        return byte_offset // self.granule_bytes

    def release(self) -> None:
        """Unmap everything (the guard last), give the physical granules and the range back."""
        if self.released:
            return
        for g in sorted(self._mapped):
            self.vm.unmap(self.ptr + g * self.granule_bytes, 1)
        self._free += self._mapped.values()
        self._mapped.clear()
        super().release()  # the tensor goes before the memory under it
        self.vm.unmap(self.ptr, 1)
        self.vm.release(self._free + [self._guard])
        self._free = []
        self.vm.free_range(self.ptr, self.virtual_bytes)


def create_virtual_arena(backend: Any, virtual_tokens: int, layout: KVLayout,
                         physical_bytes: int) -> VirtualArena | None:
    """An arena of `virtual_tokens` token slots of address space on `backend`'s device, backed by `physical_bytes` of
    memory (whole granules, one of them the guard) that the KV manager maps where blocks grow; None where the backend
    has no virtual memory (`Backend.virtual_memory`). BackendError where the device refuses (the caller falls back
    to copy migration)."""
    vm = backend.virtual_memory()
    if vm is None:
        return None
    return VirtualArena(vm, virtual_tokens, layout, physical_bytes // vm.granularity)
