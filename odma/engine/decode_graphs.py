"""Decode steps replayed from captured graphs, one per batch-size bucket (vLLM's approach to a host-bound step).

A step whose requests all feed one token runs as the captured batch of the smallest bucket that holds it (1, 2, 4,
then multiples of 8 up to max_num_seqs), padded with requests that have no context: the host writes the step's
token ids, block addresses and positions into buffers that never move (`TritonAttention.static_decode`, one copy to
the device) and replays the model's whole forward, every norm, GEMM and kernel of every layer, in one call. With
"capture" every bucket is recorded at start (`capture_all`, on a batch of padding, the largest first); a bucket not
yet recorded is recorded the first time a batch needs it (its first step then runs eagerly twice while capturing,
which rewrites the same K/V rows). Prefill chunks, captured hidden states and ballooned arenas take the eager path.
Where shared prefixes are read in place (`EngineConfig.prefix_reads`) every batch reads piece tables (`GRAPH_PIECES`
entries each).

Modes (EngineConfig.decode_graphs): "capture" records CUDA graphs (the backend's `capture_graph`); "static" runs the
same static batches eagerly, which is what a failed capture falls back to, and how the path is tested on CPU
(Triton's interpreter); "off" leaves every step to the eager plan.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any, Callable, Sequence

import torch

from backends.triton_attention import TritonAttention, piece_entries

log = logging.getLogger(__name__)

MODES = ("auto", "capture", "static", "off")
GRAPH_PIECES = 8  # piece table entries of a captured batch (a request reading more pieces runs eagerly)


def buckets(max_batch: int) -> list[int]:
    """Batch sizes captured: 1, 2, 4, then every multiple of 8 up to max_batch (and max_batch itself)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    """The static decode batches of one model runner."""

    def __init__(self, model: Any, backend: Any, attention: TritonAttention, arena: Any, max_batch: int,
                 max_positions: int, mode: str, page_tokens: int | None = None, pieces: int = 0) -> None:
        """pieces: the batches read piece tables of this many entries (requests reading a shared prefix in place,
        odma.kv.shared_rows; a request with more pieces takes the eager path); 0: none."""
        if mode not in ("capture", "static"):
            raise ValueError(f"decode graphs run as 'capture' or 'static', got {mode!r}")
        c = model.config
        self.model, self.backend, self.arena, self.mode = model, backend, arena, mode
        self.page_tokens = page_tokens
        self.buckets = buckets(max_batch)
        self.max_batch = max_batch
        row = self.row = c.num_kv_heads * c.head_dim
        self.pieces = 0 if page_tokens else pieces
        kw: dict = {"pieces": self.pieces}
        if page_tokens:
            kw |= dict(page=page_tokens, page_elems=page_tokens * c.num_layers * 2 * row,
                       table_width=-(-max_positions // page_tokens))
            self._page_strides = (0, 2 * page_tokens * row, page_tokens * row)
        self.static = attention.static_decode(max_batch, arena.storage, c.num_kv_heads, c.head_dim,
                                              rotary=model.rotary.table(max_positions), **kw)
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}
        self.captured = 0  # buckets recorded as graphs
        self.capture_failures = 0
        self.replayed = 0  # steps served from a static batch

    def eligible(self, work: Sequence) -> bool:
        """Every request decoding: feeding one generated token (prompt tokens, even one, take the eager path,
        which also scores them where prompt logprobs are asked); a request reading a shared prefix in place only where
        the batches have piece tables of room for its pieces."""
        return 0 < len(work) <= self.max_batch and all(
            w.q_len == 1 and w.start >= len(w.seq.prompt_ids)
            and (not w.seq.kv.pieces or len(w.seq.kv.pieces) < self.pieces) for w in work)

    def run(self, work: Sequence) -> torch.Tensor:
        """The logits [len(work), vocab] (float32) of a decode-only step."""
        n = len(work)
        positions = [w.start for w in work]
        ids = [w.seq.token_ids(w.start, w.start + 1)[0] for w in work]
        if self.page_tokens:
            pages = [w.seq.kv.pages for w in work]
            self.static.fill(ids, [self._page_strides] * n, positions, pages)
        elif self.pieces:
            address = self.arena.kv_address
            kv = [w.seq.kv for w in work]
            own = [address(h.block) for h in kv]  # each block's address once: the fields and the table's last entry
            self.static.fill(ids, own, positions, pieces=[piece_entries(
                [(address(p.block), first, end) for p, first, end in h.pieces or ()], at, h.first_row, self.row)
                for h, at in zip(kv, own)])
        else:
            self.static.fill(ids, [self.arena.kv_address(w.seq.block) for w in work], positions)
        bucket = self.buckets[bisect.bisect_left(self.buckets, n)]
        replay = self._replays.get(bucket) or self._record(bucket)
        self.replayed += 1
        return replay()[:n]

    def capture_all(self) -> None:
        """Record every bucket now, the largest first (their graphs share one memory pool), on a batch of padding:
        what vLLM does at start, so that no request waits for a capture."""
        for bucket in reversed(self.buckets):
            if bucket not in self._replays:
                self.static.fill([], [], [])
                self._record(bucket)

    def _record(self, bucket: int) -> Callable[[], torch.Tensor]:
        step = self.static.step(bucket)
        ids = self.static.token_ids[:bucket]
        model = self.model

        def forward() -> torch.Tensor:
            return model(ids, None, None, step=step)

        replay = None
        if self.mode == "capture":
            try:
                replay = self.backend.capture_graph(forward)
            except Exception as exc:  # noqa: BLE001 - a capture that fails leaves the step to run eagerly
                self.capture_failures += 1
                log.warning("decode batch of %d: graph capture failed (%s: %s); it runs eagerly", bucket,
                            type(exc).__name__, exc)
            if replay is not None:
                self.captured += 1
                log.info("decode batch of %d captured as a graph", bucket)
        self._replays[bucket] = replay or forward
        return self._replays[bucket]
