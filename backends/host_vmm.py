"""Virtual memory on the host, the same calls as `cuda_vmm.CudaVMM`: a range reserved with mmap(MAP_NORESERVE) holds
no memory until it is written (the kernel commits a page on its first write: that is what mapping a granule means
here, so `map` itself is free), and unmapping gives the pages back (madvise MADV_DONTNEED; read again, they are
zeros). The granule is the page size. Linux only (libc's mmap and madvise through ctypes).

Why no protection change: making unmapped granules inaccessible (mprotect PROT_NONE), so that a stray read faults,
splits the range into one kernel mapping per mapped plane (thousands); measured on the engine, its decode steps took
79-82 ms instead of 66-68 ms. The KV bookkeeping (odma/kv/mapped.py, tested against a recording mapper) is what
keeps blocks within what they map."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

import torch

from backends.errors import BackendError

PROT_READ, PROT_WRITE = 1, 2
MAP_PRIVATE, MAP_ANONYMOUS, MAP_NORESERVE = 0x02, 0x20, 0x4000
MADV_DONTNEED = 4
MAP_FAILED = ctypes.c_void_p(-1).value


class HostVMM:
    def __init__(self) -> None:
        if not sys.platform.startswith("linux"):
            raise BackendError("host virtual memory uses Linux's mmap flags")
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self._libc = libc
        self.granularity = os.sysconf("SC_PAGE_SIZE")

    def _check(self, code: int, call: str) -> None:
        if code != 0:
            err = ctypes.get_errno()
            raise BackendError(f"{call} failed: {os.strerror(err)}")

    def granules(self, nbytes: int) -> int:
        return -(-nbytes // self.granularity)

    def create(self, n: int) -> list[int]:
        """Physical granules: the host commits pages on first write, so these are place holders."""
        return [0] * n

    def release(self, handles: list[int]) -> None:
        pass

    def reserve(self, nbytes: int) -> int:
        size = self.granules(nbytes) * self.granularity
        ptr = self._libc.mmap(None, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        if ptr in (None, MAP_FAILED):
            raise BackendError(f"mmap of {size} bytes of address space failed: {os.strerror(ctypes.get_errno())}")
        return ptr

    def free_range(self, ptr: int, nbytes: int) -> None:
        self._check(self._libc.munmap(ptr, self.granules(nbytes) * self.granularity), "munmap")

    def map(self, ptr: int, handles: list[int]) -> None:
        """Nothing to do: the pages are committed when the block first writes them."""

    def unmap(self, ptr: int, n_granules: int) -> None:
        self._check(self._libc.madvise(ptr, n_granules * self.granularity, MADV_DONTNEED), "madvise")

    def tensor(self, ptr: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat tensor over the range (what no block maps reads as zeros and holds no memory)."""
        return torch.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=dtype)


def open_host_vmm() -> HostVMM | None:
    try:
        return HostVMM()
    except (BackendError, OSError, AttributeError):
        return None
