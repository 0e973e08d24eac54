"""CUDA virtual memory: reserve virtual ranges, back them with physical memory granule by granule, view them as
tensors. The driver API (cuMemAddressReserve / cuMemCreate / cuMemMap / cuMemSetAccess) is called through ctypes on
libcuda, which every CUDA driver installs, so nothing beyond torch is needed.

Physical granules are made once (`create`) and then mapped and unmapped as blocks grow and end: growing a block is
mapping more granules behind its virtual range, no byte moves. The granule is the driver's minimum allocation
granularity (2 MiB on current NVIDIA GPUs). Cambricon's CNDrv has the same calls (cnMemAddressReserve, cnMemCreate,
cnMemMap, cnMemSetAccess); that variant is not written.
"""

from __future__ import annotations

import ctypes
import torch

from backends.errors import BackendError

CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class DriverError(BackendError):
    """A CUDA driver call failed (the code and its name from cuGetErrorName)."""


class _ArrayInterface:
    """What torch.as_tensor needs to view device memory it did not allocate."""

    def __init__(self, desc: dict) -> None:
        self.__cuda_array_interface__ = desc


def _load() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise BackendError(f"CUDA virtual memory needs the driver library libcuda.so.1: {e}") from e


class CudaVMM:
    """One device's virtual memory. Not thread-safe: the engine calls it from its one scheduling thread."""

    def __init__(self, index: int = 0) -> None:
        if not torch.cuda.is_available():
            raise BackendError("CUDA virtual memory needs a CUDA device")
        self.index = index
        torch.cuda.set_device(index)
        torch.empty(1, device=f"cuda:{index}")  # the primary context exists and is current on this thread
        self._cu = _load()
        device = ctypes.c_int()
        self._check(self._cu.cuDeviceGet(ctypes.byref(device), index), "cuDeviceGet")
        supported = ctypes.c_int()
        self._check(self._cu.cuDeviceGetAttribute(ctypes.byref(supported),
                                                  CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device),
                    "cuDeviceGetAttribute")
        if not supported.value:
            raise BackendError(f"cuda:{index} does not support virtual memory management")
        self._prop = _AllocationProp(type=CU_MEM_ALLOCATION_TYPE_PINNED,
                                     location=_Location(CU_MEM_LOCATION_TYPE_DEVICE, index))
        self._access = _AccessDesc(location=_Location(CU_MEM_LOCATION_TYPE_DEVICE, index),
                                   flags=CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        gran = ctypes.c_size_t()
        self._check(self._cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(self._prop),
                                                           CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                    "cuMemGetAllocationGranularity")
        self.granularity = gran.value

    def _check(self, code: int, call: str) -> None:
        if code:
            name = ctypes.c_char_p()
            self._cu.cuGetErrorName(code, ctypes.byref(name))
            raise DriverError(f"{call} failed: {code} ({(name.value or b'?').decode()})")

    def granules(self, nbytes: int) -> int:
        return -(-nbytes // self.granularity)

    def create(self, n: int) -> list[int]:
        """n physical granules (device memory), not yet mapped anywhere."""
        handles = []
        try:
            for _ in range(n):
                h = ctypes.c_ulonglong()
                self._check(self._cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(self.granularity),
                                                 ctypes.byref(self._prop), ctypes.c_ulonglong(0)), "cuMemCreate")
                handles.append(h.value)
        except DriverError:
            self.release(handles)
            raise
        return handles

    def release(self, handles: list[int]) -> None:
        for h in handles:
            self._cu.cuMemRelease(ctypes.c_ulonglong(h))

    def reserve(self, nbytes: int) -> int:
        """A virtual range of at least nbytes (whole granules), nothing behind it yet; returns its address."""
        ptr = ctypes.c_ulonglong()
        size = self.granules(nbytes) * self.granularity
        self._check(self._cu.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                                 ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)), "cuMemAddressReserve")
        return ptr.value

    def free_range(self, ptr: int, nbytes: int) -> None:
        """Give a reserved range back (unmap what is mapped in it first)."""
        size = self.granules(nbytes) * self.granularity
        self._check(self._cu.cuMemAddressFree(ctypes.c_ulonglong(ptr), ctypes.c_size_t(size)), "cuMemAddressFree")

    def map(self, ptr: int, handles: list[int]) -> None:
        """Back len(handles) granules from `ptr` (granule-aligned) with those granules, readable and writable. On a
        failure nothing stays mapped."""
        g = self.granularity
        done = 0
        try:
            for i, h in enumerate(handles):
                self._check(self._cu.cuMemMap(ctypes.c_ulonglong(ptr + i * g), ctypes.c_size_t(g), ctypes.c_size_t(0),
                                              ctypes.c_ulonglong(h), ctypes.c_ulonglong(0)), "cuMemMap")
                done += 1
            self._check(self._cu.cuMemSetAccess(ctypes.c_ulonglong(ptr), ctypes.c_size_t(len(handles) * g),
                                                ctypes.byref(self._access), ctypes.c_size_t(1)), "cuMemSetAccess")
        except DriverError:
            if done:
                self.unmap(ptr, done)
            raise

    def unmap(self, ptr: int, n_granules: int) -> None:
        """Unmap n granules from `ptr`; their physical memory stays (the handles), ready to map elsewhere."""
        self._check(self._cu.cuMemUnmap(ctypes.c_ulonglong(ptr), ctypes.c_size_t(n_granules * self.granularity)),
                    "cuMemUnmap")

    def tensor(self, ptr: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat tensor of `dtype` over [ptr, ptr + nbytes): reading or writing an unmapped part faults, so only
        touch what is mapped. The caller keeps the range reserved while the tensor lives."""
        elem = torch.empty((), dtype=dtype).element_size()
        raw = _ArrayInterface({"shape": (nbytes // elem,), "typestr": f"<i{elem}", "data": (ptr, False),
                               "version": 3, "strides": None})
        return torch.as_tensor(raw, device=f"cuda:{self.index}").view(dtype)


def open_vmm(index: int = 0) -> CudaVMM | None:
    """The device's virtual memory, or None where it cannot be had (no driver library, no support)."""
    try:
        return CudaVMM(index)
    except BackendError:
        return None
