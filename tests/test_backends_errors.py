"""Device strings and the errors for devices this process cannot use."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from backends import CPUBackend, available_devices, get_backend, parse_device
from backends import BackendError


@pytest.mark.parametrize("spec,expect", [("cpu", ("cpu", 0)), ("cuda", ("cuda", 0)), ("cuda:1", ("cuda", 1)),
                                         ("mlu:3", ("mlu", 3)), (" MLU:0 ", ("mlu", 0))])
def test_parse_device(spec, expect):
    assert parse_device(spec) == expect


@pytest.mark.parametrize("spec", ["tpu", "cuda:x", "cuda:-1", "", "mlu:", 3])
def test_bad_device_strings_are_config_errors(spec):
    with pytest.raises(BackendError):
        get_backend(spec)


def test_cpu_is_always_available():
    assert isinstance(get_backend("cpu"), CPUBackend) and available_devices()[0] == "cpu"


@pytest.mark.skipif(importlib.util.find_spec("torch_mlu") is not None, reason="torch_mlu is installed here")
def test_mlu_without_torch_mlu_says_what_is_missing():
    with pytest.raises(BackendError, match="torch_mlu.*Cambricon.*not on PyPI"):
        get_backend("mlu:0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_cuda_without_a_gpu_is_a_config_error():
    with pytest.raises(BackendError, match="is_available"):
        get_backend("cuda:0")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_cuda_index_out_of_range():
    with pytest.raises(BackendError, match="out of range"):
        get_backend(f"cuda:{torch.cuda.device_count()}")
