"""Accelerators that torch drives through a `torch.<kind>` module with the torch.cuda API shape
(`synchronize`, `mem_get_info`, `memory_allocated`, `memory_reserved`, `empty_cache`, `Stream`, `Event`,
`stream`). CUDA and Cambricon MLU (torch_mlu registers `torch.mlu`) differ only in the module name, so
everything that runs here on CUDA is the code that would run on MLU."""

from __future__ import annotations

from dataclasses import replace
from types import ModuleType
from typing import Any, Callable, ContextManager

import torch

from backends.base import Backend, Capabilities, MemoryInfo
from backends.errors import BackendError


class TorchDeviceBackend(Backend):
    # what holds before a device is opened; opening probes virtual memory and pinning
    capabilities = Capabilities(supports_streams=True, returns_memory_to_driver=True, cheap_block_copies=True,
                                steps_off_host=True)

    def __init__(self, kind: str, module: ModuleType, index: int = 0) -> None:
        if not module.is_available():
            raise BackendError(f"backend {kind}:{index}: torch.{kind}.is_available() is False (no device visible)")
        count = module.device_count()
        if not 0 <= index < count:
            raise BackendError(f"backend {kind}:{index}: device index out of range ({count} device(s) visible)")
        self.name = kind
        self._mod = module
        self._device = torch.device(kind, index)
        self._vmm = self._open_vmm(index)
        self._graph_pool: Any = None
        self.capabilities = replace(type(self).capabilities, supports_vmm=self._vmm is not None, pinned_host=_can_pin())

    @property
    def device(self) -> torch.device:
        return self._device

    def _open_vmm(self, index: int) -> Any:
        """The device's driver-level virtual memory, where a subclass has it (None: growth copies)."""
        return None

    def virtual_memory(self) -> Any:
        return self._vmm

    def describe(self) -> str:
        try:
            p = self._mod.get_device_properties(self._device)
            return f"{p.name} ({p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB)"
        except Exception:  # noqa: BLE001 - a name is nice to have (a runtime may lack a property), never worth failing
            return str(self._device)

    def capture_graph(self, fn: Callable[[], Any]) -> Callable[[], Any] | None:
        """Graphs through the module's torch.cuda-shaped API (`CUDAGraph`, `graph`, `graph_pool_handle`), all captures
        sharing one memory pool as vLLM's do, where `capabilities.graphs` declares them (CUDA; torch_mlu's graph API
        is not written against). Capture runs on a side stream, as torch requires."""
        if not self.capabilities.graphs:
            return None
        mod = self._mod
        if self._graph_pool is None:
            self._graph_pool = mod.graph_pool_handle()
        side = mod.Stream(device=self._device)
        side.wait_stream(mod.current_stream(self._device))
        with mod.stream(side):
            fn()
            fn()
        mod.current_stream(self._device).wait_stream(side)
        graph = mod.CUDAGraph()
        with mod.graph(graph, pool=self._graph_pool):
            out = fn()

        def replay() -> Any:
            graph.replay()
            return out

        replay.graph = graph  # kept alive with the replay
        return replay

    def timing_events(self) -> tuple[Any, Any] | None:
        return self._mod.Event(enable_timing=True), self._mod.Event(enable_timing=True)

    def synchronize(self) -> None:
        self._mod.synchronize(self._device)

    def empty_cache(self) -> None:
        self._mod.empty_cache()

    def new_stream(self) -> Any:
        return self._mod.Stream(device=self._device)

    def current_stream(self) -> Any:
        return self._mod.current_stream(self._device)

    def new_event(self) -> Any:
        return self._mod.Event()

    def use_stream(self, stream: Any) -> ContextManager:
        return self._mod.stream(stream)

    def memory_info(self) -> MemoryInfo:
        free, total = self._mod.mem_get_info(self._device)
        return MemoryInfo(
            total_bytes=int(total),
            free_bytes=int(free),
            framework_bytes=int(self._mod.memory_allocated(self._device)),
            framework_reserved_bytes=int(self._mod.memory_reserved(self._device)),
        )


    def activation_peak_bytes(self, fn: Callable[[], Any]) -> int:
        """The caching allocator's own peak counter (exact, and cheaper than replaying events)."""
        self.synchronize()
        before = int(self._mod.memory_allocated(self._device))
        self._mod.reset_peak_memory_stats(self._device)
        fn()
        self.synchronize()
        return max(0, int(self._mod.max_memory_allocated(self._device)) - before)


def _can_pin() -> bool:
    try:
        return torch.empty(1, pin_memory=True).is_pinned()
    except RuntimeError:  # no accelerator runtime to register page-locked memory with
        return False
