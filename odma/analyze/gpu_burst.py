"""The GPU benchmark's engine burst (`odma-bench gpu`, part "engine") replayed without a model.

What `odma.bench.gpu_bench.bench_engine` does on a GPU, step for step, with the engine's own pieces: the
reservation policy (`build_policy`), the pool or the pages (`KVPool` / `PagedKV`, built as `build_worker`
builds them), the `Scheduler` with the engine's settings, the running-median `LengthTagger`, the warm-up
requests that seed it, and the engine's order within a step (aborted requests finish before the next
schedule; bucket bounds refresh after each step). Prompts are the bench's random token ids (seeded the same),
so prefix sharing finds what it found there. The swap buffer is modelled (`ModelledSwap`: HostSwap's rule,
no bytes). Every step is recorded (`StepRecord`) for a step-time model (`odma.analyze.gpu_profile`).

The counts it gives (steps, preemptions, swap-outs, migrations, migrated tokens, mean running) are checked
against the raw GPU runs in tests/test_gpu_replay.py: they are a property of the scheduling, not of the device.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace

from odma.analyze.profiles import QWEN7B_CONFIG, ModelShape
from odma.errors import ConfigError
from odma.kv import OffloadConfig, OffloadController
from odma.trace_records import burst_prompt_ids, forced_lengths

GIB = 1 << 30
PAGE_TOKENS = 16  # odma.engine.config.PAGE_TOKENS: the paged baseline's page
BASE_POLICIES = ("static", "odma", "paged", "oracle")  # oracle: contiguous blocks of exactly the true length


# odma's memory under pressure in the bench's engine part (--odma-memory), the first the default
# (docs/results/gpu/replay_policy.md): "packed" (the engine's default on accelerators, EngineConfig.packing: compaction
# that slides blocks over the gaps when no window can be cleared, growth over the gaps beside a block and by 64 tokens,
# admission within θ 0.97 of the pool, and a block that finds no room waits: no preemption in the replays);
# "packed-swap" (the same, but swapping the newest request out where a block finds no room: the first packed GPU
# runs, 0 of 400 Azure and 12 of 200 ShareGPT requests preempted); "headroom" (compaction, a block that cannot grow waits, admission within θ 0.9:
# no preemption, 1.04-1.07x at 4 GiB); "compact" (compaction, else the newest request is swapped out: 735-811
# preemptions at 4 GiB); "swap", the engine's CPU default, what the first raw runs did; "wait" stalls the request
# instead of swapping; "compact-wait" both (waiting holds admissions back while the pool stays full)
ODMA_MEMORY = ("packed", "packed-swap", "headroom", "compact", "swap", "wait", "compact-wait")
HEADROOM_THETA = 0.9  # reservations at most this share of the pool (eLLM's θ); 0.85-0.93 replayed within 2 %


def odma_memory(name: str, align: int = 16, continue_growth: bool = False) -> dict:
    """EngineConfig fields that `name` (one of ODMA_MEMORY) sets for odma's policy; the bench and this replay both
    read them here. Every preset says whether it packs (the engine packs by default on an accelerator), and
    "packed" spells out the pool fields, θ and the waiting that packing sets, so a run's config records them;
    "packed-swap" sets the same fields without `packing` (which would turn its swap into a wait). `continue_growth`:
    blocks that cannot grow go on in new ones too (`PoolConfig.continue_growth`, the bench's odma-continue)."""
    from odma.config import PoolConfig
    from odma.engine.config import PACKED_THETA

    if name not in ODMA_MEMORY:
        raise ConfigError(f"odma memory must be one of {ODMA_MEMORY}, got {name!r}")
    pool = PoolConfig(align=align)
    out: dict = {"packing": name == "packed"}
    if name in ("packed", "packed-swap"):
        out["admission_theta"] = PACKED_THETA
        pool = replace(pool, compact_growth=True, slide_growth=True, neighbour_growth=True, growth="step")
    if name in ("packed", "compact-wait", "wait", "headroom"):
        out["preempt"] = "wait"
    if name == "headroom":
        out["admission_theta"] = HEADROOM_THETA
    if name in ("compact-wait", "compact", "headroom"):
        pool = replace(pool, compact_growth=True)
    if continue_growth:
        pool = replace(pool, continue_growth=True)
    if pool != PoolConfig():
        out["pool"] = pool
    return out


@dataclass(frozen=True, slots=True)
class BurstConfig:
    """The bench's burst: `requests` of `trace` at once, each forced to its trace length (cut at max_tokens),
    every policy on the same KV budget. Defaults are `odma-bench gpu`'s."""

    trace: str = "azure-conv"
    requests: int = 400
    max_tokens: int = 1024
    max_prompt: int = 4096
    kv_budget_bytes: int = 4 * GIB
    max_num_seqs: int = 256
    swap_space_bytes: int = 1 * GIB
    vocab_size: int = 152064  # the paper model's (its prompts are random ids below it)
    # prompts of each record's recorded prompt length (random ids) even where the trace has text: the cost of the
    # prompts without their contents (no shared prefixes between a conversation's turns; the bench sends the texts)
    recorded_lengths: bool = False
    model: ModelShape = field(default_factory=lambda: ModelShape.from_hf_config(QWEN7B_CONFIG, "paper-7b"))

    @property
    def max_prefill_tokens(self) -> int:
        return max(8192, self.max_prompt)  # the bench's engine

    @property
    def kv_tokens(self) -> int:
        return self.kv_budget_bytes // self.model.kv_bytes_per_token


def study_config(spec: str, gib: float) -> BurstConfig:
    """The burst a replay study names: NAME[:REQUESTS][:bench] at `gib` GiB of KV. By default prompts have each
    record's recorded length (random ids: a conversation's history counted); `bench`: the prompts odma-bench gpu
    sends (a text trace's texts, tokenized, as the GPU runs had them). REQUESTS defaults to 400."""
    name, *rest = spec.split(":")
    requests = int(rest[0]) if rest and rest[0] else 400
    bench = len(rest) > 1 and rest[1] == "bench"
    return BurstConfig(trace=name, requests=requests, kv_budget_bytes=int(gib * GIB), recorded_lengths=not bench)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one engine step did, as a step-time model needs it."""

    decodes: int  # requests that fed one token
    context: int  # Σ tokens those requests attend over (their cached tokens)
    prefill: tuple[tuple[int, int], ...]  # (cached before, fed) of each prefill or recompute chunk
    copied_tokens: int  # tokens growth (and relocation) copied while the step was planned (through a temporary: twice)
    swap_tokens: int  # tokens swapped out or in while the step was planned
    swaps: int  # swap copies (each one a synchronised transfer)
    running: int  # requests running after the step (what the bench averages)
    slides: int = 0  # growths that found room only by sliding blocks over the gaps (`ContiguousKV.slides`)
    # of `context`, the tokens of requests that read their rows from several blocks (pieces: prefixes read in place,
    # blocks continued elsewhere); the profiles charge them as contiguous reads, a study may bound them otherwise
    piece_context: int = 0


@dataclass(slots=True)
class BurstResult:
    policy: str
    paged: bool
    steps: list[StepRecord]
    output_tokens: int
    counts: dict

    def summary(self) -> dict:
        running = [s.running for s in self.steps]
        return {"policy": self.policy, "steps": len(self.steps), "output_tokens": self.output_tokens,
                "mean_running": round(statistics.mean(running), 1) if running else 0.0,
                "peak_running": max(running, default=0), **self.counts}


class CopyCounter:
    """The pool's mover in the replay: the tokens `backends.base.copy_kv` would copy for each move, without the
    bytes. A move to a range apart from the old one copies once; a move that overlaps its old place (growth in place,
    whose layout changes with the capacity; growth over the gaps beside a block; a slide) goes through temporaries
    (a clone, then the copy): its tokens cross memory twice."""

    def __init__(self) -> None:
        self.tokens = 0  # tokens read and written, a temporary's twice

    def copy(self, src, dst, n_tokens: int) -> None:
        if not n_tokens or (src.offset, src.capacity) == (dst.offset, dst.capacity):
            return
        overlaps = src.offset < dst.end and dst.offset < src.end
        self.tokens += 2 * n_tokens if overlaps else n_tokens


class ModelledSwap:
    """HostSwap's rule without the bytes: a swap-out succeeds while the buffer has room for the request's cached
    tokens (else it is recomputed); the tokens moved each way are counted for the step model."""

    def __init__(self, capacity_bytes: int, bytes_per_token: int) -> None:
        self.controller = OffloadController(OffloadConfig(capacity_bytes=capacity_bytes))
        self.bytes_per_token = bytes_per_token
        self.moved_tokens = 0
        self.copies = 0

    def swap_out(self, seq) -> bool:
        nbytes = seq.num_cached * self.bytes_per_token
        if seq.block is None or nbytes > self.controller.free_bytes or seq.kv.pieces:
            return False
        self.controller.record_offload(seq.request_id, nbytes)
        self.moved_tokens += seq.num_cached
        self.copies += 1
        return True

    def swap_in(self, seq) -> None:
        self.controller.record_fetch(seq.request_id)
        self.moved_tokens += seq.num_cached
        self.copies += 1

    def drop(self, seq) -> None:
        self.controller.discard(seq.request_id)


def bench_records(config: BurstConfig) -> list:
    """The trace records of the bench's burst (their texts and conversation tags are what a learned length
    predictor reads; the bench itself sends random ids)."""
    from odma.traces import load_trace

    records = load_trace(config.trace, limit=config.requests).records[:config.requests]
    if len(records) < config.requests:
        raise ConfigError(f"trace {config.trace} has {len(records)} requests, fewer than {config.requests}")
    return records


def bench_prompts(config: BurstConfig) -> tuple[list[list[int]], list[int]]:
    """The bench's prompts and forced output lengths, as its builder (`odma.bench.gpu_work.burst_from_records`, a
    layer above this one; tests/test_gpu_replay.py holds the two equal) makes them: a trace without text gets
    random ids of its recorded prompt lengths (seeded as the bench seeds them), a trace with text its prompts in
    SmolLM2's chat template after their conversations' earlier turns, tokenized (so prefix sharing finds what it found on the GPU); ids folded into the
    vocabulary, prompts cut to max_prompt. With `recorded_lengths`, every trace gets random ids of its recorded
    prompt lengths (a conversation's history included)."""
    records = bench_records(config)
    tokenizer = None
    if any(r.prompt for r in records) and not config.recorded_lengths:
        from odma.tokenizer import load_tokenizer

        tokenizer = load_tokenizer("smollm2")
    prompts = burst_prompt_ids(records, tokenizer, max_prompt=config.max_prompt, vocab_size=config.vocab_size)
    return [list(p) for p in prompts], forced_lengths(records, config.max_tokens)


class _NoMetrics:
    def on_predict(self, seconds: float, n: int) -> None: ...


class BurstEngine:
    """The engine's loop around one device's scheduler, without a model: the order of `LLMEngine.step`."""

    def __init__(self, config: BurstConfig, policy: str, *, engine_overrides: dict | None = None,
                 scheduler_options: dict | None = None, oracle: bool = False, predictor: str | None = None,
                 wrap_kv=None) -> None:
        from odma.engine.config import EngineConfig
        from odma.engine.length_predictor import LoadedPredictor
        from odma.engine.prefill_cost import PrefillCost
        from odma.engine.scheduler import Scheduler
        from odma.engine.scheduler_config import SchedulerConfig
        from predictor.running_median import RunningMedian
        from odma.engine.tagging import LengthTagger
        from odma.kv import ContiguousKV, ExactPolicy, KVPool, PagedKV, build_policy

        if policy not in BASE_POLICIES:
            raise ConfigError(f"policy must be one of {BASE_POLICIES}, got {policy!r}")
        # the engine's defaults (pool, buckets, preemption, window clearing, prefixes), with what a study changes; on the
        # GPU the engine's device is an accelerator, whose default packing the replay (made for a CPU) sets explicitly
        engine = EngineConfig(**(engine_overrides or {}))
        settings = engine.resolved_pool
        # bucket bounds refresh by completions only: the engine's 30-second timer would make the replay depend on
        # the host's speed (the raw runs' counts agree on the H100 and the H200, so it did not fire differently)
        buckets = replace(engine.buckets, refresh_every_s=float("inf"))
        self.config = config
        self.paged = policy == "paged"
        self.oracle = oracle or policy == "oracle"
        if policy == "oracle":
            self.policy = ExactPolicy(growth="double")
        else:
            self.policy = build_policy("odma" if self.paged else policy, max_tokens=config.max_tokens,
                                       buckets=buckets, pool=settings)
        bytes_per_token = config.model.kv_bytes_per_token
        total = config.kv_tokens
        options = dict(scheduler_options or {})
        # the engine's policy at the bench's batch cap and prefill budget (its model's shape prices a chunk)
        common = SchedulerConfig(max_num_seqs=config.max_num_seqs, max_prefill_tokens=config.max_prefill_tokens,
                                 prefill_cost=PrefillCost.for_model(config.model), order=engine.schedule,
                                 aging_rounds=engine.sjf_aging_rounds, chunk_prefills=engine.chunked_prefill,
                                 admission_theta=engine.resolved_admission_theta,
                                 admission_demand=engine.admission_demand,
                                 # shared prompt prefixes: copied into a block, or their whole pages mapped
                                 prefix_min_tokens=engine.prefix_share_min_tokens)
        self.swap = None
        self.copies: CopyCounter | None = None  # the paged pool copies nothing
        if self.paged:
            pages = total // PAGE_TOKENS
            self.kv = PagedKV(pages * PAGE_TOKENS, page_tokens=PAGE_TOKENS, bytes_per_token=bytes_per_token)
            preempt = "recompute" if engine.preempt == "swap" else engine.preempt
            self.scheduler = Scheduler(self.kv, replace(common, preempt=options.pop("preempt", preempt), **options))
        else:
            large_share = 0.0 if policy == "static" else settings.large_share
            pool = KVPool(total, self.policy, large_share=large_share, align=settings.align,
                          bytes_per_token=bytes_per_token, worst_case_prompt_share=settings.worst_case_prompt_share,
                          neighbour_growth=settings.neighbour_growth)
            self.copies = pool.mover = CopyCounter()
            self.kv = ContiguousKV(pool, compact_growth=settings.compact_growth,
                                   read_prefixes=engine.prefix_reads and policy != "static",
                                   continue_growth=settings.continue_growth and policy != "static",
                                   slide_growth=settings.compact_growth and settings.slide_growth)
            preempt = options.pop("preempt", engine.resolved_preempt)
            if preempt == "swap":
                self.swap = ModelledSwap(config.swap_space_bytes, bytes_per_token)
            self.scheduler = Scheduler(self.kv, replace(common, preempt=preempt, clear_window=engine.clear_window,
                                                        **options),
                                       self.swap)
        if wrap_kv is not None:  # a study's layer over the KV manager (scripts/studies/prefix_reference.py)
            self.kv = self.scheduler.kv = wrap_kv(self.kv, self.scheduler)
            self.scheduler.maps_prefixes = getattr(self.kv, "shares_pages", False)
        # the bench's engine tags with the running median (static too: its L̂ only orders); a study may name another
        loaded = LoadedPredictor(RunningMedian(), RunningMedian.name, None)
        if predictor is not None:
            from odma.engine.length_predictor import load_engine_predictor

            loaded = load_engine_predictor(predictor)
            if loaded.fallback_reason is not None:
                raise ConfigError(f"length predictor {predictor!r} did not load: {loaded.fallback_reason}")
        self.tagger = LengthTagger(loaded, self.policy, "paper-7b", _NoMetrics())
        self._ids = 0
        self.piece_context = 0  # the last step's decode context read through pieces (StepRecord.piece_context)
        self._inbox: list = []
        self._aborts: list = []
        self._known: dict[str, int] = {}

    # -- the engine's surface ---------------------------------------------------------------------

    def add(self, prompt: list[int], max_tokens: int, known_length: int | None = None, record=None):
        """A request of `prompt` ids; `record` (a TraceRecord) lends it its text and conversation tags."""
        from odma.engine.sampling import SamplingParams
        from odma.engine.sequence import RequestTags, Sequence

        seq = Sequence(f"req-{self._ids}", list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                        ignore_eos=True))
        if record is not None:
            seq.prompt_text = record.prompt
            seq.tags = RequestTags(depth=record.depth, system_prompt_id=record.system_prompt_id,
                                   prior_output_tokens=record.prior_output_tokens,
                                   last_output_tokens=record.last_output_tokens)
        self._ids += 1
        if known_length is not None:
            self._known[seq.request_id] = known_length  # the oracle's L̂
        self._inbox.append(seq)
        return seq

    def has_work(self) -> bool:
        return bool(self._inbox or self._aborts) or self.scheduler.has_work()

    def step(self) -> list:
        """One engine step: aborts and new requests first, then the schedule, the model's tokens, finishes and
        the bucket refresh. Returns the planned work."""
        from odma.engine.sequence import Status

        for seq in self._aborts:
            if seq.status is not Status.FINISHED:
                self._finish(seq, "stop")
        self._aborts = []
        if self._inbox:
            self.tagger.tag(self._inbox)
            if self.oracle:
                select = getattr(self.policy, "select", None)
                for seq in self._inbox:
                    known = self._known.get(seq.request_id)
                    if known is not None:
                        seq.predicted_length = seq.predicted_tokens = float(known)
                        seq.uncertainty = 0.0
                        seq.bucket = select(known, 0.0).index if select else None
            for seq in self._inbox:
                self.scheduler.add(seq)
            self._inbox = []
        work = self.scheduler.schedule()
        self.piece_context = sum(w.start for w in work if w.q_len == 1 and w.seq.kv is not None and w.seq.kv.pieces)
        for w in work:
            seq = w.seq
            seq.num_cached = w.start + w.q_len
            if seq.num_cached < seq.num_tokens:
                continue  # a chunk of a longer prefill: no token yet
            seq.output_ids.append(0)
            if seq.num_generated >= seq.params.max_tokens:
                self._finish(seq, "length")
        buckets = getattr(self.policy, "buckets", None)
        if buckets is not None and buckets.refresh_due():
            buckets.refresh()
        return work

    def abort(self, seq) -> None:
        self._aborts.append(seq)

    def _finish(self, seq, reason: str) -> None:
        self.scheduler.finish(seq, reason, observe=True)
        self.tagger.learn(seq)

    @property
    def copied_tokens(self) -> int:
        """Tokens growth and relocations copied so far (the paged pool copies none); a move that overlaps its old
        place (a slide, a growth in place or into the gaps beside a block) passes through a temporary and counts
        twice."""
        return self.copies.tokens if self.copies is not None else 0


def run_burst(config: BurstConfig, policy: str, *, engine_overrides: dict | None = None,
              scheduler_options: dict | None = None, oracle: bool = False,
              prompts: tuple[list[list[int]], list[int]] | None = None, predictor: str | None = None,
              wrap_kv=None) -> BurstResult:
    """The bench's warm-up, then the burst through `policy` ("static", "odma", "paged" or "oracle"), every step
    recorded.
    `engine_overrides`: EngineConfig fields that differ from the engine's defaults (a policy study's knobs);
    `oracle`: every request is tagged with its true length (a contiguous upper bound); `predictor`: a length
    predictor spec ("default": the learned one) that tags the burst's requests from their trace texts and tags
    instead of the bench's running median; `wrap_kv`: a function of the KV manager and the scheduler that returns a layer over the manager (a
    study's model of another memory design)."""
    prompts, lengths = prompts or bench_prompts(config)
    records = bench_records(config) if predictor is not None else [None] * len(prompts)
    engine = BurstEngine(config, policy, engine_overrides=engine_overrides, scheduler_options=scheduler_options,
                         oracle=oracle, predictor=predictor, wrap_kv=wrap_kv)
    # the bench's warm-up: short and 512-token prompts of 4 tokens each (they seed the running median and the
    # bucket window, as on the GPU)
    warm = [p[:8] for p in prompts[:4]] + [(p * 64)[:min(config.max_prompt, 512)] for p in prompts[:2]]
    seqs = [engine.add(p, 4) for p in warm]
    while any(not s.finished for s in seqs):
        engine.step()
    before = _counts(engine)
    seqs = [engine.add(p, config.max_tokens, n, r) for p, n, r in zip(prompts, lengths, records)]
    target = {s.request_id: n for s, n in zip(seqs, lengths)}
    stopped: set[str] = set()
    steps: list[StepRecord] = []
    copied, slides, swapped, swaps = engine.copied_tokens, _slides(engine), *_swap(engine)
    limit = 50 * sum(lengths) + 10_000
    while engine.has_work():
        work = engine.step()
        moved, copies = _swap(engine)
        decode = [w for w in work if w.q_len == 1]
        steps.append(StepRecord(len(decode), sum(w.start for w in decode),
                                tuple((w.start, w.q_len) for w in work if w.q_len > 1),
                                engine.copied_tokens - copied, moved - swapped, copies - swaps,
                                len(engine.scheduler.running), _slides(engine) - slides, engine.piece_context))
        copied, slides, swapped, swaps = engine.copied_tokens, _slides(engine), moved, copies
        for s in seqs:
            if s.request_id not in stopped and not s.finished and s.num_generated >= target[s.request_id]:
                engine.abort(s)
                stopped.add(s.request_id)
        if len(steps) > limit:
            raise RuntimeError(f"{policy}: the burst did not end within {limit} steps")
    after = _counts(engine)
    return BurstResult(policy, engine.paged, steps, sum(lengths), {k: after[k] - before[k] for k in after})


def _slides(engine: BurstEngine) -> int:
    return getattr(engine.kv, "slides", 0)


def _swap(engine: BurstEngine) -> tuple[int, int]:
    return (engine.swap.moved_tokens, engine.swap.copies) if engine.swap is not None else (0, 0)


def _counts(engine: BurstEngine) -> dict:
    c = engine.scheduler.counters
    stats = engine.kv.stats()
    return {"preemptions": c.preemptions, "swap_outs": c.swap_outs, "migrations": stats.migrations,
            "migrated_tokens": stats.migrated_tokens, "grown_in_place": stats.grown_in_place,
            "relocated_tokens": stats.relocated_tokens, "compactions": getattr(engine.kv, "compactions", 0),
            "slides": getattr(engine.kv, "slides", 0), "continued": getattr(engine.kv, "continued", 0),
            "overlapped_tokens": getattr(stats, "overlapped_tokens", 0),
            "prefix_copies": c.prefix_copies, "prefix_maps": c.prefix_maps, "prefix_tokens": c.prefix_tokens}
