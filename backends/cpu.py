"""The reference backend: host memory through torch."""

from __future__ import annotations

import os

import torch

from backends.base import Backend


class CPUBackend(Backend):
    name = "cpu"

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def synchronize(self) -> None:
        pass  # CPU ops are synchronous

    def memory_info(self) -> tuple[int, int]:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        avail = os.sysconf("SC_AVPHYS_PAGES")
        return avail * page_size, pages * page_size
