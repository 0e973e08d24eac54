"""Runs one packed step of the model over the pool's arena and samples a token per finished prefill/decode."""

from __future__ import annotations

import torch

from backends import Arena, Backend, KVLayout, Span
from odma.engine.logprobs import SampledLogprobs, prompt_logprobs
from odma.engine.scheduler import Work
from odma.engine.sampling import Sampler
from odma.models.cpu_linear import pack_linears
from odma.models.llama import CausalLM, HiddenCapture, SeqSlot


class ModelRunner:
    def __init__(self, model: CausalLM, backend: Backend, total_tokens: int, kv_dtype: torch.dtype | None = None) -> None:
        c = model.config
        if backend.name == "cpu":
            pack_linears(model, backend.linear_kernel())  # weights packed once for the GEMM (cpu_linear.py)
        self.model = model
        self.backend = backend
        self.layout = KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype or model.dtype)
        # the only KV allocation: one arena for the whole pool; a block is a view of one range of it
        self.arena: Arena = backend.create_arena(total_tokens, self.layout)
        self.decode_kernel = backend.decode_attention()
        self.sampler = Sampler()
        self.eos_ids: tuple[int, ...] = tuple(c.eos_token_ids)  # end a request unless ignore_eos
        # hidden states a length probe reads: set capture_layers, and after each run() `captured[layer]` holds
        # one [len(work), hidden] row per work item (its last fed position); empty: nothing captured, no cost
        self.capture_layers: tuple[int, ...] = ()
        self.captured: dict[int, torch.Tensor] = {}

    @property
    def bytes_per_token(self) -> int:
        return self.layout.bytes_per_token

    @torch.inference_mode()
    def run(self, work: list[Work]) -> list[int | None]:
        """Feed each item's tokens [start, start+q_len) and return its next token (None: chunk of a longer
        prefill, nothing to sample yet)."""
        device = self.backend.device
        ids: list[int] = []
        positions: list[int] = []
        slots: list[SeqSlot] = []
        for w in work:
            ids += w.seq.token_ids(w.start, w.start + w.q_len)
            positions += range(w.start, w.start + w.q_len)
            slots.append(SeqSlot(self.arena.view(w.seq.block), w.start, w.q_len))
        capture = HiddenCapture(self.capture_layers) if self.capture_layers else None
        with prompt_logprobs(self.model, work):  # only for requests that ask (echo with logprobs)
            logits = self.model(
                torch.tensor(ids, dtype=torch.long, device=device),
                torch.tensor(positions, dtype=torch.long, device=device),
                slots,
                self.decode_kernel,
                capture=capture,
            ).cpu()
        self.captured = {k: v.cpu() for k, v in capture.last.items()} if capture is not None else {}
        for w in work:
            w.seq.num_cached = w.start + w.q_len
        params = [w.seq.params for w in work]
        banned = [self._banned(w) for w in work]
        chosen = SampledLogprobs(work, logits)  # before the sampler masks the logits in place
        tokens = self.sampler(logits, params, [w.seq.generator for w in work], banned)
        tokens = [t if w.seq.num_cached == w.seq.num_tokens else None for t, w in zip(tokens, work)]
        chosen.record(tokens)
        return tokens

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
