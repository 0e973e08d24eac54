"""The C kernels' loader (backends/ckernels.py): a kernel turned off or impossible to build leaves its layers to
torch's own ops, says so once, and leaves no half-built library behind."""

from __future__ import annotations

import ctypes
import logging
import struct
from pathlib import Path

import pytest

from backends import cpu_attention, cpu_linear


@pytest.mark.parametrize("loader,fallback", [(cpu_attention.load, "falls back to SDPA"),
                                             (cpu_linear.load.loader("auto"), "linear layers use oneDNN")])
def test_a_disabled_or_unbuildable_kernel_falls_back(loader, fallback, monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(loader, "_tried", False)
    monkeypatch.setattr(loader, "_loaded", None)
    monkeypatch.setenv("ODMA_CPU_KERNELS", "0")
    assert loader() is None
    monkeypatch.setattr(loader, "_tried", False)
    monkeypatch.setenv("ODMA_CPU_KERNELS", "1")
    monkeypatch.setenv("ODMA_CACHE_DIR", str(tmp_path))  # no cached library to reuse
    monkeypatch.setenv("CC", "false")
    caplog.clear()  # only what the failed build says (an earlier test may have let INFO through already)
    with caplog.at_level(logging.INFO):
        assert loader() is None
        assert loader() is None  # asked again: the same answer, no second build
    assert caplog.text.count(fallback) == 1
    assert not list(tmp_path.rglob("*.so"))  # no half-built library left behind


class _Answers:
    """A kernel function of a library built without the instructions it needs (it answers -1), or with them (it
    writes the one product the loader's check asks for, 2 * 1 + 2 * 1, and answers 0)."""

    restype = argtypes = None

    def __init__(self, works: bool) -> None:
        self.works = works

    def __call__(self, *args) -> int:
        if not self.works:
            return -1
        ctypes.memmove(args[7], struct.pack("f", 4.0), 4)
        return 0


class _LinearLibraryWithoutAvx512:
    odma_linear_f32 = _Answers(False)
    odma_linear_bf16 = _Answers(False)

    def odma_linear_panel(self) -> int:
        return 16

    def odma_linear_openmp(self) -> int:
        return 1

    def odma_linear_isa(self) -> int:
        return 0

    def odma_linear_bf16_mode(self) -> int:
        return 0


def test_a_cpu_without_avx512_or_avx2_is_named_in_words(monkeypatch, caplog):
    """The start log said `CPU linear kernel unavailable (linear kernel failed (code -1) on x (1, 2) torch.float32)`."""
    from backends import ckernels

    loader = ckernels.IsaLoader(cpu_linear.SOURCE, cpu_linear.LinearKernel, "CPU linear kernel",
                                "linear layers use oneDNN")
    monkeypatch.setattr(ckernels, "load_library", lambda *a, **k: _LinearLibraryWithoutAvx512())
    monkeypatch.setenv("ODMA_CPU_KERNELS", "1")
    with caplog.at_level(logging.INFO):
        assert loader("auto") is None
    assert ("CPU linear kernel unavailable (this CPU has neither AVX-512 nor AVX2 with FMA); linear layers use oneDNN"
            in caplog.text)
    assert "code -1" not in caplog.text


def test_the_instruction_set_is_chosen_by_name_and_checked(monkeypatch):
    from backends import BackendError, ckernels

    monkeypatch.setenv("ODMA_CPU_ISA", "avx3")
    with pytest.raises(BackendError, match="ODMA_CPU_ISA='avx3'"):
        cpu_linear.load()
    monkeypatch.setenv("ODMA_CPU_ISA", " AVX2 ")
    assert ckernels.requested_isa() == "avx2"
    monkeypatch.setattr(ckernels, "cpu_flags", lambda: {"sse4_2", "avx"})  # a CPU without AVX2: never run its build
    with pytest.raises(BackendError, match="lacks avx2, fma, f16c"):
        cpu_linear.load()


class _LinearLibraryWithoutAvx512Bf16(_LinearLibraryWithoutAvx512):
    odma_linear_f32 = _Answers(True)


def test_a_cpu_without_avx512_bf16_keeps_bf16_layers_off_the_kernel():
    import torch

    kernel = cpu_linear.LinearKernel(_LinearLibraryWithoutAvx512Bf16())
    assert kernel.dtypes == (torch.float32,)
    assert kernel.serves(torch.zeros(4, 8)) and not kernel.serves(torch.zeros(4, 8, dtype=torch.bfloat16))


def test_a_compile_past_its_time_ends_the_compilers_children_too(monkeypatch, tmp_path):
    """A compiler driver that times out takes its children (cc1, as) with it: nothing keeps compiling behind a
    build that was given up, and nothing half-built is left."""
    from backends import ckernels

    pid_file = tmp_path / "child.pid"
    slow_cc = tmp_path / "slow-cc"
    slow_cc.write_text(f"#!/bin/sh\nsleep 60 &\necho $! > {pid_file}\nwait\n")
    slow_cc.chmod(0o755)
    source = tmp_path / "k.c"
    source.write_text("int k(void) { return 0; }\n")
    monkeypatch.setenv("CC", str(slow_cc))
    monkeypatch.setenv("ODMA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ODMA_CC_TIMEOUT", "1")
    with pytest.raises(RuntimeError, match="longer than 1 s"):
        ckernels.build(source, ("-O2",))
    child = int(pid_file.read_text())
    status = Path(f"/proc/{child}/stat")
    # the child is gone (or, for an instant, a zombie awaiting its reaper)
    assert not status.exists() or status.read_text().split(")")[1].split()[0] == "Z"
    assert not list((tmp_path / "cache").rglob("*.so*"))


@pytest.mark.parametrize("value", ["soon", "0", "-5"])
def test_a_bad_compile_timeout_is_refused_in_words(monkeypatch, value):
    from backends import ckernels
    from backends.errors import BackendError

    monkeypatch.setenv("ODMA_CC_TIMEOUT", value)
    with pytest.raises(BackendError, match="ODMA_CC_TIMEOUT"):
        ckernels.compile_timeout()
