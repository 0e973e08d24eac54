"""Runs one packed step of the model over the pool's arena and samples a token per finished prefill/decode."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from backends import Arena, Backend, BackendError, KVLayout, Span
from backends.triton_attention import TritonAttention
from odma.engine.decode_graphs import DecodeGraphs
from odma.engine.logprobs import SampledLogprobs, prompt_logprobs
from odma.engine.scheduler import Work
from odma.engine.sampling import Sampler, generator_seed
from odma.engine.sequence import Sequence
from odma.models.cpu_linear import pack_linears
from odma.models.native_step import NativeLayers
from odma.models.llama import CausalLM, HiddenCapture, SeqSlot


@dataclass(frozen=True, slots=True)
class StepTime:
    """One model step: host_ms from the call until every launch is issued (the sampler then waits for the device),
    device_ms the device's time between the step's first and last launch (None where the device is the host),
    whether a captured decode batch ran it, and its batch size. A step whose host_ms reaches its device_ms is
    host-bound: the device waits for the launches."""

    host_ms: float
    device_ms: float | None
    graph: bool
    batch: int


class ModelRunner:
    def __init__(self, model: CausalLM, backend: Backend, total_tokens: int, kv_dtype: torch.dtype | None = None,
                 attention: str = "auto", page_tokens: int | None = None, arena: Arena | None = None,
                 max_positions: int | None = None, decode_graphs: str = "off", max_batch: int = 128,
                 graph_pieces: int = 0) -> None:
        """attention: auto | triton | sdpa (Backend.attention). page_tokens: the arena holds pages of this many
        tokens that requests address through page tables (the paged baseline; Triton attention only). arena: one
        made by the caller (a virtual arena for growth by mapping); by default one of total_tokens. max_positions:
        the longest sequence (the rotary table the Triton kernels read is made for it once). decode_graphs: auto |
        capture | static | off (odma/engine/decode_graphs.py); max_batch: the largest decode batch captured."""
        c = model.config
        native = backend.capabilities.native_layers
        if native:
            pack_linears(model, backend.linear_kernel())  # weights packed once for the GEMM (cpu_linear.py)
        self.model = model
        self.backend = backend
        self.layout = KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype or model.dtype)
        self.attention = backend.attention(attention)
        if native and self.attention is not None:  # steps of one token per request: layers in C
            model.native_layers = NativeLayers.build(model, backend.decode_step())
        self.page_tokens = page_tokens
        if page_tokens is not None and not isinstance(self.attention, TritonAttention):
            raise BackendError("paged KV is read by the Triton attention only (attention 'triton', or 'auto' on a GPU)")
        # the only KV allocation: one arena for the whole pool; a block is a view of one range of it
        self.arena: Arena = arena if arena is not None else backend.create_arena(total_tokens, self.layout)
        self.sampler = Sampler()
        self.eos_ids: tuple[int, ...] = tuple(c.eos_token_ids)  # end a request unless ignore_eos
        # hidden states a length probe reads: set capture_layers, and after each run() `captured[layer]` holds
        # one [len(work), hidden] row per work item (its last fed position); empty: nothing captured, no cost
        self.capture_layers: tuple[int, ...] = ()
        self.captured: dict[int, torch.Tensor] = {}
        self.graphs: DecodeGraphs | None = None
        if isinstance(self.attention, TritonAttention):
            positions = max_positions or c.max_position_embeddings
            model.rotary.table(positions)  # made once, before any graph records its address
            mode = _graph_mode(decode_graphs, backend)
            if mode != "off" and hasattr(self.arena, "kv_address"):  # not over ballooned segments
                self.graphs = DecodeGraphs(model, backend, self.attention, self.arena, max_batch, positions, mode,
                                           page_tokens, pieces=graph_pieces)
                if mode == "capture":
                    self.graphs.capture_all()
        self.time_steps = False  # record `last_step` (device events on accelerators)
        self.last_step: StepTime | None = None

    @property
    def bytes_per_token(self) -> int:
        return self.layout.bytes_per_token

    @torch.inference_mode()
    def run(self, work: list[Work]) -> list[int | None]:
        """Feed each item's tokens [start, start+q_len) and return its next token (None: chunk of a longer
        prefill, nothing to sample yet)."""
        started = time.perf_counter()
        events = self.backend.timing_events() if self.time_steps else None
        if events is not None:
            events[0].record()
        graph = self.graphs is not None and not self.capture_layers and self.graphs.eligible(work)
        if graph:
            logits = self.graphs.run(work)
            self.captured = {}
        else:
            logits = self._forward(work)
        if events is not None:
            events[1].record()
        host_ms = (time.perf_counter() - started) * 1e3
        for w in work:
            w.seq.num_cached = w.start + w.q_len
        tokens = self._sample(work, logits)
        if self.time_steps:
            device_ms = None
            if events is not None:
                events[1].synchronize()
                device_ms = events[0].elapsed_time(events[1])
            self.last_step = StepTime(host_ms, device_ms, graph, len(work))
        return [t if w.seq.num_cached == w.seq.num_tokens else None for t, w in zip(tokens, work)]

    def _forward(self, work: list[Work]) -> torch.Tensor:
        """The eager step: every request's block (or pages) planned for this step, the model's forward."""
        device = self.backend.device
        ids: list[int] = []
        positions: list[int] = []
        slots: list[SeqSlot] = []
        pages = self.pages_view() if self.page_tokens is not None else None
        for w in work:
            ids += w.seq.token_ids(w.start, w.start + w.q_len)
            positions += range(w.start, w.start + w.q_len)
            if pages is not None:
                slots.append(SeqSlot(pages, w.start, w.q_len, pages=w.seq.kv.pages))
            else:
                pieces = w.seq.kv.pieces
                slots.append(SeqSlot(self.arena.view(w.seq.block), w.start, w.q_len, pieces=pieces and [
                    (self.arena.view(h.block), first, end) for h, first, end in pieces]))
        capture = HiddenCapture(self.capture_layers) if self.capture_layers else None
        with prompt_logprobs(self.model, work):  # only for requests that ask (echo with logprobs)
            logits = self.model(
                torch.tensor(ids, dtype=torch.long, device=device),
                torch.tensor(positions, dtype=torch.long, device=device),
                slots,
                self.attention,
                capture=capture,
            )
        self.captured = {k: v.cpu() for k, v in capture.last.items()} if capture is not None else {}
        return logits

    def _sample(self, work: list[Work], logits: torch.Tensor) -> list[int]:
        """One token per row. Plain greedy rows take the argmax where the logits are (on an accelerator only the
        token ids come back); rows that sample, mask tokens (min_tokens), adjust logits (penalties, logit bias) or
        report logprobs go through the sampler on the host."""
        params = [w.seq.params for w in work]
        banned = [self._banned(w) for w in work]
        host = [i for i, (p, ban) in enumerate(zip(params, banned))
                if not p.greedy or ban or p.logprobs is not None or p.adjusts_logits]
        if not host:
            return logits.argmax(-1).tolist()
        tokens: list[int] = [0] * len(work)
        if len(host) < len(work):
            host_set = set(host)
            plain = [i for i in range(len(work)) if i not in host_set]
            for i, t in zip(plain, logits[plain].argmax(-1).tolist()):
                tokens[i] = t
            logits = logits[host]
        logits = logits.cpu()
        sub = [work[i] for i in host]
        chosen = SampledLogprobs(sub, logits)  # before the sampler masks the logits in place
        sampled = self.sampler(logits, [params[i] for i in host], [seeded_generator(w.seq) for w in sub],
                               [banned[i] for i in host], [w.seq.output_ids for w in sub])
        for i, t in zip(host, sampled):
            tokens[i] = t
        chosen.record([t if w.seq.num_cached == w.seq.num_tokens else None for t, w in zip(sampled, sub)])
        return tokens

    def pages_view(self) -> torch.Tensor:
        """The arena as pages [pages, layers, 2, page_tokens, kv_heads, head_dim] (paged KV only)."""
        lay, p = self.layout, self.page_tokens
        return self.arena.storage.view(-1, lay.layers, 2, p, lay.kv_heads, lay.head_dim)

    @torch.inference_mode()
    def profile_activations(self, token_counts: list[int]) -> dict[int, int]:
        """Peak activation bytes of a prefill of each token count (a throwaway arena holds its KV)."""
        out = {}
        device = self.backend.device
        for n in token_counts:
            arena = self.backend.create_arena(n, self.layout)
            try:
                ids = torch.zeros(n, dtype=torch.long, device=device)
                positions = torch.arange(n, dtype=torch.long, device=device)
                slot = [SeqSlot(arena.view(Span(0, n)), 0, n)]
                out[n] = self.backend.activation_peak_bytes(lambda: self.model(ids, positions, slot))
            finally:
                self.backend.free_arena(arena)
        return out

    def _banned(self, w: Work) -> tuple[int, ...]:
        p = w.seq.params
        if w.seq.num_generated >= p.min_tokens:
            return ()
        return self.eos_ids + p.stop_token_ids


def seeded_generator(seq: Sequence) -> torch.Generator | None:
    """`seq`'s own random stream if it is seeded (None: torch's global one), made at its first draw and kept with it:
    sample i of a request seeded s draws from s + i (as in vLLM)."""
    if seq.generator is None and seq.params.seed is not None:
        seq.generator = torch.Generator().manual_seed(generator_seed(seq.params.seed, seq.index))
    return seq.generator


def _graph_mode(mode: str, backend: Backend) -> str:
    """auto: captured graphs where the backend records them (CUDA, where the Triton kernels run compiled), nothing
    elsewhere."""
    if mode == "auto":
        return "capture" if backend.capabilities.graphs else "off"
    return mode
