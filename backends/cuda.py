"""NVIDIA GPUs through torch.cuda (the shared torch-device code; what is CUDA's own: its driver's virtual memory and
graph capture)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from backends.torch_device import TorchDeviceBackend


class CUDABackend(TorchDeviceBackend):
    # decode batches captured as CUDA graphs by default (--decode-graphs auto)
    capabilities = replace(TorchDeviceBackend.capabilities, graphs=True)

    def __init__(self, index: int = 0) -> None:
        super().__init__("cuda", torch.cuda, index)

    def _open_vmm(self, index: int) -> Any:
        from backends.cuda_vmm import open_vmm

        return open_vmm(index)
