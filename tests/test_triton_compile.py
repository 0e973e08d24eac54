"""The Triton kernels compiled for an H100 (sm_90) without a GPU: every variant the host code launches (contiguous
and paged, rotary write or plain, split decode or not, prefill; bf16, fp16 and fp32; first rows read through a piece
table; the static decode batch of a captured graph) reads K and V in 16-byte vectors or asynchronous copies, never one element at a time. The launches
are recorded from the real host code (plan_step / attend on CPU tensors, nothing executed) and compiled with the
specialization Triton's launcher would give them, then their PTX is read (tests/triton_ptx.py), once with the
Triton CI installs and once with the one the GPU machines run (`TRITON_DEVICE_VERSION` in scripts/setup.sh,
installed into .triton-device)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")

from backends.triton_attention import TritonAttention, Tuning  # noqa: E402
from backends.triton_runs import TritonRunAttention  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEVICE_TRITON = ROOT / ".triton-device"
SM90 = ["cuda", 90, 32]
READERS = ("kv_write_kernel", "decode_kernel", "prefill_kernel")
RUN_READERS = ("run_decode_kernel",)  # over vLLM's per-head planes (backends/triton_runs.py)


class Recorder:
    """Stands in for the kernels module: records each launch as Triton's launcher would specialize it."""

    def __init__(self, kernels) -> None:
        self.kernels, self.launches = kernels, {}

    def __getattr__(self, name):
        fn = getattr(self.kernels, name)

        def launch(*args, **kwargs):
            spec = _specialize(name, fn, args, kwargs)
            self.launches[json.dumps(spec, sort_keys=True)] = spec

        return _Grid(launch)


class _Grid:
    def __init__(self, launch) -> None:
        self.launch = launch

    def __getitem__(self, grid):
        return self.launch


def _specialize(name: str, fn, args, kwargs) -> dict:
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction, native_specialize_impl

    if not isinstance(fn, JITFunction):  # under the interpreter: the same function, as the compiler would see it
        fn = JITFunction(fn.fn, **fn.kwargs)
    values = dict(zip(fn.arg_names, args)) | kwargs
    signature, constexprs, divisible = {}, {}, []
    for i, p in enumerate(fn.params):
        value = values[p.name]
        if p.is_constexpr:
            constexprs[p.name] = value
            continue
        ty, key = native_specialize_impl(BaseBackend, value, False, not p.do_not_specialize,
                                         not p.do_not_specialize_on_alignment)
        signature[p.name] = ty
        if isinstance(key, str) and "D" in key:
            divisible.append(i)
    return {"kernel": name, "signature": signature, "constexprs": constexprs, "divisible": divisible}


def _arena(layers, kv_heads, dim, dtype, tokens):
    return torch.zeros(tokens * layers * 2 * kv_heads * dim, dtype=dtype)


def _qkv(t, heads, kv_heads, dim, dtype):
    """q, k, v as the model hands them over: views of one fused projection's output."""
    qkv = torch.zeros(t, (heads + 2 * kv_heads) * dim, dtype=dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    return q.view(t, heads, dim), k.view(t, kv_heads, dim), v.view(t, kv_heads, dim)


def _record_launches() -> list[dict]:
    att = TritonAttention(torch.device("cpu"), Tuning())
    recorder = Recorder(att.kernels)
    att.kernels = recorder
    layers, page = 2, 16
    for heads, kv_heads, dim, dtype in [(28, 4, 128, torch.bfloat16), (28, 4, 128, torch.float16),
                                        (9, 3, 64, torch.float32)]:
        per_token = layers * 2 * kv_heads * dim
        rotary = torch.ones(8192, dim, dtype=torch.float32)  # the rotary table: cos, then sin, per position
        # contiguous: decodes at short and long contexts (split), a prefill chunk; and many short decodes (no split)
        arena = _arena(layers, kv_heads, dim, dtype, 8192)
        mixed = [(0, 4096, 4000, 1), (4096, 64, 10, 1), (4160, 512, 0, 300)]
        many = [(64 * i, 64, 30, 1) for i in range(64)]
        for shapes in (mixed, many):
            slots = [SimpleNamespace(kv=arena[o * per_token:(o + c) * per_token].view(layers, 2, c, kv_heads, dim),
                                     pages=None, start=s, q_len=q) for o, c, s, q in shapes]
            t = sum(q for *_, q in shapes)
            for rot in (None, rotary):
                att.plan_step(slots, rotary=rot).attend(1, *_qkv(t, heads, kv_heads, dim, dtype))
        # paged, through 16-token page tables
        pages_view = arena.view(-1, layers, 2, page, kv_heads, dim)
        slots = [SimpleNamespace(kv=pages_view, pages=list(range(i * 40, i * 40 + 40)), start=s, q_len=q)
                 for i, (s, q) in enumerate([(600, 1), (5, 1), (0, 200)])]
        for rot in (None, rotary):
            att.plan_step(slots, rotary=rot).attend(1, *_qkv(202, heads, kv_heads, dim, dtype))
        if dtype == torch.bfloat16:  # first rows read from other blocks (a piece table), as the GPU would run it
            view = [arena[o * per_token:(o + c) * per_token].view(layers, 2, c, kv_heads, dim)
                    for o, c in ((0, 4096), (4096, 512), (4608, 1024))]
            slots = [SimpleNamespace(kv=view[1], pages=None, start=4200, q_len=1, pieces=[(view[0], 0, 4000)]),
                     SimpleNamespace(kv=view[2], pages=None, start=4000, q_len=300, pieces=[(view[0], 0, 4000)])]
            att.plan_step(slots, rotary=rotary).attend(1, *_qkv(301, heads, kv_heads, dim, dtype))
            # and a captured batch's (a fixed table of 8 entries, prefix_reads)
            static = att.static_decode(16, arena, kv_heads, dim, rotary=rotary, pieces=8)
            row = kv_heads * dim
            entries = [(4000, 0, 2 * 4096 * row, 4096 * row), (1 << 40, (4096 - 4000) * row, 2 * 512 * row, 512 * row)]
            static.fill([1], [(4096 * row, 2 * 512 * row, 512 * row)], [4200], pieces=[entries])
            static.step(16).attend(0, *_qkv(16, heads, kv_heads, dim, dtype))
        # a captured decode batch's static plan
        static = att.static_decode(16, arena, kv_heads, dim, rotary=rotary)
        static.fill([1] * 3, [(0, 2 * 64 * kv_heads * dim, 64 * kv_heads * dim)] * 3, [5, 6, 7])
        static.step(16).attend(0, *_qkv(16, heads, kv_heads, dim, dtype))
    return list(recorder.launches.values()) + _record_run_launches()


def _record_run_launches() -> list[dict]:
    """odma's vLLM backend on an accelerator: decode over per-head planes (runs and blocks in one batch, split and
    not) and the K/V write, in each dtype."""
    att = TritonRunAttention(torch.device("cpu"), Tuning())
    recorder = Recorder(att.run_kernels)
    att.run_kernels, att.kernels = recorder, Recorder(att.kernels)
    block = 16
    for heads, kv_heads, dim, dtype in [(28, 4, 128, torch.bfloat16), (28, 4, 128, torch.float16),
                                        (9, 3, 64, torch.float32)]:
        planes = torch.zeros(kv_heads, 512 * block, 2 * dim, dtype=dtype)
        table = torch.arange(512, dtype=torch.int32).view(64, 8)
        for n, longest in ((2, 128), (64, 64)):  # split over the context, and enough requests not to
            lens = torch.full((n,), longest, dtype=torch.int32)
            q = torch.zeros(n, heads, dim, dtype=dtype)
            att.decode(planes, block, table[:n], lens, torch.arange(n), q, torch.zeros_like(q), dim ** -0.5,
                       longest=longest)
        kv = torch.zeros(3, kv_heads, dim, dtype=dtype)
        att.write(planes, kv, kv, torch.arange(3))
    return list(recorder.launches.values())


def _compile(launches: list[dict], pythonpath: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*pythonpath, str(ROOT)]))
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "triton_ptx.py")],
                          input=json.dumps({"target": SM90, "launches": launches}), capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def launches():
    recorded = _record_launches()
    assert {spec["kernel"] for spec in recorded} >= {*READERS, "reduce_kernel"}
    return recorded


def _scalar_loads(loads: dict[str, int]) -> int:
    """Global loads narrower than 8 bytes that are not vectors (one bf16/fp16/fp32 element a thread)."""
    return sum(n for form, n in loads.items()
               if form.startswith("ld.global") and not re.search(r"\.v\d", form)
               and re.search(r"\.[bsuf](8|16|32)$", form))


def _vector_loads(loads: dict[str, int]) -> int:
    return sum(n for form, n in loads.items()
               if (form.startswith("ld.global") and re.search(r"\.v[24]\.", form))
               or re.search(r"cp\.async.*\.(8|16)$", form))


def _check(result: dict) -> None:
    seen = set()
    for kernel in result["kernels"]:
        what = f"{kernel['kernel']} {kernel['constexprs']} under Triton {result['triton']}: {kernel['loads']}"
        if kernel["kernel"] in READERS:
            seen.add((kernel["kernel"], kernel["constexprs"]["PAGE"] > 0, kernel["constexprs"]["PIECES"] > 0))
            assert _scalar_loads(kernel["loads"]) == 0, "element-wise loads in " + what
            assert _vector_loads(kernel["loads"]) > 0, "no vector loads in " + what
        elif kernel["kernel"] in RUN_READERS:
            seen.add((kernel["kernel"], kernel["constexprs"]["SPLIT"]))
            # a request's int32 length is one word; K and V elements are never read one at a time
            assert _scalar_loads(kernel["loads"]) <= 1, "element-wise loads in " + what
    assert seen == {(k, paged, pieces) for k in READERS for paged, pieces in ((False, False), (True, False),
                                                                              (False, True))} | \
        {(k, split) for k in RUN_READERS for split in (False, True)}


def test_every_kernel_variant_reads_kv_in_vectors_on_sm90(launches):
    _check(_compile(launches, []))


@pytest.mark.skipif(not DEVICE_TRITON.is_dir(), reason="the GPU machines' Triton is not installed in .triton-device "
                                                       "(scripts/setup.sh installs it)")
def test_the_gpu_machines_triton_compiles_them_alike(launches):
    installed = [p.name[len("triton-"):-len(".dist-info")] for p in DEVICE_TRITON.glob("triton-*.dist-info")]
    result = _compile(launches, [str(DEVICE_TRITON)])
    assert [result["triton"]] == installed  # the compile ran with that Triton, not the venv's
    _check(result)


def test_the_check_catches_element_wise_loads():
    """What the assertions read: the same kernel compiled with ALIGN 1 (no hint) reads K/V element by element."""
    launches = [spec for spec in _record_launches() if spec["kernel"] == "decode_kernel"][:1]
    assert launches
    unhinted = [dict(launches[0], constexprs=dict(launches[0]["constexprs"], ALIGN=1))]
    loads = _compile(unhinted, [])["kernels"][0]["loads"]
    assert _scalar_loads(loads) > 0
