"""Device backends: the only code that allocates or copies device memory."""

from __future__ import annotations

from backends.base import Arena, Backend, Capabilities, KVLayout, MemoryInfo, NullEvent, NullStream, Span
from backends.cpu import CPUBackend
from backends.errors import BackendError
from backends.segmented import SegmentedArena
from backends.virtual_arena import VirtualArena, create_virtual_arena

__all__ = [
    "Arena", "Backend", "BackendError", "CPUBackend", "Capabilities", "KVLayout", "MemoryInfo", "NullEvent", "NullStream",
    "SegmentedArena", "Span", "VirtualArena", "available_devices", "create_virtual_arena", "get_backend", "parse_device",
]

KINDS = ("cpu", "cuda", "mlu")


def parse_device(device: str) -> tuple[str, int]:
    """'cpu' | 'cuda' | 'cuda:1' | 'mlu:0' → (kind, index); BackendError on anything else."""
    if not isinstance(device, str):
        raise BackendError(f"device must be a string such as 'cpu', 'cuda:0' or 'mlu:0', got {device!r}")
    kind, _, idx = device.strip().lower().partition(":")
    if kind not in KINDS:
        raise BackendError(f"unknown device {device!r}: expected one of {', '.join(KINDS)} (optionally ':N')")
    if idx == "":
        return kind, 0
    if not idx.isdigit():
        raise BackendError(f"device index in {device!r} must be a non-negative integer")
    return kind, int(idx)


def get_backend(device: str = "cpu") -> Backend:
    """The backend for 'cpu', 'cuda[:N]' or 'mlu[:N]'; BackendError if that device cannot be used here."""
    kind, index = parse_device(device)
    if kind == "cpu":
        return CPUBackend()
    if kind == "cuda":
        from backends.cuda import CUDABackend

        return CUDABackend(index)
    from backends.mlu import MLUBackend

    return MLUBackend(index)


def available_devices() -> list[str]:
    """Devices usable in this process: always 'cpu', then every visible CUDA device (MLU is not probed:
    importing torch_mlu has side effects, so ask for it explicitly)."""
    import torch

    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return devices
