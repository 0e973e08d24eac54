"""One device's share of the engine: its backend, KV arena (model runner), pool, scheduler, and the optional
ballooning and swap around them. The engine holds one worker per device; the predictor, the bucket policy
(one set of bounds on every device), the request table and the length log stay engine-wide."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from odma.engine.config import PAGE_TOKENS, EngineConfig, parse_kv_budget
from odma.engine.decode_graphs import GRAPH_PIECES
from odma.engine.model_runner import ModelRunner
from odma.engine.scheduler import Scheduler
from odma.errors import ConfigError
from odma.kv import ContiguousKV, DeviceLoad, ElasticKV, KVPool, MappedKV, PagedKV, PlaneGeometry, ReservationPolicy
from odma.models.llama import CausalLM

log = logging.getLogger(__name__)


@dataclass(eq=False)
class DeviceWorker:
    device: str
    backend: Any
    runner: ModelRunner
    kv: ContiguousKV | PagedKV | MappedKV  # the door the scheduler uses
    scheduler: Scheduler
    swap: Any = None  # odma.engine.swap.HostSwap when preempting by swap

    @property
    def pool(self) -> KVPool | PagedKV | MappedKV:
        """The device's pool, for observability (stats) and tests; scheduling goes through `kv`. The paged
        baseline's pages and mapped memory answer `stats()` themselves."""
        return self.kv if isinstance(self.kv, (PagedKV, MappedKV)) else self.kv.pool

    @property
    def elastic(self) -> ElasticKV | None:
        return self.kv.elastic

    def load(self) -> DeviceLoad:
        """What placement weighs: blocks held plus what the queue will reserve, tokens attended per step plus
        the queue's prompts (a request placed here waits behind them)."""
        queued_need = sum(self.kv.initial_tokens(s) for s in self.scheduler.waiting)
        queued_prompts = sum(s.prompt_tokens for s in self.scheduler.waiting)
        return self.kv.load(self.device, queued_need, queued_prompts)


def build_worker(config: EngineConfig, device: str, backend: Any, model: CausalLM, policy: ReservationPolicy,
                 kv_dtype: torch.dtype) -> DeviceWorker:
    """`config.kv_budget` is per device (bytes, or a share of this device's memory)."""
    budget = parse_kv_budget(config.kv_budget, backend.memory_info().total_bytes)
    bytes_per_token = model.kv_bytes_per_token(kv_dtype)
    total_tokens = budget // bytes_per_token
    if total_tokens < config.pool.align:
        raise ConfigError(f"kv budget {config.kv_budget!r} holds {total_tokens} tokens of {bytes_per_token} B each")
    if config.policy == "paged":
        return _build_paged_worker(config, device, backend, model, kv_dtype, total_tokens, bytes_per_token)
    wants_map = config.kv_growth == "map" or (config.kv_growth == "auto" and not config.balloon
                                              and not config.reads_pieces)
    mapped = _build_mapped(config, device, backend, model, policy, kv_dtype, budget) if wants_map else None
    if mapped is not None:
        runner, kv = mapped
    else:
        runner = _runner(config, model, backend, total_tokens, kv_dtype)
        settings = config.resolved_pool  # packing's growth, when it is on
        # static blocks never grow and never use the large bucket: give it the whole budget as one region
        large_share = 0.0 if config.policy == "static" else settings.large_share
        pool = KVPool(total_tokens, policy, large_share=large_share, align=settings.align,
                      bytes_per_token=bytes_per_token, mover=runner.arena,
                      worst_case_prompt_share=settings.worst_case_prompt_share,
                      neighbour_growth=settings.neighbour_growth)
        kv = ContiguousKV(pool, elastic=_build_elastic(config, backend, runner, pool) if config.balloon else None,
                          compact_growth=settings.compact_growth,
                          slide_growth=settings.compact_growth and settings.slide_growth,
                          read_prefixes=config.prefix_reads and config.policy != "static",
                          continue_growth=settings.continue_growth and config.policy != "static")
    swap = None
    if config.resolved_preempt == "swap":
        from odma.engine.swap import HostSwap
        from odma.kv import OffloadConfig, OffloadController

        capacity = parse_kv_budget(config.swap_space, backend.memory_info().total_bytes)
        swap = HostSwap(backend, runner, OffloadController(OffloadConfig(capacity_bytes=capacity)))
    scheduler = Scheduler(kv, config.scheduler_config(model.config), swap)
    log.info("%s: kv budget %.1f MiB = %d tokens (%d B/token); growth by %s; attention: %s", device, budget / 2**20,
             kv.total_tokens, bytes_per_token, "mapping" if mapped is not None else "copy", attention_name(runner))
    return DeviceWorker(device, backend, runner, kv, scheduler, swap)


def attention_name(runner: ModelRunner) -> str:
    kind = type(runner.attention).__name__
    name = {"DecodeAttention": "the CPU decode kernel (SDPA for prefills)", "TritonAttention": "Triton kernels",
            "NoneType": "SDPA per request"}.get(kind, kind)
    if runner.graphs is not None:
        name += f", decode batches {'captured as graphs' if runner.graphs.mode == 'capture' else 'static'}"
    return name


def _runner(config: EngineConfig, model: CausalLM, backend: Any, total_tokens: int, kv_dtype: torch.dtype,
            page_tokens: int | None = None, arena: Any = None) -> ModelRunner:
    from backends import BackendError

    try:
        return ModelRunner(model, backend, total_tokens, kv_dtype=kv_dtype, attention=config.attention,
                           page_tokens=page_tokens, arena=arena, max_positions=config.max_model_len,
                           decode_graphs=config.decode_graphs, max_batch=config.max_num_seqs,
                           graph_pieces=GRAPH_PIECES if config.reads_pieces else 0)
    except BackendError as exc:
        raise ConfigError(str(exc)) from None


def _build_mapped(config: EngineConfig, device: str, backend: Any, model: CausalLM, policy: ReservationPolicy,
                  kv_dtype: torch.dtype, budget: int) -> tuple[ModelRunner, MappedKV] | None:
    """Growth by mapping: a virtual arena with room for twice max_num_seqs worst-case blocks, backed by the budget's
    memory in granules; None (copy migration, with a warning) where the backend has no virtual memory or refuses the
    range."""
    from backends import BackendError, KVLayout, create_virtual_arena

    c = model.config
    layout = KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype)
    auto = config.kv_growth == "auto"
    vm = backend.virtual_memory()
    if vm is None:
        say = log.info if auto else log.warning
        say("%s: no virtual memory on this backend; blocks grow by copy migration", device)
        return None
    geometry = PlaneGeometry(c.num_layers, layout.bytes_per_token // (2 * c.num_layers), vm.granularity)
    if auto and geometry.step_tokens > config.pool.align:
        log.info("%s: blocks grow by copy migration: a %d-byte granule would grow each layer's K by %d tokens at a "
                 "time (more than the pool's %d-token unit)", device, vm.granularity, geometry.step_tokens,
                 config.pool.align)
        return None
    longest = min(config.max_model_len or c.max_position_embeddings, budget // layout.bytes_per_token)
    guard_tokens = geometry.layout_tokens(-(-vm.granularity // layout.bytes_per_token))  # the range's guard granule
    virtual_tokens = guard_tokens + 2 * config.max_num_seqs * geometry.layout_tokens(max(longest, 1))
    try:
        arena = create_virtual_arena(backend, virtual_tokens, layout, budget)
    except BackendError as exc:  # the driver or torch refused the range: nothing is held, copy migration works
        log.warning("%s: virtual memory refused (%s); blocks grow by copy migration", device, exc)
        return None
    try:
        kv = MappedKV(policy, geometry, arena, virtual_tokens)
    except ConfigError as exc:
        arena.release()
        log.warning("%s: virtual memory unusable (%s); blocks grow by copy migration", device, exc)
        return None
    runner = _runner(config, model, backend, virtual_tokens, kv_dtype, arena=arena)
    return runner, kv


def _build_paged_worker(config: EngineConfig, device: str, backend: Any, model: CausalLM, kv_dtype: torch.dtype,
                        total_tokens: int, bytes_per_token: int) -> DeviceWorker:
    """The paged baseline: the same budget as pages of PAGE_TOKENS, handed out one at a time as requests grow (vLLM's
    memory), read through page tables by the same Triton kernels. Preempted requests are recomputed, as vLLM does by
    default (pages are not swapped); no prefix copies (a copy needs a contiguous source)."""
    pages = total_tokens // PAGE_TOKENS
    runner = _runner(config, model, backend, pages * PAGE_TOKENS, kv_dtype, page_tokens=PAGE_TOKENS)
    kv = PagedKV(pages * PAGE_TOKENS, page_tokens=PAGE_TOKENS, bytes_per_token=bytes_per_token)
    scheduler = Scheduler(kv, config.scheduler_config(model.config))
    log.info("%s: paged kv, %d pages of %d tokens (%d B/token); preemption: %s; attention: %s", device, pages,
             PAGE_TOKENS, bytes_per_token, scheduler.config.preempt, attention_name(runner))
    return DeviceWorker(device, backend, runner, kv, scheduler)


def _build_elastic(c: EngineConfig, backend, runner: ModelRunner, pool: KVPool) -> ElasticKV:
    """Ballooning between the activation reserve and the KV pool: profile the activation peak of a prefill (as
    vLLM does before sizing its cache), keep room for a max_prefill_tokens step, lend the rest to the pool in
    segments. Segments are real arenas of the backend, viewed through one SegmentedArena (the runner's arena
    from now on)."""
    from odma.kv import ActivationProfile, BalloonPool

    if c.balloon_segment_tokens % c.pool.align:
        raise ConfigError(f"balloon_segment_tokens must be a multiple of the pool's align ({c.pool.align})")
    m = c.max_prefill_tokens
    points = sorted({max(1, min(64, m // 4)), min(256, m)})  # two sizes; linear beyond (flash-style SDPA)
    profile = ActivationProfile(runner.profile_activations(points))
    reserve = profile.peak_bytes(c.max_prefill_tokens)
    balloon = BalloonPool(pool, c.balloon_segment_tokens, backend=backend, base_arena=runner.arena, layout=runner.layout)
    runner.arena = balloon.arena
    log.info("ballooning: activation reserve %.1f MiB (a %d-token prefill; %s B/token measured), segments of "
             "%d tokens", reserve / 2**20, c.max_prefill_tokens,
             {t: profile.peak_bytes(t) // t for t in points}, c.balloon_segment_tokens)
    return ElasticKV(balloon, profile, reserve, keep_tokens=c.balloon_keep_tokens)
