"""The serving engine's configuration (frozen). `odma-serve` flags map onto these fields one to one (`--x-y` sets
`x_y`; `--slo-ttft`/`--slo-tpot` set `slo_*_s`; `--growth`, `--growth-step`, `--reserve-scale`, `--large-share`,
`--worst-case-prompt-share`, `--compact-growth`, `--slide-growth`, `--neighbour-growth` and `--continue-growth` set
`pool.*`; `--max-tokens-cap` also sets `buckets.large_bound`). Config-only, on
purpose: `pool.align` (the unit every block and bucket bound is a multiple of) and the bucket manager's window,
refresh and method (`buckets.*`): the replays chose them (docs/analyze.md) and a wrong value silently wastes
memory, so they are set in code or through `odma-analyze` experiments, not per start."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from odma.config import BucketConfig, PoolConfig, default_cache_dir
from odma.errors import ConfigError
from odma.engine.admission import admission_rules
from odma.engine.ordering import ORDERS
from odma.engine.prefill_cost import PrefillCost
from odma.engine.scheduler_config import SchedulerConfig
from backends import BackendError, Capabilities, for_device, parse_device
from backends.base import ATTENTION_KINDS  # noqa: F401 (re-exported for the CLI)
from odma.kv import POLICY_KINDS
from odma.models.weights import WEIGHT_DTYPES, WEIGHTS

if TYPE_CHECKING:
    from odma.models.config import ModelConfig

# the contiguous pool's reservation policies, and "paged": vLLM-style 16-token pages in this engine (the baseline the
# contiguous pool is measured against: same model, kernels and scheduler; Triton attention only)
POLICIES = (*POLICY_KINDS, "paged")
KV_GROWTH = ("copy", "map", "auto")
DECODE_GRAPHS = ("auto", "capture", "static", "off")
PAGE_TOKENS = 16

# packing's admission share (EngineConfig.packing): reservations within 97 % of the pool leave the running requests
# room to grow into; in the GPU replay 0.99 and 1.0 preempted up to 11 and 22 of 400 requests, relocated 1.6-2.1x as
# many tokens and lost 0.3-1.3 % (docs/results/gpu/replay_policy.md)
PACKED_THETA = 0.97

# what the realized-length log keeps of each prompt: the text, its SHA-256, or nothing
LOG_PROMPT_MODES = ("text", "hash", "none")
TAGGING = ("auto", "loop", "ahead")  # where a request is tagged with its predicted length (EngineConfig.tagging)


def device_kind(device: str) -> str:
    """The kind of `device` ("cuda" of "cuda:1"); ConfigError for a device no backend serves."""
    try:
        return parse_device(device)[0]
    except BackendError as exc:
        raise ConfigError(str(exc)) from None


def device_capabilities(device: str) -> Capabilities:
    """What the backend serving `device` declares (default dtypes, kernels, graphs: backends.for_device), without
    opening the device; ConfigError for a device no backend serves."""
    try:
        return for_device(device).capabilities
    except BackendError as exc:
        raise ConfigError(str(exc)) from None


def default_threads() -> int:
    """All usable cores but one: the HTTP side and the predictor need a core, and torch's OpenMP threads
    slow down sharply when they compete for cores (measured on 2 cores: 1 torch thread served 3,023 tokens
    in 35 s, 2 threads in 39 s; offline, without HTTP, 2 threads took 25 s)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "smollm2"  # "smollm2", a HF folder, a .gguf file or a hub name
    device: str = "cpu"
    # several devices, one pool each (kv_budget per device), one set of bucket bounds; requests are placed by
    # memory pressure and compute load (odma.kv.placement). Empty: just `device`. On CPU, "cpu:0,cpu:1" are two
    # pools over the same cores and weights: a test bed for placement, not a speed-up.
    devices: tuple[str, ...] = ()
    # run several devices' model steps concurrently (one thread each); None = on for accelerators, off for
    # CPU pools, which share the same cores
    parallel_devices: bool | None = None
    dtype: str = "float32"  # float32 | bfloat16 | float16: weights and activations
    # auto | f32 | bf16 | native: native serves a GGUF's quantized blocks as they are (odma/models/gguf.py; fp32
    # activations); auto picks it for a quantized GGUF on a CPU with the kernel when dtype is float32, else dense
    # weights of `dtype`; f32 and bf16 are dense weights of that dtype (dtype must agree)
    weights: str = "auto"
    # KV cache dtype; None = float16 on CPU (storage only: the CPU kernels widen its rows and attend in fp32; half
    # the bytes of fp32, so twice the tokens in a budget and half the DRAM a decode step streams, llama.cpp's default
    # KV type; float32 keeps every bit), the weights' dtype elsewhere
    kv_dtype: str | None = None
    policy: str = "odma"  # odma | static | s3 | paged (compared on the same KV budget)
    # attention kernel: auto (CPU: the C decode kernel + SDPA for prefills; accelerators: the Triton kernels over the
    # arena when Triton imports), triton (every request through the Triton kernels; on CPU only under
    # TRITON_INTERPRET=1, for tests) or sdpa (torch's SDPA per request, the reference)
    attention: str = "auto"
    # how a block grows past its reservation: "copy" (migrate to a larger block: allocate, copy, swap, free), "map"
    # (each block is address space for its worst case and memory is mapped behind it as it grows: never copied;
    # needs the backend's virtual memory, CUDA's driver API or a Linux host's mmap; elsewhere copy, with a warning),
    # or "auto": map where the backend can and a layer's K grows by no more than pool.align tokens at a time (the
    # device's granule wastes nothing then: 4 KiB host pages), else copy (2 MiB GPU granules hold up to 2,048 tokens
    # of a 7B model's layer beyond what a block uses). Measured on a 2-core Xeon serving SmolLM2: map served NQ bursts
    # at 1.07-1.26x copy's throughput where memory binds (64 MiB), 1.10x at 160 MiB, even at 1 GiB (docs/BENCHMARKS.md)
    kv_growth: str = "auto"
    # decode steps (every request feeding one token) through the Triton attention as batches captured once per batch
    # size and replayed (odma/engine/decode_graphs.py): "auto" (CUDA graphs on CUDA, off elsewhere), "capture",
    # "static" (the same fixed batches run eagerly: what a failed capture falls back to), "off"
    decode_graphs: str = "auto"
    # bytes ("268435456", "256MiB", "2GB") or a share of device memory ("0.3", "30%"). 1 GiB: about what
    # transformers' batch of 48 holds for the same chat workload; on CPU a larger batch now pays (decode
    # attention is a kernel, the GEMMs get more efficient with rows), 256 MiB left the batch at ~18.
    kv_budget: str = "1GiB"
    # decode batch cap. 128 (vLLM-CPU's default too): on a burst of 144 NQ chats it halves TTFT p50 against 64 at
    # the same throughput, for a higher ITL (docs/BENCHMARKS.md, "Serving defaults, measured")
    max_num_seqs: int = 128
    # the order of service (odma.engine.ordering): "fcfs", or "sjf" (shortest predicted remaining output first,
    # with aging: a request that has waited sjf_aging_rounds admission rounds longer than the newest waiting one
    # goes before every younger one)
    schedule: str = "fcfs"
    sjf_aging_rounds: int = 256
    # prompt tokens a step prefills beside its decodes: with chunked_prefill a longer prompt is fed over several
    # steps, so the running streams keep getting tokens while it is prefilled (off: a prompt is fed whole, and one
    # longer than this passes alone, freezing every stream for its whole prefill). A chunk costs its tokens plus
    # their attention over the cached context (odma.engine.prefill_cost). 256, measured on one core
    # (docs/BENCHMARKS.md, "Serving defaults, measured"): a stream's longest gap while a 4,000- and an 8,000-token
    # prompt arrive 0.5 s (whole prompts: 34 s), TTFT p50 at 16 streams 0.75 s (2.7-2.9 s), the same throughput on
    # NQ-144 and guidellm within the runs' spread, for an ITL of 55-62 ms instead of 44-49
    max_prefill_tokens: int = 256
    chunked_prefill: bool = True
    max_tokens_cap: int = 2048  # the largest max_tokens a request may ask; the large bucket's bound
    max_model_len: int | None = None  # prompt + output limit; None = the model's max_position_embeddings
    default_max_tokens: int = 256
    # under memory pressure: "wait" (stall until a block can grow), "recompute" (free the newest block and
    # redo it later) or "swap" (free it, keeping its K/V in a host buffer): swap won on CPU, recompute
    # thrashed (a re-prefill costs as much as decoding), wait stalls (docs/serving.md, docs/BENCHMARKS.md)
    preempt: str = "swap"
    # eLLM Algorithm 1: admit a new request only while reservations stay within θ of the pool (1.0: off)
    admission_theta: float = 1.0
    # admit a new request only while the predicted final KV of the running requests (prompt + L̂ each, within
    # max_tokens) plus its own stays within this share of the pool; None = off (the pool's reservations and
    # max_num_seqs alone decide)
    admission_demand: float | None = None
    swap_space: str = "1GiB"  # host buffer for --preempt swap (bytes, like --kv-budget)
    # SLOs that scale the swap buffer's logical size (eLLM Algorithm 2): TPOT violations shrink it (fetches
    # slow decoding), TTFT violations grow it (swapping lets new requests in sooner); None = fixed size
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    predictor: str | None = "default"  # predictor spec; falls back to a running median if it cannot load
    # where requests are tagged with their predicted length: "loop" (inside the engine step that admits them),
    # "ahead" (on a worker thread from the moment they arrive, overlapping the model's steps), or "auto": ahead
    # behind a server (odma-serve, a Ray replica) on a backend whose steps run off the host (an accelerator), in the
    # loop on a CPU (the predictor would take the steps' cores) and for the offline engine API (deterministic steps)
    tagging: str = "auto"
    tag_batch: int = 32  # tagging ahead: requests one predictor call tags at most
    tag_timeout_s: float = 5.0  # tagging ahead: a request whose tag is this late goes on untagged
    # the served model's own length probe (predictor/probe): "probe" (the shipped one for SmolLM2), a probe
    # folder, or None. It reads the hidden states the engine computes, after each prefill and every few decode
    # steps; the `predictor` above still tags requests on arrival (their block is reserved before the prefill)
    probe: str | None = None
    probe_online: bool = True  # the probe's head learns from finished requests (state kept under the cache dir)
    s3_buckets: int = 8  # equal-width buckets of the s3 baseline
    length_log: Path | None = field(default_factory=lambda: default_cache_dir() / "logs" / "lengths.jsonl")
    # what the log keeps of each prompt: "text" (retraining the text predictor reads it), "hash" (its SHA-256), "none"
    length_log_prompts: str = "text"
    length_log_max_size: str = "64MiB"  # the log rotates at this size ("0": never)
    length_log_backups: int = 3  # rotated files kept (lengths.jsonl.1 ...)
    bootstrap_from_log: bool = True  # seed the bucket bounds with the log's last realized lengths
    threads: int = field(default_factory=default_threads)  # torch CPU threads
    # KV ↔ activation ballooning (eLLM): the room kept for the activation peak of a max_prefill_tokens step
    # is lent to the KV pool in segments while requests wait for KV memory, and taken back before a prefill
    balloon: bool = False
    balloon_segment_tokens: int = 512  # KV tokens per lent segment
    balloon_keep_tokens: int = 512  # the activation room of a prefill this long is never lent
    # with ballooning, a prompt whose activation room is lent is prefilled in chunks of the room that is free
    # (False: it waits until the lent segments can be taken back, their blocks migrating out)
    balloon_chunked_prefill: bool = True
    # a request that holds the queue without a contiguous range gets one: the range with the fewest live tokens
    # is fenced and its blocks relocated elsewhere (into lent segments, say) instead of waited for
    clear_window: bool = True
    # a prompt that begins with at least this many tokens a running request has cached copies their K/V instead
    # of computing them (odma.engine.prefix_share; the chat template's system prompt, a conversation's history;
    # the paged baseline maps their whole pages); 0: off
    prefix_share_min_tokens: int = 16
    # such a prefix read where the running request keeps it instead of copied (odma.kv.shared_rows): the block holds
    # only the rows after it, and a request that ends while others read its rows keeps them (its block shrunk) until
    # they end. Contiguous blocks grown by copy; the Triton attention reads the pieces (the captured decode batches
    # through tables of GRAPH_PIECES entries), on a CPU the C decode kernel does (prefill chunks: the model's own path)
    prefix_reads: bool = False
    # odma's blocks kept packed under memory pressure (docs/results/gpu/replay_policy.md): growth by compaction that
    # slides blocks over the gaps between them when no range can be cleared otherwise, growth over the gaps beside a
    # block, growth by pool.growth_step tokens, admission within PACKED_THETA of the pool; a block that still finds
    # no room waits for one (a packed pool is full then: a finishing request frees it) instead of swapping a
    # request out. On, it sets those fields of `pool`, caps admission_theta and turns preempt "swap" into "wait"
    # (resolved_pool, resolved_admission_theta, resolved_preempt). None: on where the backend's block copies are
    # cheap against a swap (accelerators), off where they are the same memcpy (a CPU pool); only odma packs
    packing: bool | None = None
    pool: PoolConfig = field(default_factory=PoolConfig)
    buckets: BucketConfig = field(default_factory=BucketConfig)

    @property
    def device_list(self) -> tuple[str, ...]:
        return self.devices or (self.device,)

    @property
    def capabilities(self) -> Capabilities:
        """What the backend of these devices declares (one device kind per engine, checked below)."""
        return device_capabilities(self.device_list[0])

    @property
    def parallel_devices_resolved(self) -> bool:
        return self.parallel_devices if self.parallel_devices is not None else self.capabilities.parallel_pools

    @property
    def resolved_kv_dtype(self) -> str:
        return self.kv_dtype or self.capabilities.default_kv_dtype or self.dtype

    @property
    def packing_resolved(self) -> bool:
        """Whether odma's blocks are kept packed (`packing`, or by default where block copies are cheap)."""
        if self.policy != "odma":
            return False
        return self.packing if self.packing is not None else self.capabilities.cheap_block_copies

    @property
    def reads_pieces(self) -> bool:
        """Whether a request may read its rows from several contiguous blocks (shared prefixes read in place, blocks
        continued elsewhere): the attention then reads tables of pieces. Never for static blocks (they do not grow and
        read nothing elsewhere) or the paged pool (its pages are its table)."""
        return self.policy not in ("static", "paged") and (self.prefix_reads or self.pool.continue_growth)

    @property
    def resolved_pool(self) -> PoolConfig:
        """The pool settings in force: `pool`, with packing's growth when it is on."""
        if not self.packing_resolved:
            return self.pool
        return replace(self.pool, compact_growth=True, slide_growth=True, neighbour_growth=True, growth="step")

    @property
    def served_tagging(self) -> str:
        """Where a server tags requests: `tagging`, "auto" resolved to "ahead" on a backend whose steps run off the
        host (Capabilities.steps_off_host) and to "loop" on one whose steps take the host's cores."""
        if self.tagging != "auto":
            return self.tagging
        return "ahead" if self.capabilities.steps_off_host else "loop"

    @property
    def resolved_admission_theta(self) -> float:
        """θ in force: `admission_theta`, at most PACKED_THETA while packing (room for the running to grow into)."""
        return min(self.admission_theta, PACKED_THETA) if self.packing_resolved else self.admission_theta

    @property
    def resolved_preempt(self) -> str:
        """Preemption in force: `preempt`, but "wait" for "swap" while packing (a growth fails there only when the
        pool is full, and a swap-out then only makes room for admissions that fill it again: the GPU replay
        preempted 12 of 200 ShareGPT requests swapping, none waiting, at equal or better throughput)."""
        return "wait" if self.packing_resolved and self.preempt == "swap" else self.preempt

    def scheduler_config(self, model: ModelConfig) -> SchedulerConfig:
        """The scheduler's policy these settings ask for, for serving `model` (its shape prices a prefill chunk's
        attention). The paged baseline recomputes preempted requests (vLLM's default: its pages are not swapped),
        clears no windows (it has none) and maps shared prompt prefixes' whole pages instead of copying them (vLLM's
        prefix caching)."""
        paged = self.policy == "paged"
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_prefill_tokens=self.max_prefill_tokens,
            prefill_cost=PrefillCost.for_model(model),
            preempt="recompute" if paged and self.preempt == "swap" else self.resolved_preempt,
            order=self.schedule,
            aging_rounds=self.sjf_aging_rounds,
            # ballooning without balloon_chunked_prefill feeds prompts whole (they wait for their lent room back)
            chunk_prefills=self.chunked_prefill and (not self.balloon or self.balloon_chunked_prefill),
            clear_window=self.clear_window and not paged,
            prefix_min_tokens=self.prefix_share_min_tokens,
            admission_theta=self.resolved_admission_theta,
            admission_demand=self.admission_demand,
        )

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.attention not in ATTENTION_KINDS:
            raise ConfigError(f"attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")
        if self.policy == "paged" and self.attention == "sdpa":
            raise ConfigError("policy 'paged' reads KV through page tables, which only the Triton attention does")
        if self.decode_graphs not in DECODE_GRAPHS:
            raise ConfigError(f"decode_graphs must be one of {DECODE_GRAPHS}, got {self.decode_graphs!r}")
        if self.kv_growth not in KV_GROWTH:
            raise ConfigError(f"kv_growth must be one of {KV_GROWTH}, got {self.kv_growth!r}")
        if self.kv_growth == "map" and (self.balloon or self.policy == "paged"):
            raise ConfigError("kv_growth 'map' grows contiguous blocks: not with ballooning or policy 'paged'")
        if self.policy == "paged" and self.balloon:
            raise ConfigError("ballooning lends contiguous segments; it is not available with policy 'paged'")
        if len(set(self.devices)) != len(self.devices):
            raise ConfigError(f"devices must be distinct, got {list(self.devices)} (two CPU pools: cpu:0,cpu:1)")
        if len({device_kind(d) for d in self.device_list}) > 1:
            raise ConfigError(f"devices must be of one kind (one dtype, one set of kernels), got {list(self.devices)}")
        for name in ("dtype", "kv_dtype"):
            value = getattr(self, name)
            if value is not None and value not in ("float32", "bfloat16", "float16"):
                raise ConfigError(f"{name} must be float32, bfloat16 or float16, got {value!r}")
        if self.weights not in WEIGHTS:
            raise ConfigError(f"weights must be one of {WEIGHTS}, got {self.weights!r}")
        needs = {"native": "float32", **WEIGHT_DTYPES}.get(self.weights)
        if needs and self.dtype != needs:
            raise ConfigError(f"weights {self.weights!r} compute in {needs}, not dtype {self.dtype!r}")
        if self.schedule not in ORDERS:
            raise ConfigError(f"schedule must be one of {ORDERS}, got {self.schedule!r}")
        for name in ("max_num_seqs", "sjf_aging_rounds", "max_prefill_tokens", "max_tokens_cap", "default_max_tokens", "threads", "s3_buckets",
                     "balloon_segment_tokens", "balloon_keep_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tagging not in TAGGING:
            raise ConfigError(f"tagging must be one of {TAGGING}, got {self.tagging!r}")
        if self.tag_batch < 1:
            raise ConfigError(f"tag_batch must be >= 1, got {self.tag_batch}")
        if not self.tag_timeout_s > 0:
            raise ConfigError(f"tag_timeout_s must be a positive number of seconds, got {self.tag_timeout_s!r}")
        if self.prefix_share_min_tokens < 0:
            raise ConfigError(f"prefix_share_min_tokens must be >= 0 (0: off), got {self.prefix_share_min_tokens}")
        if self.prefix_reads and not self.prefix_share_min_tokens:
            raise ConfigError("prefix_reads reads shared prefixes in place: it needs prefix_share_min_tokens > 0")
        if self.prefix_reads and self.kv_growth == "map":
            raise ConfigError("prefix_reads needs blocks grown by copy (kv_growth copy or auto), not by mapping")
        if self.pool.continue_growth and self.kv_growth == "map":
            raise ConfigError("pool.continue_growth continues blocks that cannot grow by copy: it needs kv_growth "
                              "copy or auto, not map")
        if self.default_max_tokens > self.max_tokens_cap:
            raise ConfigError("default_max_tokens must not exceed max_tokens_cap")
        try:
            admission_rules(self.admission_theta, self.admission_demand)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        for name in ("slo_ttft_s", "slo_tpot_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {v!r}")
        if self.length_log_prompts not in LOG_PROMPT_MODES:
            raise ConfigError(f"length_log_prompts must be one of {LOG_PROMPT_MODES}, got {self.length_log_prompts!r}")
        if self.length_log_backups < 0:
            raise ConfigError(f"length_log_backups must be >= 0, got {self.length_log_backups}")
        parse_bytes(self.length_log_max_size, "length log size", allow_zero=True)
        if self.preempt not in ("wait", "recompute", "swap"):
            raise ConfigError(f"preempt must be 'wait', 'recompute' or 'swap', got {self.preempt!r}")


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 10**6, "mb": 10**6, "mib": 1 << 20,
          "g": 10**9, "gb": 10**9, "gib": 1 << 30}


def parse_kv_budget(spec: str | int, device_bytes: int) -> int:
    """Bytes from "268435456", "256MiB", "2GB", or a share of `device_bytes` ("0.3" or "30%")."""
    s = str(spec).strip().lower().replace("_", "")
    try:
        if s.endswith("%"):
            return _share(float(s[:-1]) / 100, device_bytes, spec)
        if 0 < float(s) < 1:
            return _share(float(s), device_bytes, spec)
    except ValueError:
        pass  # not a bare number: a size with its unit
    return parse_bytes(spec, "kv budget", shares=True)


def parse_bytes(spec: str | int, what: str, *, allow_zero: bool = False, shares: bool = False) -> int:
    """Bytes from "268435456", "256MiB", "2GB" (0 only where `allow_zero`); `shares`: the error mentions them."""
    s = str(spec).strip().lower().replace("_", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    try:
        if unit not in _UNITS:
            raise ValueError(unit)
        out = int(float(num) * _UNITS[unit])
    except (ValueError, OverflowError):
        hint = " or a share (0.3, 30%)" if shares else ""
        raise ConfigError(f"{what} {spec!r}: use bytes (e.g. 268435456, 256MiB, 2GB){hint}") from None
    if out < 0 or (out == 0 and not allow_zero):
        raise ConfigError(f"{what} must be {'>= 0' if allow_zero else 'positive'}, got {spec!r}")
    return out


def _share(share: float, device_bytes: int, spec) -> int:
    if not 0 < share < 1:
        raise ConfigError(f"kv budget share must be in (0, 1), got {spec!r}")
    return int(share * device_bytes)
