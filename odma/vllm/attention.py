"""odma's attention backend for vLLM: contiguous block runs read as one range.

vLLM lets a plugin override an attention backend (`register_backend`), and a backend chooses its KV cache's layout.
This one asks for LHBNC: within a layer, each KV head's plane holds every block in block-id order, a row per token
(its K, then its V). So a request whose block table is one run of consecutive ids (what odma.vllm's scheduler gives
a request sized by its predicted length) is one range of rows per head, and decode attention reads it as one
sequential stream; any other request is read run by run, or block by block. Decode rows go through one kernel call
per layer for the whole step: on vLLM's CPU platform odma's C kernel for that layout (backends/run_attention.py,
float32), on an accelerator the Triton kernels (backends/triton_runs.py; float32, bf16, fp16). Prefill chunks go
through torch's SDPA over the request's rows (a view where they are one run, a gather otherwise); the step's new
K/V rows are written at their slots by the same kernels.

The backend stands in for the one vLLM picks on the platform: CPU_ATTN on CPU, TRITON_ATTN on CUDA (chosen there
with `--attention-backend TRITON_ATTN`; vLLM's default on CUDA is another). Settings (PluginConfig.attention):
"runs" reads runs as ranges (the default), "paged" reads every block apart (the same backend and kernel: what
separates the layout's effect from the kernel's), "off" gives vLLM's own backend. A cache dtype the kernel does not
take runs every request through SDPA (correct, slower, said once).

vLLM resolves the registered class once per process; what depends on an engine's settings is decided each time
vLLM asks (the layout, the implementation, the builder), under that engine's config, so "off" gives an engine vLLM's
own attention whatever the process served before. Only decoder self-attention is taken; ALiBi, sliding windows,
sinks, soft caps and quantized KV caches are refused in words, so vLLM never runs them wrongly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from vllm.config.vllm import get_current_vllm_config_or_none
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.platforms import current_platform
from vllm.v1.kv_cache_layout import KVCacheLayout

from backends import BackendError, for_device
from backends.run_attention import load as load_run_kernel, one_run
from odma.vllm.config import PluginConfig

log = logging.getLogger("vllm.odma")
MAX_HEAD_DIM, MAX_GROUP = 256, 16  # what csrc/run_attention.c takes (the Triton kernels take the same)


def _triton_serves(device: torch.device) -> bool:
    """Whether the Triton run kernels are the attention on `device`, as odma's backend for it declares (the CPU's is
    its C kernel); a device odma has no backend for is tried too (vLLM runs on more platforms than odma opens)."""
    try:
        return for_device(device).capabilities.attention == "triton"
    except BackendError:
        return True


def _platform_backend() -> type[AttentionBackend]:
    """The backend this one stands in for: vLLM's own on this platform."""
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return CPUAttentionBackend
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    return TritonAttentionBackend


STOCK = _platform_backend()


def plugin_config() -> PluginConfig:
    """The plugin's settings under vLLM's current config (its additional_config and the environment; the
    environment alone where no engine is being set up)."""
    config = get_current_vllm_config_or_none()
    return PluginConfig.from_sources(config.additional_config if config is not None else {})


def _stock() -> bool:
    """attention "off": this engine keeps vLLM's own CPU attention (its layout, builder and kernels)."""
    return plugin_config().attention == "off"


class OdmaAttentionBackend(AttentionBackend):
    """Registered for the platform's backend (the plugin: CPU_ATTN or TRITON_ATTN). vLLM resolves a backend class
    once per process, so what depends on the engine's settings (attention "off" keeps vLLM's own) is decided where
    vLLM asks, under its config."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16, torch.float16]
    # what vLLM's own takes (for "off"); the implementation refuses, in words, what odma's kernel does not take
    supported_kv_cache_dtypes: ClassVar[list[str]] = STOCK.supported_kv_cache_dtypes

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size == 48 or STOCK.supports_head_size(head_size)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        if _stock():
            return STOCK.supported_kv_cache_layouts()
        return (KVCacheLayout.LHBNC,)  # a head's blocks in id order: a run of ids is a range of rows

    @staticmethod
    def get_name() -> str:
        return STOCK.get_name()  # the backend this class stands in for

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        if _stock():
            return STOCK.supports_attn_type(attn_type)
        return attn_type == AttentionType.DECODER

    @staticmethod
    def get_impl_cls():
        return STOCK.get_impl_cls() if _stock() else OdmaAttentionImpl

    @staticmethod
    def get_builder_cls():
        return STOCK.get_builder_cls() if _stock() else OdmaMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        if _stock():
            return STOCK.get_supported_kernel_block_sizes(kv_cache_spec)
        return [MultipleOf(1)]


@dataclass
class OdmaAttentionMetadata:
    num_actual_tokens: int
    block_size: int
    slot_mapping: torch.Tensor  # int64 [tokens]: row of each new token's K/V in every plane
    # decode rows, for the kernel: their block tables, lengths (this token included), query rows, on the cache's
    # device; and a bound on their lengths (the step's longest sequence)
    decode_table: torch.Tensor
    decode_lens: torch.Tensor
    decode_rows: torch.Tensor
    decode_longest: int = 0
    decode_first: torch.Tensor | None = None  # the accelerator kernel's run starts, made by the step's first layer
    # prefill chunks: (query start, query length, tokens attended, rows: a (start, stop) range or an index tensor)
    prefills: list[tuple[int, int, int, object]] = field(default_factory=list)


class OdmaMetadataBuilder(AttentionMetadataBuilder[OdmaAttentionMetadata]):
    """Per step, shared by every layer: which rows decode and what each prefill chunk reads. A decode-only step
    reads nothing back from the device; a step with prefills reads their lengths and block tables once."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> OdmaAttentionMetadata:
        m = common_attn_metadata
        n = m.num_reqs
        starts = m.query_start_loc_cpu[:n + 1].to(torch.int64)
        q_lens = starts[1:] - starts[:-1]
        seq_lens = m.seq_lens[:n].to(torch.int32)
        table = m.block_table_tensor[:n]
        decode = torch.nonzero(q_lens == 1).flatten()
        prefill = torch.nonzero(q_lens > 1).flatten()
        prefills = []
        if prefill.numel():
            lens_host = seq_lens[prefill.to(seq_lens.device)].cpu()
            table_host = table[prefill.to(table.device)].cpu()
            blocks = (lens_host.to(torch.int64) + self.block_size - 1) // self.block_size
            runs = one_run(table_host, blocks)
            for i, r in enumerate(prefill.tolist()):
                n_tokens = int(lens_host[i])
                first = int(table_host[i, 0]) * self.block_size
                rows: object = (first, first + n_tokens) if bool(runs[i]) else \
                    _rows(table_host[i], n_tokens, self.block_size).to(self.device)
                prefills.append((int(starts[r]), int(q_lens[r]), n_tokens, rows))
        on_device = decode.to(table.device)
        return OdmaAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens, block_size=self.block_size,
            slot_mapping=m.slot_mapping[:m.num_actual_tokens].to(torch.int64),
            decode_table=table[on_device].to(torch.int32).contiguous(),
            decode_lens=seq_lens[on_device].contiguous(),
            decode_rows=starts[decode].contiguous().to(table.device), decode_longest=m.max_seq_len,
            prefills=prefills)


def _rows(table_row: torch.Tensor, n_tokens: int, block_size: int) -> torch.Tensor:
    """The plane rows of a request's first n_tokens, through its block table."""
    blocks = table_row[:-(-n_tokens // block_size)].to(torch.int64)
    return (blocks[:, None] * block_size + torch.arange(block_size)[None, :]).flatten()[:n_tokens]


class OdmaAttentionImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks: torch.Tensor | None = None) -> None:
        unsupported = {"ALiBi": alibi_slopes is not None, "a sliding window": sliding_window is not None,
                       "attention sinks": sinks is not None, "a logits soft cap": bool(logits_soft_cap),
                       "a quantized KV cache": kv_cache_dtype != "auto",
                       f"head size {head_size} (at most {MAX_HEAD_DIM})": head_size > MAX_HEAD_DIM,
                       f"{num_heads // max(num_kv_heads, 1)} query heads per KV head (at most {MAX_GROUP})":
                           num_heads > MAX_GROUP * num_kv_heads,
                       f"{attn_type} attention": attn_type != AttentionType.DECODER}
        refused = [what for what, asked in unsupported.items() if asked]
        if refused:
            raise NotImplementedError(f"odma's attention backend does not take {', '.join(refused)}; set "
                                      "ODMA_VLLM_ATTENTION=off (or additional_config odma.attention \"off\") to "
                                      "serve this model with vLLM's own CPU attention")
        self.num_heads, self.head_size, self.scale, self.num_kv_heads = num_heads, head_size, float(scale), num_kv_heads
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type
        config = plugin_config()
        self.coalesce = config.attention != "paged"
        # on CPU the C kernel; on an accelerator the Triton kernels, made at the first call on the cache's device
        self.kernel = load_run_kernel() if current_platform.is_cpu() else None
        if self.kernel is None and current_platform.is_cpu():
            log.warning("odma attention: the C kernel is unavailable; every request runs through SDPA")
        self._said_dtype = False

    def _kernel_for(self, planes: torch.Tensor):
        """The run kernel for this cache, or None where it cannot read it (SDPA then)."""
        if self.kernel is None and _triton_serves(planes.device):
            from backends.triton_runs import TritonRunAttention

            try:
                self.kernel = TritonRunAttention(planes.device)
            except Exception as e:  # noqa: BLE001 - no Triton for this device: SDPA, said once
                log.warning("odma attention: %s; every request runs through SDPA", e)
                self.kernel = False
        if not self.kernel:
            return None
        if planes.dtype not in self.kernel.dtypes:
            if not self._said_dtype:
                log.warning("odma attention: the run kernel reads %s caches, not %s; every request runs through "
                            "SDPA", [str(d) for d in self.kernel.dtypes], planes.dtype)
                self._said_dtype = True
            return None
        return self.kernel

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: OdmaAttentionMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None, output_block_scale: torch.Tensor | None = None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by odma's attention backend")
        if attn_metadata is None:  # vLLM's warm-up
            return output
        t = attn_metadata.num_actual_tokens
        planes = _planes(kv_cache)
        q = query[:t].view(t, self.num_heads, self.head_size)
        out = output[:t].view(t, self.num_heads, self.head_size)
        meta = attn_metadata
        kernel = self._kernel_for(planes)
        if meta.decode_rows.numel():
            if kernel is not None:
                if meta.decode_first is None:  # which requests are one run, planned once a step (where planned)
                    meta.decode_first = kernel.first_rows(meta.decode_table, meta.decode_lens, meta.block_size,
                                                          self.coalesce)
                kernel.decode(planes, meta.block_size, meta.decode_table, meta.decode_lens, meta.decode_rows,
                              q, out, self.scale, coalesce=self.coalesce, longest=meta.decode_longest,
                              first=meta.decode_first,
                              # read per call: vLLM sets its thread count after the model (and this) is built
                              workers=torch.get_num_threads())
            else:
                for row, n, table in zip(meta.decode_rows.tolist(), meta.decode_lens.tolist(), meta.decode_table):
                    rows = _rows(table, n, meta.block_size)
                    out[row:row + 1] = self._sdpa(q[row:row + 1], planes, rows, n)
        for start, q_len, n, rows in meta.prefills:
            out[start:start + q_len] = self._sdpa(q[start:start + q_len], planes, rows, n)
        return output

    def _sdpa(self, q: torch.Tensor, planes: torch.Tensor, rows, n: int) -> torch.Tensor:
        """q [q_len, heads, D] at positions n - q_len .. n - 1 over the request's rows (a range or an index)."""
        d = self.head_size
        kv = planes[:, rows[0]:rows[1]] if isinstance(rows, tuple) else planes[:, rows]
        k, v = kv[..., :d], kv[..., d:]
        q_len = q.shape[0]
        mask = None
        if q_len > 1 and q_len != n:  # a chunk after cached tokens: its causal mask starts n - q_len in
            at = torch.arange(n, device=q.device)
            mask = at[None, :] <= at[n - q_len:, None]
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None].to(planes.dtype), k[None], v[None],
                                           attn_mask=mask, is_causal=q_len > 1 and q_len == n, scale=self.scale,
                                           enable_gqa=True)
        return o[0].transpose(0, 1).to(q.dtype)

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        planes = _planes(kv_cache)
        t = slot_mapping.shape[0]
        slots = slot_mapping.to(torch.int64)
        kernel = self._kernel_for(planes)
        if kernel is not None and key.dtype == planes.dtype:
            kernel.write(planes, key[:t], value[:t], slots)
            return
        keep = slots >= 0
        rows = slots[keep]
        planes[:, rows, :self.head_size] = key[:t][keep].transpose(0, 1).to(planes.dtype)
        planes[:, rows, self.head_size:] = value[:t][keep].transpose(0, 1).to(planes.dtype)


def _planes(kv_cache: torch.Tensor) -> torch.Tensor:
    """vLLM's per-layer view [blocks, kv_heads, block_size, 2 * D] in the LHBNC layout → the planes [kv_heads,
    blocks * block_size, 2 * D] (a view: heads are outermost in memory)."""
    blocks, heads, block_size, width = kv_cache.shape
    planes = kv_cache.permute(1, 0, 2, 3)
    if not planes.is_contiguous():
        raise RuntimeError("odma's attention backend needs the LHBNC KV cache layout; vLLM resolved another "
                           "(VLLM_KV_CACHE_LAYOUT or another backend in the same model?)")
    return planes.view(heads, blocks * block_size, width)


Backend = OdmaAttentionBackend  # the name the plugin registers
