"""The micro parts of `odma-bench gpu` (odma/bench/gpu_bench.py says what each measures): the decode kernels over
contiguous blocks, pages and pieces (`kernels`), odma's vLLM backend on an accelerator (`runs`), and growth by
mapping against a copy (`vmm`)."""

from __future__ import annotations

import random
import statistics
import time

from odma.bench.gpu_report import Cap, Report, attempt, backend_of, copy_bandwidth, ints, median_ms, sync


# -- kernels ----------------------------------------------------------------------------------------------------


def _kernel_case(device, dtype, ctx: int, batch: int, heads: int, kv_heads: int, dim: int, gen):
    """Contiguous blocks (with gaps), the same K/V on scattered 16-token pages, and the same K/V with each request's
    first half (whole pages) in a block of another request's, read through a piece table (a shared prefix read in
    place: each its own holder here, the case least kind to caches); two layers per token as in an engine arena
    (layer 1 is read)."""
    import torch
    from types import SimpleNamespace

    page, layers = 16, 2
    row = kv_heads * dim
    per_token = layers * 2 * row
    cap = -(-ctx // page) * page
    gap = page
    arena = torch.randn((batch * (cap + gap)) * per_token, generator=gen, device=device, dtype=dtype)
    blocks = [arena[i * (cap + gap) * per_token:(i * (cap + gap) + cap) * per_token].view(layers, 2, cap, kv_heads, dim)
              for i in range(batch)]
    pages_per = cap // page
    total_pages = batch * pages_per + 8
    order = list(range(total_pages))
    random.Random(0).shuffle(order)
    paged_arena = torch.zeros(total_pages * page * per_token, dtype=dtype, device=device)
    pview = paged_arena.view(total_pages, layers, 2, page, kv_heads, dim)
    tables = []
    for i, blk in enumerate(blocks):
        ids = order[i * pages_per:(i + 1) * pages_per]
        tables.append(ids)
        pview[ids] = blk.view(layers, 2, pages_per, page, kv_heads, dim).permute(2, 0, 1, 3, 4, 5)
    contiguous = [SimpleNamespace(kv=b, pages=None, start=ctx - 1, q_len=1) for b in blocks]
    paged = [SimpleNamespace(kv=pview, pages=t, start=ctx - 1, q_len=1) for t in tables]
    shared = max(page, ctx // 2 // page * page)  # rows each request reads from its holder's block
    pieced_arena = torch.zeros(batch * (cap + 2 * gap) * per_token, dtype=dtype, device=device)
    pieced = []
    for i, blk in enumerate(blocks):
        at = i * (cap + 2 * gap)
        holder = pieced_arena[at * per_token:(at + shared) * per_token].view(layers, 2, shared, kv_heads, dim)
        at += shared + gap
        own = pieced_arena[at * per_token:(at + cap - shared) * per_token].view(layers, 2, cap - shared, kv_heads, dim)
        holder.copy_(blk[:, :, :shared])
        own.copy_(blk[:, :, shared:])
        pieced.append(SimpleNamespace(kv=own, pages=None, start=ctx - 1, q_len=1, pieces=[(holder, 0, shared)]))
    q = torch.randn(batch, heads, dim, generator=gen, device=device, dtype=dtype)
    k = torch.randn(batch, kv_heads, dim, generator=gen, device=device, dtype=dtype)
    v = torch.randn(batch, kv_heads, dim, generator=gen, device=device, dtype=dtype)
    return contiguous, paged, pieced, q, k, v


def _sdpa_loop(slots, q, k, v, layer: int = 1):
    """The device path before the kernels: write and attend one request at a time (torch's SDPA: also the
    reference the kernels are checked against)."""
    import torch
    import torch.nn.functional as F

    outs = []
    for i, s in enumerate(slots):
        cache = s.kv[layer]
        cache[0, s.start] = k[i]
        cache[1, s.start] = v[i]
        n = s.start + 1
        outs.append(F.scaled_dot_product_attention(q[i][None, :, None], cache[0, :n].transpose(0, 1)[None],
                                                   cache[1, :n].transpose(0, 1)[None], enable_gqa=True))
    return torch.cat([o[0, :, 0][None] for o in outs])


def bench_kernels(args, device, dtype, report: Report, cap: Cap) -> dict:
    import torch

    from backends.triton_attention import TritonAttention

    heads, kv_heads, dim = (4, 2, 16) if args.tiny else (28, 4, 128)
    contexts = ints(args.contexts, "64,256" if args.tiny else "1024,4096,16384")
    batches = ints(args.batches, "1,4" if args.tiny else "1,16,64")
    out: dict = {"shape": {"q_heads": heads, "kv_heads": kv_heads, "head_dim": dim, "dtype": str(dtype)}, "rows": [],
                 "skipped": []}
    report.result["kernels"] = out
    gen = torch.Generator(device=device).manual_seed(0)
    att = TritonAttention(device)
    elem = torch.empty((), dtype=dtype).element_size()
    bandwidth = attempt(out, "copy_gbps", lambda: round(copy_bandwidth(
        device, (8 << 20) if args.tiny else (2 << 30), args.rounds), 1), report)
    copy_gbps = bandwidth if isinstance(bandwidth, float) else None
    iters = 1 if args.tiny else 20
    _sweep(out, contexts, batches, cap, report, device,
           lambda ctx, batch: _kernel_row(att, device, dtype, ctx, batch, heads, kv_heads, dim, gen, elem, copy_gbps,
                                          args.rounds, iters, args.tiny))
    return out


def _sweep(out: dict, contexts, batches, cap: Cap, report: Report, device, measure) -> None:
    """measure(ctx, batch) at every context x batch into out["rows"], each tried on its own; past the cap, named in
    out["skipped"]."""
    for ctx in contexts:
        for batch in batches:
            if cap.left() <= 0:
                out["skipped"].append({"context": ctx, "batch": batch, "why": "time cap"})
                report.save()
                continue
            row = {"context": ctx, "batch": batch}
            out["rows"].append(row)
            attempt(row, "result", lambda: measure(ctx, batch), report)
            backend_of(str(device)).empty_cache()


def _kernel_row(att, device, dtype, ctx, batch, heads, kv_heads, dim, gen, elem, copy_gbps, rounds, iters,
                tiny) -> dict:
    contiguous, paged, pieced, q, k, v = _kernel_case(device, dtype, ctx, batch, heads, kv_heads, dim, gen)
    steps = {"contiguous": att.plan_step(contiguous), "paged": att.plan_step(paged), "pieces": att.plan_step(pieced)}
    reference = _sdpa_loop(contiguous, q, k, v).float()
    scale = max(reference.abs().max().item(), 1e-30)
    kv_bytes = batch * ctx * 2 * kv_heads * dim * elem
    row: dict = {"kv_mib": round(kv_bytes / 2**20, 1), "splits": steps["contiguous"].n_splits}
    times = {}
    for name, step in steps.items():
        err = (step.attend(1, q, k, v).float() - reference).abs().max().item()
        row[f"{name}_error_vs_sdpa"] = round(err / scale, 6)  # relative to the largest output
        times[name] = median_ms(lambda: step.attend(1, q, k, v), device, rounds, iters)
        row[f"{name}_us"] = round(times[name] * 1e3, 1)
        row[f"{name}_gbps"] = round(kv_bytes / times[name] / 1e6, 1)
        if copy_gbps:
            row[f"{name}_share_of_copy"] = round(kv_bytes / times[name] / 1e6 / copy_gbps, 3)
    row["plan_us"] = round(median_ms(lambda: att.plan_step(contiguous), device, rounds, iters) * 1e3, 1)
    row["contiguous_vs_paged"] = round(times["paged"] / times["contiguous"], 3)
    row["contiguous_vs_pieces"] = round(times["pieces"] / times["contiguous"], 3)  # what reading in place costs
    if batch <= 16 or tiny:
        loop = median_ms(lambda: _sdpa_loop(contiguous, q, k, v), device, rounds, max(1, iters // 4))
        row["sdpa_loop_us"] = round(loop * 1e3, 1)
        row["kernel_vs_sdpa_loop"] = round(loop / times["contiguous"], 2)
    return row


# -- odma's vLLM backend on an accelerator ------------------------------------------------------------------------


def bench_runs(args, device, dtype, report: Report, cap: Cap) -> dict:
    import torch

    from backends.triton_runs import TritonRunAttention

    heads, kv_heads, dim = (4, 2, 16) if args.tiny else (28, 4, 128)
    contexts = ints(args.contexts, "64,256" if args.tiny else "1024,4096,16384")
    batches = ints(args.batches, "1,4" if args.tiny else "1,16,64")
    out: dict = {"shape": {"q_heads": heads, "kv_heads": kv_heads, "head_dim": dim, "dtype": str(dtype),
                           "block_size": 16}, "rows": [], "skipped": []}
    report.result["runs"] = out
    kernel = TritonRunAttention(device)
    bandwidth = report.result.get("kernels", {}).get("copy_gbps")
    if not isinstance(bandwidth, float):
        bandwidth = attempt(out, "copy_gbps", lambda: round(copy_bandwidth(
            device, (8 << 20) if args.tiny else (2 << 30), args.rounds), 1), report)
    copy_gbps = bandwidth if isinstance(bandwidth, float) else None
    iters = 1 if args.tiny else 20
    gen = torch.Generator(device=device).manual_seed(0)
    _sweep(out, contexts, batches, cap, report, device,
           lambda ctx, batch: _runs_row(kernel, device, dtype, ctx, batch, heads, kv_heads, dim, gen, copy_gbps,
                                        args.rounds, iters))
    return out


def _runs_row(kernel, device, dtype, ctx, batch, heads, kv_heads, dim, gen, copy_gbps, rounds, iters) -> dict:
    """One context x batch: every request `ctx` tokens (this step's included), its blocks one run in one cache and
    scattered in another holding the same K/V."""
    import torch
    import torch.nn.functional as F

    bs = 16
    per = -(-ctx // bs)
    n_blocks = batch * (per + 1) + 8  # a block's gap between runs, a few never used
    k = torch.randn(batch, kv_heads, ctx, dim, generator=gen, device=device, dtype=dtype)
    v = torch.randn(batch, kv_heads, ctx, dim, generator=gen, device=device, dtype=dtype)
    q = torch.randn(batch, heads, dim, generator=gen, device=device, dtype=dtype)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    rows = torch.arange(batch, device=device)
    run_ids = torch.tensor([[i * (per + 1) + j for j in range(per)] for i in range(batch)], dtype=torch.int32)
    order = list(range(n_blocks))
    random.Random(0).shuffle(order)
    scattered_ids = torch.tensor(order[:batch * per], dtype=torch.int32).view(batch, per)
    caches = {}
    for name, ids in (("runs", run_ids), ("paged", scattered_ids)):
        planes = torch.zeros(kv_heads, n_blocks * bs, 2 * dim, dtype=dtype, device=device)
        token_rows = (ids.to(torch.int64)[:, :, None] * bs + torch.arange(bs)).flatten(1)[:, :ctx].to(device)
        for b in range(batch):
            planes[:, token_rows[b], :dim] = k[b]
            planes[:, token_rows[b], dim:] = v[b]
        caches[name] = (planes, ids.to(device))
    scale = dim ** -0.5
    reference = F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)[:, :, 0].float()
    top = max(reference.abs().max().item(), 1e-30)
    kv_bytes = batch * ctx * 2 * kv_heads * dim * k.element_size()
    row: dict = {"kv_mib": round(kv_bytes / 2**20, 1)}
    times = {}
    for name, (planes, table) in caches.items():
        o = torch.empty_like(q)
        first = kernel.first_rows(table, lens, bs, coalesce=True)  # once a step, for every layer (as the backend)
        if name == "runs":
            row["plan_us"] = round(median_ms(lambda: kernel.first_rows(table, lens, bs, coalesce=True), device,
                                              rounds, iters) * 1e3, 1)

        def call(planes=planes, table=table, o=o, first=first):
            kernel.decode(planes, bs, table, lens, rows, q, o, scale, longest=ctx, first=first)

        call()
        row[f"{name}_error_vs_sdpa"] = round((o.float() - reference).abs().max().item() / top, 6)
        times[name] = median_ms(call, device, rounds, iters)
    times["sdpa_dense"] = median_ms(
        lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True), device, rounds,
        iters)
    for name, ms in times.items():
        row[f"{name}_us"] = round(ms * 1e3, 1)
        row[f"{name}_gbps"] = round(kv_bytes / ms / 1e6, 1)
        if copy_gbps:
            row[f"{name}_share_of_copy"] = round(kv_bytes / ms / 1e6 / copy_gbps, 3)
    row["runs_vs_paged"] = round(times["paged"] / times["runs"], 3)
    row["runs_vs_sdpa_dense"] = round(times["sdpa_dense"] / times["runs"], 3)
    return row


# -- virtual memory ---------------------------------------------------------------------------------------------


def bench_vmm(args, device, dtype, report: Report, cap: Cap) -> dict:
    """One growth step mapped behind a block of B bytes (MappedKV over a VirtualArena: a step of every plane) against
    the copy migration of that block into one twice its size (`Arena.copy`, what growth costs without virtual
    memory). On CPU (the dry run) the host's virtual memory stands in: mapping is free there, the numbers mean
    nothing, the calls are the same."""
    from backends import KVLayout, VirtualArena, get_backend
    from odma.kv import ExactPolicy, KVRequest, MappedKV, PlaneGeometry
    from odma.kv.blocks import MAIN, Block
    from odma.models.tiny import PAPER_7B, TINY_QWEN2

    shape = TINY_QWEN2 if args.tiny else PAPER_7B
    backend = get_backend(str(device))
    vm = backend.virtual_memory()
    if vm is None:
        return {"skipped": f"no virtual memory on {device}"}
    layout = KVLayout(shape["num_layers"], shape["num_kv_heads"], shape["head_dim"], dtype)
    geometry = PlaneGeometry(layout.layers, layout.bytes_per_token // (2 * layout.layers), vm.granularity)
    out: dict = {"granule_bytes": vm.granularity, "step_tokens": geometry.step_tokens,
                 "granules_per_step": geometry.planes * geometry.step_granules, "rows": [], "skipped": []}
    report.result["vmm"] = out
    for size in ([1 << 20, 4 << 20] if args.tiny else [1 << 30, 4 << 30]):
        if cap.left() <= 0:
            out["skipped"].append({"block_bytes": size, "why": "time cap"})
            report.save()
            continue
        row = {"block_bytes": size}
        out["rows"].append(row)

        def measure(size=size) -> dict:
            tokens = geometry.steps(size // layout.bytes_per_token) * geometry.step_tokens  # whole steps
            worst = tokens + geometry.step_tokens
            unit_tokens = geometry.layout_tokens(worst) + geometry.layout_tokens(1)  # the block and the guard
            granules = geometry.steps(worst) * geometry.planes * geometry.step_granules + 1
            arena = VirtualArena(vm, unit_tokens, layout, granules)
            maps = []
            try:
                kv = MappedKV(ExactPolicy(), geometry, arena, unit_tokens)
                for r in range(args.rounds):
                    rid = f"r{r}"
                    kv.admit(KVRequest(rid, prompt_tokens=tokens - 1, max_new_tokens=worst - tokens + 1,
                                       predicted_tokens=1))
                    sync(device)
                    t0 = time.perf_counter()
                    grown = kv.grow(rid, tokens + 1)  # one more step of every plane
                    sync(device)
                    maps.append((time.perf_counter() - t0) * 1e3)
                    if grown is None:
                        raise RuntimeError("the growth step was refused")
                    kv.release(rid, 1)
            finally:
                arena.release()
            copy_arena = backend.create_arena(3 * tokens, layout)
            try:
                src, dst = Block(0, tokens, 0, MAIN), Block(tokens, 2 * tokens, 1, MAIN)
                copy = median_ms(lambda: copy_arena.copy(src, dst, tokens), device, args.rounds, 1)
            finally:
                backend.free_arena(copy_arena, return_to_driver=True)
            step_map = statistics.median(maps)
            return {"block_tokens": tokens, "map_step_ms": round(step_map, 4), "copy_block_ms": round(copy, 3),
                    "map_vs_copy": round(copy / step_map, 1) if step_map > 0 else None}

        attempt(row, "result", measure, report)
    return out
