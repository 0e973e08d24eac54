"""The C kernels' loader (backends/ckernels.py): a kernel turned off or impossible to build leaves its layers to
torch's own ops, says so once, and leaves no half-built library behind."""

from __future__ import annotations

import logging

import pytest

from backends import cpu_attention, cpu_linear


@pytest.mark.parametrize("loader,fallback", [(cpu_attention.load, "falls back to SDPA"),
                                             (cpu_linear.load, "linear layers use oneDNN")])
def test_a_disabled_or_unbuildable_kernel_falls_back(loader, fallback, monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(loader, "_tried", False)
    monkeypatch.setattr(loader, "_loaded", None)
    monkeypatch.setenv("ODMA_CPU_KERNELS", "0")
    assert loader() is None
    monkeypatch.setattr(loader, "_tried", False)
    monkeypatch.setenv("ODMA_CPU_KERNELS", "1")
    monkeypatch.setenv("ODMA_CACHE_DIR", str(tmp_path))  # no cached library to reuse
    monkeypatch.setenv("CC", "false")
    with caplog.at_level(logging.INFO):
        assert loader() is None
        assert loader() is None  # asked again: the same answer, no second build
    assert caplog.text.count(fallback) == 1
    assert not list(tmp_path.rglob("*.so"))  # no half-built library left behind
