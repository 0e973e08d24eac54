"""Llama / Qwen2 decoder whose attention reads and writes each request's KV in its own contiguous block.

The linear layers see every token of the step packed as one [T, hidden] matrix (prefill chunks and
decode tokens together); only attention is per request, over the range [:n] of that request's block,
so no padding, no gather of scattered pages, and no per-request allocation of KV.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from backends import for_device
from odma.errors import ConfigError
from odma.models.config import ModelConfig

if TYPE_CHECKING:
    from backends.cpu_attention import DecodeAttention, DecodeBatch
    from odma.models.native_step import NativeLayers
    from backends.triton_attention import TritonAttention, TritonStep


@dataclass(slots=True)
class SeqSlot:
    """One request in a forward step: its block view and where this step's tokens go in it."""

    kv: torch.Tensor  # [layers, 2, capacity, kv_heads, head_dim], a view into the pool's arena
    start: int  # tokens already cached in the block
    q_len: int  # tokens fed this step (prompt chunk, or 1 when decoding)
    # paged KV (the baseline): the request's page ids in order, and `kv` is the whole arena viewed as pages
    # [pages, layers, 2, page_tokens, kv_heads, head_dim]; only the Triton attention reads pages
    pages: list[int] | None = None
    # a shared prompt prefix read in place (odma.kv.shared_rows): (another block's view, the first row it holds, the
    # row after the piece), in row order; `kv` then holds the rows after the last piece
    pieces: list[tuple[torch.Tensor, int, int]] | None = None

    @property
    def first_row(self) -> int:
        """The first row `kv` holds (0 without pieces)."""
        return self.pieces[-1][2] if self.pieces else 0


@dataclass(slots=True)
class HiddenCapture:
    """Asks `CausalLM.forward` for the residual stream after given decoder layers (0: the embeddings) at each
    request's last fed position: what a length probe reads at the end of a prefill or at a decode step.
    `forward` fills `last[layer]` with a [len(seqs), hidden] float32 tensor, in `seqs` order. Passing none
    costs nothing."""

    layers: tuple[int, ...]
    last: dict[int, torch.Tensor] = field(default_factory=dict)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same arithmetic as transformers' LlamaRMSNorm (float32 statistics) so greedy tokens match.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)
        self._table: torch.Tensor | None = None
        self._table_of: torch.Tensor | None = None  # the inv_freq the table was made from

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, head_dim], broadcast over heads
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def table(self, positions: int) -> torch.Tensor:
        """[n >= positions, head_dim] float32: at each position the cos of every frequency, then the sin, as
        cos_sin computes them (for kernels that rotate q and k themselves). Made once and grown by doubling: size it
        for the longest sequence at start, so that its address never changes under a captured graph."""
        table = self._table
        if table is None or self._table_of is not self.inv_freq or table.shape[0] < positions:
            n = max(positions, 2 * table.shape[0] if table is not None else 1)
            freqs = torch.arange(n, device=self.inv_freq.device).float()[:, None] * self.inv_freq[None, :]
            self._table, self._table_of = torch.cat((freqs.cos(), freqs.sin()), dim=-1), self.inv_freq
        return self._table


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.sizes = (q, kv, kv)
        self.qkv_proj = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=cfg.qkv_bias)  # q, k, v in one GEMM
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=cfg.o_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, seqs: list[SeqSlot],
                decode: DecodeBatch | TritonStep | None = None) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = q.view(t, self.heads, self.head_dim)
        k = k.view(t, self.kv_heads, self.head_dim)
        v = v.view(t, self.kv_heads, self.head_dim)
        if decode is not None and decode.rows is None:  # the step's kernel takes every request in one call
            if not decode.rotates:  # (the Triton kernels rotate q and k themselves, casting to the cache's dtype)
                kv_dtype = decode.kv_dtype
                q, k, v = _rotate(q, cos, sin).to(kv_dtype), _rotate(k, cos, sin).to(kv_dtype), v.to(kv_dtype)
            return self.o_proj(decode.attend(self.layer, q, k, v).view(t, -1).to(x.dtype))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        # The KV cache may be wider than the weights (bf16 weights, fp32 KV on CPUs whose bf16 attention is
        # slow): attention runs in the cache's dtype, the projections in the weights'. Same dtype: no-ops. An fp16
        # cache where the backend widens it (the CPU's) is storage only: its rows are read widened, attention in fp32.
        cache_dtype = seqs[0].kv.dtype
        widen = cache_dtype == torch.float16 and for_device(x.device).capabilities.widens_half_kv
        kv_dtype = torch.float32 if widen else cache_dtype
        q = q.to(kv_dtype)
        out = torch.empty_like(q)
        if decode is not None:  # the backend's kernel takes its requests of the step in one call per layer
            r = decode.rows
            out[r] = decode.attend(self.layer, q[r], k[r].to(kv_dtype), v[r].to(kv_dtype))
        pos = 0
        for i, s in enumerate(seqs):
            if decode is not None and i in decode.picked:
                pos += s.q_len
                continue
            end = s.start + s.q_len
            first = s.first_row
            cache = s.kv[self.layer]  # [2, capacity, kv_heads, head_dim]
            cache[0, s.start - first : end - first] = k[pos : pos + s.q_len]
            cache[1, s.start - first : end - first] = v[pos : pos + s.q_len]
            rows = _rows(s, self.layer, cache[:, : end - first])
            out[pos : pos + s.q_len] = _attend(q[pos : pos + s.q_len], rows[0].to(kv_dtype), rows[1].to(kv_dtype),
                                               s.start)
            pos += s.q_len
        return self.o_proj(out.view(t, -1).to(x.dtype))


def _rows(slot: SeqSlot, layer: int, own: torch.Tensor) -> torch.Tensor:
    """[2, rows, kv_heads, head_dim] of `layer`: the slot's pieces read from other blocks, then `own` (its block's)."""
    if not slot.pieces:
        return own
    parts, previous = [], 0
    for view, first, end in slot.pieces:
        parts.append(view[layer, :, previous - first : end - first])
        previous = end
    return torch.cat([*parts, own], dim=1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q [n, H, D] at positions start..start+n-1 over the contiguous cache k, v [start+n, KVH, D]."""
    n = q.shape[0]
    mask, causal = None, False
    if n > 1 and start == 0:
        causal = True
    elif n > 1:  # a chunk after cached tokens: is_causal would align top-left, so spell the mask out
        rows = torch.arange(n, device=q.device)[:, None] + start
        mask = torch.arange(start + n, device=q.device)[None, :] <= rows
    # 4-D inputs take SDPA's fused CPU kernel (3-D ones fall back to a slower path); no copy of k, v
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, is_causal=causal, enable_gqa=True,
    )
    return o[0].transpose(0, 1)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # one GEMM
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, seqs, decode=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, seqs, decode)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """The served model. `forward` runs one packed step and returns the logits of each request's last token."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        # the decoder layers as the CPU backend's decode-step kernel runs them (set by the model runner where it can:
        # odma/models/native_step.py); None: every step runs the Python layers below
        self.native_layers: NativeLayers | None = None

    @property
    def dtype(self) -> torch.dtype:
        # the norms': lm_head may hold only a packed copy, and native GGUF weights have no float embedding table
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def _native_prefill(self, attention, seqs: list[SeqSlot]) -> bool:
        """Whether a step with prefill rows goes to the native layers too, each of its rows as a row of its own:
        where they exist and take it (NativeLayers.takes_prefill) and nothing hooks the last layer (prompt logprobs
        read its output in Python)."""
        return (self.native_layers is not None and hasattr(attention, "plan_tokens")
                and not self.model.layers[-1]._forward_hooks and self.native_layers.takes_prefill(seqs))

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        c = self.config
        size = torch.tensor([], dtype=dtype or self.dtype).element_size()
        return c.num_layers * 2 * c.num_kv_heads * c.head_dim * size

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seqs: list[SeqSlot],
                attention: DecodeAttention | TritonAttention | None = None,
                capture: HiddenCapture | None = None, step: TritonStep | None = None) -> torch.Tensor:
        """input_ids, positions: [T] for all requests' new tokens, in `seqs` order. Returns [len(seqs), vocab].
        attention: the backend's kernel, planned once for the step (the CPU's takes the decoding requests, the
        Triton one every request, rotating q and k itself); None: SDPA for every request. step: a plan made
        beforehand (a captured decode batch: `seqs` is then unused). capture: hidden states to hand back (see
        HiddenCapture)."""
        if step is not None:
            decode = step
        elif attention is None:
            decode = None
        elif getattr(attention, "fuses_rotary", False):
            decode = attention.plan_step(seqs, rotary=self.rotary.table(max(s.start + s.q_len for s in seqs)))
        else:
            decode = None
            if self._native_prefill(attention, seqs):
                decode = attention.plan_tokens(seqs)
            decode = decode or attention.plan_step(seqs)
        native = self.native_layers if self.native_layers is not None and self.native_layers.serves(decode) else None
        if native is not None or (decode is not None and decode.rows is None and decode.rotates):
            cos = sin = None  # the kernels rotate
        else:
            cos, sin = self.rotary.cos_sin(positions, self.dtype)
        x = self.model.embed_tokens(input_ids)
        last = getattr(decode, "last", False) if decode is not None else False
        if last is False:
            last = torch.tensor([s.q_len for s in seqs], device=x.device).cumsum(0) - 1
        if native is not None:  # one token per request: x's rows are the requests' last positions
            rotary = self.rotary.table(int(decode.lens.max()))
        layers = len(self.model.layers)
        wanted = set(capture.layers) if capture is not None else set()
        if not wanted <= set(range(layers + 1)):
            raise ConfigError(f"capture layers {sorted(wanted)} outside 0..{layers}")
        done = 0
        for stop in sorted(wanted | {layers}):  # run up to each captured layer, then capture
            if native is not None and stop > done:
                x = native.run(x, decode, rotary, done, stop - done)
            else:
                for layer in self.model.layers[done:stop]:
                    x = layer(x, cos, sin, seqs, decode)
            done = stop
            if stop in wanted:
                capture.last[stop] = (x if last is None else x[last]).float()
        return self.lm_head(self.model.norm(x if last is None else x[last])).float()

    def load_hf_state(self, state: dict[str, torch.Tensor], dtype: torch.dtype, device: str) -> None:
        """Load a transformers-named state dict; ties lm_head to the embeddings when the config says so."""
        if "lm_head.weight" not in state:
            if not self.config.tie_word_embeddings and "model.embed_tokens.weight" not in state:
                raise ConfigError("weights have neither lm_head.weight nor tied embeddings")
            state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
        state = _fuse(state, self.config.num_layers)
        expected = {k for k, _ in self.named_parameters()}
        missing = expected - state.keys()
        if missing:
            raise ConfigError(f"weights are missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
        self.to_empty(device=device)
        self.rotary.inv_freq = Rotary(self.config.head_dim, self.config.rope_theta).inv_freq.to(device)
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name in expected:
                params[name].copy_(state[name].to(dtype))
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.to(dtype)
        self.rotary.inv_freq = self.rotary.inv_freq.float()


def _fuse(state: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """transformers' separate q/k/v and gate/up weights → our fused ones (rows concatenated in order)."""
    state = dict(state)
    for i in range(layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for kind in ("weight", "bias"):
            parts = [state.pop(f"{a}{p}_proj.{kind}", None) for p in "qkv"]
            if all(t is not None for t in parts):
                state[f"{a}qkv_proj.{kind}"] = torch.cat(parts)
        gate, up = state.pop(f"{m}gate_proj.weight", None), state.pop(f"{m}up_proj.weight", None)
        if gate is not None and up is not None:
            state[f"{m}gate_up_proj.weight"] = torch.cat([gate, up])
    return state
