"""Every C kernel path this CPU can take is built here, so its tests run. The kernel tests are parametrized over the
kernels that load: a build that failed would drop a path's tests without a failure (an empty parameter list is a
skip), and `pytest -q` hides the header that names the paths (the run's last lines name them: conftest.py)."""

from __future__ import annotations

import pytest

from backends import ckernels, cpu_attention, cpu_linear, cpu_quant, cpu_step, run_attention

pytestmark = pytest.mark.skipif(ckernels.disabled(), reason="ODMA_CPU_KERNELS=0 turns the C kernels off")


def test_every_instruction_set_this_cpu_runs_builds_its_gemm_kernels():
    missing, paths = [], {"linear": set(), "quantized": set()}
    for isa in ckernels.ISAS:
        if not ckernels.isa_runs_here(isa):
            continue
        for name, load in (("linear", cpu_linear.load), ("quantized", cpu_quant.load)):
            kernel = load(isa)
            if kernel is None:
                missing.append(f"{name} kernel for ODMA_CPU_ISA={isa}")
            else:
                paths[name].add(kernel.isa)
    assert not missing, f"built nothing for: {', '.join(missing)} (its tests would not run)"
    if ckernels.isa_runs_here("avx2"):  # x86 with AVX2 + FMA: the AVX2 path is tested beside the native one
        assert "avx2" in paths["linear"] and "avx2" in paths["quantized"], paths


def test_every_integer_dot_product_this_cpu_runs_builds():
    """The quantized kernel's int8-activation path per build (its tests in test_cpu_quant.py run on each): vpmaddubsw
    in the AVX2 build, AVX512-VNNI in the native one where the CPU has it."""
    flags = ckernels.cpu_flags()
    if ckernels.isa_runs_here("avx2"):
        assert cpu_quant.load("avx2").int8 == "avx2_maddubs"
    native = cpu_quant.load("auto")
    if native is not None and native.isa == "avx512" and {"avx512_vnni", "avx512bw"} <= flags:
        assert native.int8 == "avx512_vnni"
    elif native is not None and native.isa == "avx2" and "avx_vnni" in flags:
        assert native.int8 == "avx_vnni"


def test_the_attention_kernels_build():
    assert cpu_attention.load() is not None, "the CPU decode-attention kernel did not build (its tests would skip)"
    assert run_attention.load() is not None, "the run-reading attention kernel did not build (its tests would skip)"
    assert cpu_step.load() is not None, "the decode-step kernel did not build (decode steps would run in Python)"
