"""CUDA virtual memory through the driver API: granules mapped behind a reserved range hold data, growing a range
maps more granules without moving what is there, and unmapped granules can be mapped elsewhere. Needs a CUDA device
(scripts/gpu_check.sh runs it on one); elsewhere only the refusal is checked."""

from __future__ import annotations

import pytest
import torch

from backends.cuda_vmm import open_vmm

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_without_a_gpu_there_is_no_virtual_memory():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    assert open_vmm() is None


@cuda
def test_growth_by_mapping_keeps_the_data_in_place():
    vmm = open_vmm()
    assert vmm is not None and vmm.granularity >= 4096
    g = vmm.granularity
    span = 4 * g
    ptr = vmm.reserve(span)
    first, more = vmm.create(1), vmm.create(2)
    try:
        vmm.map(ptr, first)
        view = vmm.tensor(ptr, g, torch.float32)
        view.copy_(torch.arange(g // 4, dtype=torch.float32, device=view.device))
        vmm.map(ptr + g, more)  # grow: two more granules right behind, nothing copied
        grown = vmm.tensor(ptr, 3 * g, torch.float32)
        assert torch.equal(grown[: g // 4], torch.arange(g // 4, dtype=torch.float32, device=view.device))
        grown[g // 4:].fill_(7.0)
        torch.cuda.synchronize()
        assert float(grown[-1]) == 7.0
        del view, grown
        vmm.unmap(ptr + g, 2)
        vmm.map(ptr + 2 * g, more[:1])  # a granule unmapped from one place maps at another
        vmm.unmap(ptr + 2 * g, 1)
        vmm.unmap(ptr, 1)
    finally:
        vmm.release(first + more)
        vmm.free_range(ptr, span)


@cuda
def test_bf16_views_of_mapped_memory():
    vmm = open_vmm()
    g = vmm.granularity
    ptr = vmm.reserve(g)
    h = vmm.create(1)
    try:
        vmm.map(ptr, h)
        t = vmm.tensor(ptr, g, torch.bfloat16)
        assert t.dtype == torch.bfloat16 and t.numel() == g // 2
        t.fill_(1.5)
        assert float(t.float().sum()) == 1.5 * t.numel()
        del t
        vmm.unmap(ptr, 1)
    finally:
        vmm.release(h)
        vmm.free_range(ptr, g)
