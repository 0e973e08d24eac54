"""Virtual memory on the host, the same calls as `cuda_vmm.CudaVMM`: a range reserved with mmap(PROT_NONE,
MAP_NORESERVE) holds no memory; mapping a granule makes it readable and writable (the kernel commits its pages on
first write), unmapping drops the pages (madvise MADV_DONTNEED) and makes the granule inaccessible again, so a stray
read of memory a block no longer holds faults instead of reading stale K/V. The granule is the page size. Linux only
(libc's mmap, mprotect, madvise through ctypes)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

import torch

from backends.errors import BackendError

PROT_NONE, PROT_READ, PROT_WRITE = 0, 1, 2
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
        for name in ("mprotect", "madvise"):
            getattr(libc, name).argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
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
        ptr = self._libc.mmap(None, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        if ptr in (None, MAP_FAILED):
            raise BackendError(f"mmap of {size} bytes of address space failed: {os.strerror(ctypes.get_errno())}")
        return ptr

    def free_range(self, ptr: int, nbytes: int) -> None:
        self._check(self._libc.munmap(ptr, self.granules(nbytes) * self.granularity), "munmap")

    def map(self, ptr: int, handles: list[int]) -> None:
        self._check(self._libc.mprotect(ptr, len(handles) * self.granularity, PROT_READ | PROT_WRITE), "mprotect")

    def unmap(self, ptr: int, n_granules: int) -> None:
        size = n_granules * self.granularity
        self._check(self._libc.madvise(ptr, size, MADV_DONTNEED), "madvise")
        self._check(self._libc.mprotect(ptr, size, PROT_NONE), "mprotect")

    def tensor(self, ptr: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat tensor over the range; touching an unmapped granule faults."""
        return torch.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=dtype)


def open_host_vmm() -> HostVMM | None:
    try:
        return HostVMM()
    except (BackendError, OSError, AttributeError):
        return None
