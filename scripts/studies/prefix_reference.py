"""What a shared prompt prefix held once in contiguous memory would give, in the fitted GPU replay: a model of the
design before it is built (docs/results/gpu/replay_policy.md, "A shared prefix read in place").

Today a contiguous block copies a shared prefix from a running holder (`odma.engine.prefix_share`); the paged pool maps
the holder's pages. In the design modelled here a request whose prompt begins like a running holder's cached tokens
*reads* those rows where they are, and its own block holds only the rows after them: the block is that much smaller,
nothing is copied or computed. A holder that read its own first rows elsewhere passes those pieces on as they are, so
a request's first rows may lie in several blocks (its kernels read a short table of pieces: base address, capacity,
last row), and a block is held only for rows somebody reads in it. The holder's rows must outlive it while others read
them; what that costs, from the most to the least memory:

- `keep`: the holder's whole block stays until its last reader ends;
- `trim`: the holder's block keeps only the rows its readers read when it ends, in place (`KVPool.keep_front`: the tail
  freed, the rows re-laid for the smaller block by one copy, charged), until the last reader ends;
- `trim1`: as `trim`, but a request reads from one other block only (one more base address in the kernels, not a
  table): the first piece; the rest of the shared prefix it copies into its own block as today (that copy uncharged);
- `free`: nothing (the holder's block goes when it ends, readers or not): an upper bound no design reaches.

A holder's rows move with it when it grows or slides (readers read the block where it is now): nothing extra.

    .venv/bin/python scripts/studies/prefix_reference.py --traces sharegpt-chat:400:bench,sharegpt:200:bench,azure-conv
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from odma.analyze.gpu_burst import bench_prompts, odma_memory, run_burst, study_config  # noqa: E402
from odma.analyze.gpu_profile import load_gpu_profile  # noqa: E402
from odma.kv.shared_rows import Shifted  # noqa: E402

MODES = ("free", "trim", "trim1", "keep")
PROFILES = ("h200-7b", "h100-7b")  # the shipped profiles (odma/analyze/gpu_profiles)


class ReferencedPrefixes:
    """A layer over a `ContiguousKV` that admits a sharing request with a block of its own rows only (the scheduler
    maps the prefix: `shares_pages`), and holds each holder's rows for its readers as `mode` says.

    A request's first rows may lie in several blocks: a holder that itself read its first rows from another passes
    those on as they are (the reader reads each piece from the block that holds it, as a page table would), so a
    block is held only for rows somebody reads in it."""

    shares_pages = True

    def __init__(self, kv, mode: str, prefixes) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self._kv, self.mode = kv, mode
        self.prefixes = prefixes  # the scheduler's index of running holders
        self.offset: dict[str, int] = {}  # request -> rows read from other blocks (its block holds the rest)
        self.pieces: dict[str, list[tuple[str, int, int]]] = {}  # request -> (block's request, first row, end)
        self.readers: dict[str, dict[str, int]] = defaultdict(dict)  # block's request -> reader -> end row read
        self.parked: dict[str, object] = {}  # a holder that ended, kept for its readers -> how to free it
        self.held_tokens_peak = 0
        self._held = 0

    def __getattr__(self, name):
        return getattr(self._kv, name)

    def shareable_tokens(self, tokens: int) -> int:
        align = self._kv.pool.align
        return tokens // align * align

    def initial_tokens(self, req) -> int:
        """What admitting `req` would reserve (the admission rule's θ): its own rows only, where it will share."""
        shared = 0
        if self.prefixes is not None and not getattr(req, "num_cached", 0):
            shared = self.shareable_tokens(self.prefixes.lookup(req)[1])
        return self._kv.initial_tokens(Shifted(req, shared) if shared else req)

    def admit_sharing(self, req, holder_id: str | None, tokens: int):
        if holder_id is None or not tokens:
            return self._kv.admit(req)
        pieces = [(o, lo, min(hi, tokens)) for o, lo, hi in self.pieces.get(holder_id, []) if lo < tokens]
        own = self.offset.get(holder_id, 0)
        if tokens > own:
            pieces.append((holder_id, own, tokens))
        if self.mode == "trim1":  # one block read in place; the rest of the prefix copied into the reader's block
            pieces = pieces[:1]
        read = pieces[-1][2]
        handle = self._kv.admit(Shifted(req, read))
        if handle is not None:
            rid = req.request_id
            self.offset[rid], self.pieces[rid] = read, pieces
            for o, _, hi in pieces:
                self.readers[o][rid] = hi
        return handle

    def grow(self, request_id: str, new_len: int, *, held: int | None = None):
        o = self.offset.get(request_id, 0)
        return self._kv.grow(request_id, new_len - o, held=None if held is None else held - o)

    def release(self, request_id: str, realized_output: int) -> None:
        self._leave(request_id, lambda: self._kv.release(request_id, realized_output), realized_output)

    def evict(self, request_id: str) -> None:
        self._leave(request_id, lambda: self._kv.evict(request_id), None)

    def _leave(self, rid: str, free, realized: int | None) -> None:
        readers = self.readers.get(rid)
        if readers and self.mode == "keep":
            self.parked[rid] = free
            self._held += self._kv.pool.block_of(rid).capacity
        elif readers and self.mode in ("trim", "trim1"):
            if realized is not None:
                self._kv.observe(realized)
            self._kv.pool.keep_front(rid, max(readers.values()) - self.offset.get(rid, 0))
            self.parked[rid] = lambda: self._kv.pool.release(rid, 0, observe=False)
            self._held += self._kv.pool.block_of(rid).capacity
        else:
            free()
            self.readers.pop(rid, None)
            self._unread(rid)
        self.held_tokens_peak = max(self.held_tokens_peak, self._held)

    def _unread(self, rid: str) -> None:
        """`rid`'s block is gone: the blocks it read from lose a reader; a parked one whose last reader it was goes
        too (and so on)."""
        self.offset.pop(rid, None)
        for owner, _, _ in self.pieces.pop(rid, []):
            readers = self.readers[owner]
            readers.pop(rid, None)
            if readers:
                continue
            del self.readers[owner]
            free = self.parked.pop(owner, None)
            if free is not None:
                self._held -= self._kv.pool.block_of(owner).capacity
                free()
                self._unread(owner)


def run(trace: str, gib: float, mode: str | None, prompts) -> dict:
    """The bench's burst with odma's packing: prefixes copied (mode None, today's engine) or read in place."""
    layers: list[ReferencedPrefixes] = []

    def wrap(kv, scheduler):
        layers.append(ReferencedPrefixes(kv, mode, scheduler.prefixes))
        return layers[-1]

    burst = run_burst(study_config(trace, gib), "odma", engine_overrides=odma_memory("packed"), prompts=prompts,
                      wrap_kv=None if mode is None else wrap)
    row = {"variant": f"packed, read in place ({mode})" if mode else "packed", "trace": trace, "kv_gib": gib,
           **burst.summary()}
    if layers:
        row.update(held_tokens_peak=layers[-1].held_tokens_peak)
    return _priced(row, burst)


def _priced(row: dict, burst) -> dict:
    for p in PROFILES:
        parts = load_gpu_profile(p).breakdown(burst.steps, burst.paged)
        row[p] = {"tokens_per_s": burst.output_tokens / parts["seconds"], **parts}
    return row


def _seconds(profile: str, burst, paged: bool) -> float:
    return load_gpu_profile(profile).breakdown(burst.steps, paged)["seconds"]


def _held(row: dict) -> str:
    return f", held for readers at most {row['held_tokens_peak']} tokens" if "held_tokens_peak" in row else ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", default="sharegpt-chat:400:bench,sharegpt:200:bench,azure-conv")
    p.add_argument("--kv-gib", default="4,16")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--json", help="write every row here")
    args = p.parse_args()
    rows = []
    for trace in args.traces.split(","):
        for gib in (float(g) for g in args.kv_gib.split(",")):
            prompts = bench_prompts(study_config(trace, gib))
            burst = run_burst(study_config(trace, gib), "paged", prompts=prompts)
            paged = _priced({"variant": "paged", "trace": trace, "kv_gib": gib}, burst)
            # the ceiling: paged's own schedule (every token held once, nothing copied) at the contiguous step's cost
            ceiling = {q: _seconds(q, burst, True) / _seconds(q, burst, False) for q in PROFILES}
            rows.append({"variant": "paged's schedule, contiguous steps", "trace": trace, "kv_gib": gib,
                         "vs_paged": ceiling})
            print(f"{trace} {gib:g} GiB paged's schedule at the contiguous step's cost: ÷ paged "
                  f"{ceiling['h200-7b']:.3f} (H200) / {ceiling['h100-7b']:.3f} (H100)", flush=True)
            for mode in [None, *args.modes.split(",")]:
                t = time.time()
                r = run(trace, gib, mode, prompts)
                r["vs_paged"] = {q: r[q]["tokens_per_s"] / paged[q]["tokens_per_s"] for q in PROFILES}
                rows.append(r)
                print(f"{trace} {gib:g} GiB {r['variant']}: ÷ paged {r['vs_paged']['h200-7b']:.3f} (H200) / "
                      f"{r['vs_paged']['h100-7b']:.3f} (H100), steps {r['steps']}, running {r['mean_running']}, "
                      f"preemptions {r['preemptions']}, prefix maps {r['prefix_maps']} / copies {r['prefix_copies']}"
                      f"{_held(r)}"
                      f" ({time.time() - t:.1f} s)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
