"""NVIDIA GPUs through torch.cuda (the shared torch-device code; nothing CUDA-specific beyond the name)."""

from __future__ import annotations

import torch

from backends.torch_device import TorchDeviceBackend


class CUDABackend(TorchDeviceBackend):
    def __init__(self, index: int = 0) -> None:
        super().__init__("cuda", torch.cuda, index)
