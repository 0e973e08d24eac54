"""The reference backend: host memory through torch (synchronous; streams and events are no-ops)."""

from __future__ import annotations

import os
import platform

import torch

from backends import cpu_attention, cpu_linear, cpu_step
from backends.base import Backend, Capabilities, MemoryInfo
from backends.cpu_attention import DecodeAttention
from backends.cpu_linear import LinearKernel
from backends.cpu_step import DecodeStepKernel
from backends.host_vmm import HostVMM, open_host_vmm


class CPUBackend(Backend):
    name = "cpu"
    # no streams, no pinned memory (nothing to pin against); virtual memory through mmap on Linux. Weights and
    # activations in float32 unless asked; KV stored in float16 (half the bytes a decode step streams) and attended
    # in float32; the C kernels run the layers and the decode attention; every cpu:N shares the same cores.
    capabilities = Capabilities(
        supports_vmm=open_host_vmm() is not None,
        default_dtype="float32",
        default_kv_dtype="float16",
        widens_half_kv=True,
        native_layers=True,
        attention="native",
        parallel_pools=False,
    )

    def __init__(self, index: int = 0) -> None:
        pass  # cpu:N are pools over the same host: the index names a pool, not a device

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def describe(self) -> str:
        try:
            with open("/proc/cpuinfo") as f:
                names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
            return f"{names[0]} ({len(names)} logical CPUs)"
        except (OSError, IndexError):
            return f"{platform.machine()} ({os.cpu_count()} logical CPUs)"

    def decode_attention(self) -> DecodeAttention | None:
        return cpu_attention.load()

    def linear_kernel(self) -> LinearKernel | None:
        return cpu_linear.load()

    def decode_step(self) -> DecodeStepKernel | None:
        return cpu_step.load() if cpu_step.step_mode() != "python" else None

    def virtual_memory(self) -> HostVMM | None:
        return open_host_vmm()

    def synchronize(self) -> None:
        pass  # CPU ops are synchronous

    def memory_info(self) -> MemoryInfo:
        page_size = os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * page_size
        free = os.sysconf("SC_AVPHYS_PAGES") * page_size
        used = _process_rss_bytes()  # the process's resident set stands in for "used by the framework"
        return MemoryInfo(total_bytes=total, free_bytes=free, framework_bytes=used, framework_reserved_bytes=used)


def _process_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
