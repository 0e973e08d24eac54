"""Device backends: the only code that allocates or copies device memory."""

from __future__ import annotations

import functools
import importlib

import torch

from backends.base import Arena, Backend, Capabilities, KVLayout, MemoryInfo, NullEvent, NullStream, Span
from backends.cpu import CPUBackend
from backends.errors import BackendError
from backends.segmented import SegmentedArena
from backends.virtual_arena import VirtualArena, create_virtual_arena

__all__ = [
    "BACKENDS", "Arena", "Backend", "BackendError", "CPUBackend", "Capabilities", "KVLayout", "MemoryInfo", "NullEvent",
    "NullStream", "SegmentedArena", "Span", "VirtualArena", "available_devices", "create_virtual_arena", "for_device",
    "get_backend", "parse_device",
]

# The registry: a device kind -> the backend class that serves `<kind>[:N]`, as "module:Class", imported when a device
# of that kind is first asked for (so mlu's module loads only for an MLU). A new accelerator is a module in backends/
# declaring its `Capabilities`, and a line here; nothing outside backends/ names a device.
BACKENDS: dict[str, str] = {
    "cpu": "backends.cpu:CPUBackend",
    "cuda": "backends.cuda:CUDABackend",
    "mlu": "backends.mlu:MLUBackend",
}


def parse_device(device: str) -> tuple[str, int]:
    """'cpu' | 'cuda' | 'cuda:1' | 'mlu:0' (a kind in BACKENDS, optionally ':N') → (kind, index); BackendError on
    anything else."""
    if not isinstance(device, str):
        raise BackendError(f"device must be a string such as 'cpu', 'cuda:0' or 'mlu:0', got {device!r}")
    kind, _, idx = device.strip().lower().partition(":")
    if kind not in BACKENDS:
        raise BackendError(f"unknown device {device!r}: expected one of {', '.join(BACKENDS)} (optionally ':N')")
    if idx == "":
        return kind, 0
    if not idx.isdigit():
        raise BackendError(f"device index in {device!r} must be a non-negative integer")
    return kind, int(idx)


def for_device(device: str | torch.device) -> type[Backend]:
    """The backend class serving `device` (a spec such as 'cuda:1', or a torch.device: where a tensor lives), without
    opening the device: its `capabilities` answer what the engine decides by device. BackendError for a device no
    backend serves."""
    kind = device.type if isinstance(device, torch.device) else parse_device(device)[0]
    entry = BACKENDS.get(kind)
    if entry is None:
        raise BackendError(f"no backend serves device {str(device)!r} (backends: {', '.join(BACKENDS)})")
    return _backend_class(entry)


@functools.cache
def _backend_class(entry: str) -> type[Backend]:
    module, _, attribute = entry.partition(":")
    cls = getattr(importlib.import_module(module), attribute, None)
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise BackendError(f"backend registry entry {entry!r} names no Backend class")
    return cls


def get_backend(device: str = "cpu") -> Backend:
    """The opened backend for 'cpu', 'cuda[:N]', 'mlu[:N]' (any kind in BACKENDS); BackendError if that device
    cannot be used here."""
    kind, index = parse_device(device)
    return for_device(kind)(index)


def available_devices() -> list[str]:
    """Devices usable in this process: always 'cpu', then every visible CUDA device (MLU is not probed:
    importing torch_mlu has side effects, so ask for it explicitly)."""
    import torch

    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return devices
