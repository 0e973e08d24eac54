"""Cambricon MLU through torch_mlu (`import torch_mlu` registers `torch.mlu` and devices `mlu:N`).

torch_mlu is not on PyPI and is imported only when this backend is created. Everything else is the
shared torch-device code that CUDA also runs."""

from __future__ import annotations

import importlib
from dataclasses import replace

import torch

from backends.errors import BackendError
from backends.torch_device import TorchDeviceBackend


def load_torch_mlu():
    """Import torch_mlu and return `torch.mlu`, or raise BackendError saying what is missing."""
    try:
        importlib.import_module("torch_mlu")
    except ImportError as e:
        raise BackendError(
            "the MLU backend needs torch_mlu (Cambricon's PyTorch extension, shipped with the Cambricon "
            f"SDK, not on PyPI), which could not be imported: {e}. Install the torch_mlu build that matches "
            f"torch {torch.__version__}, or choose --device cpu / cuda"
        ) from e
    module = getattr(torch, "mlu", None)
    if module is None:
        raise BackendError("torch_mlu was imported but did not register torch.mlu; check the torch_mlu version")
    return module


class MLUBackend(TorchDeviceBackend):
    capabilities = replace(TorchDeviceBackend.capabilities, torch_extension="torch_mlu")

    def __init__(self, index: int = 0) -> None:
        super().__init__("mlu", load_torch_mlu(), index)
