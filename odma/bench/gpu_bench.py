"""`odma-bench gpu`: the accelerator path measured in one run, one JSON out (scripts/gpu_check.sh runs it on a GPU).

- kernels: one layer's decode attention (K/V write, split-K attention, reduction) over contiguous blocks and over
  16-token pages scattered through the same arena: the same Triton code, reading in place or through a table. At
  each context × batch: microseconds, GB/s of K/V read against the device's measured copy bandwidth (bytes read +
  written by one large copy, STREAM's convention), the error of each against torch's SDPA over the same K/V, and
  that old device path's time (SDPA once per request) where it is cheap enough to time. The shape is the paper
  model's attention (28 query heads, 4 KV heads, head_dim 128).
- runs: odma's vLLM backend on an accelerator (backends/triton_runs.py): decode attention over vLLM's per-head
  planes (LHBNC) with each request's blocks one run of consecutive ids, read as one range, and the same K/V on
  scattered blocks of 16 tokens read through the block table (the same kernel: the layout's effect alone); beside
  them torch's own SDPA over the same K/V held dense per request (batched: a dense kernel's time for the same
  reads), GB/s against the copy bandwidth and errors against SDPA. Times are one layer's call (what each of vLLM's
  layers makes); plan_us is the step's one look at which requests are runs.
- vmm: what growth by mapping saves. One growth step of a block (a step of every one of its 2 x layers planes mapped
  behind it, the 7B shape's geometry: 56 granules) against the copy that moves the whole block into a larger one,
  which is what growth costs without virtual memory; blocks of 1 GiB and 4 GiB.
- step: a decode step of the 7B shape at batch 16 (1K-token contexts), with its batch captured as a CUDA graph and
  eagerly: host time (issuing the launches) and device time (between the first and last launch) per step, so a
  host-bound step shows as one.
- engine: odma's engine with random weights of the paper model's shape (DeepSeek-R1-Distill-Qwen-7B: 28 layers,
  28/4 heads, head_dim 128, bf16) on a natural-length trace, every policy on the same KV budget: all requests
  arrive at once with max_tokens = the cap (static reserves prompt + cap, as a worst-case server does) and each is
  ended at its trace length (tokens are forced: ignore_eos; random weights mean nothing). Host and device time per
  step for each policy. A trace with text (ShareGPT, Alpaca, NQ, a JSONL trace) sends each prompt as SmolLM2's chat
  template makes it, and its text to the length predictor each policy names (`odma:default`, the trained encoder;
  `odma:median`; `odma:oracle`, the exact lengths), whose accuracy on the burst is reported beside the throughput;
  several traces run on one model (`--engine-run TRACE=POLICIES`, repeated). The burst is `gpu_work.BurstWork`.
- peer: Hugging Face transformers' continuous batching on the same burst, model shape and KV bytes (gpu_peer.py
  says its settings and why): tok/s, output tokens against the forced sum, first-token times.
- http: odma-serve against the engine alone on one burst (odma/bench/gpu_http.py): the engine in process and the
  server in its own process, each with at most 64 requests running, the server driven by 64 streaming clients:
  tokens/s, TTFT, requests ok/failed, output tokens of each, and http / engine tokens/s.

Nothing is lost to one failure or to time: every part, every policy and every measurement is tried on its own, the
JSON (--out) is rewritten after each measurement, and each part stops starting new measurements at its time cap
(--caps; the defaults sum to under 8.5 minutes on an H100), saying what it skipped.

`--tiny` shrinks every shape so the whole command runs on a CPU in Triton's interpreter (CI runs it so that it
cannot rot); its timings are the interpreter's and mean nothing.

Here: the arguments, the step and engine parts, and the run; the kernels, runs and vmm parts are gpu_kernels.py,
http and peer gpu_http.py and gpu_peer.py, and what every part shares (the saved result, caps, timing) gpu_report.py.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

from odma.bench import gpu_http
from odma.bench.gpu_kernels import bench_kernels, bench_runs, bench_vmm
from odma.bench.gpu_peer import bench_peer
from odma.bench.gpu_report import Cap, Report, attempt, backend_of
from odma.bench.gpu_work import burst_caps

PARTS = ("kernels", "runs", "vmm", "step", "engine", "http", "peer")
# seconds: 9.6 minutes in all (gpu_check runs engine, http and peer in about 6.5)
DEFAULT_CAPS = {"kernels": 80, "runs": 40, "vmm": 30, "step": 60, "engine": 220, "http": 75, "peer": 75}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from odma.analyze.gpu_burst import ODMA_MEMORY

    p.add_argument("--device", default="cuda", help="cuda[:N] (cpu: only with --tiny, in Triton's interpreter)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes: a dry run of every part (on CPU: interpreted)")
    p.add_argument("--parts", default=",".join(PARTS), help="which parts to run, comma-separated")
    p.add_argument("--caps", default=",".join(f"{k}={v}" for k, v in DEFAULT_CAPS.items()),
                   help="seconds each part may start measurements for (PART=SECONDS, comma-separated)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--contexts", default=None, help="decode contexts (default 1024,4096,16384; tiny: 64,256)")
    p.add_argument("--batches", default=None, help="decode batch sizes (default 1,16,64; tiny: 1,4)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per measurement (median reported)")
    p.add_argument("--trace", default="azure-conv", help="natural lengths for the engine part (odma.traces)")
    p.add_argument("--requests", type=int, default=None, help="requests in the engine burst (default 400; tiny: 8)")
    p.add_argument("--peer-requests", type=int, default=None,
                   help="requests in the peer's burst (default: those of the first engine run; tiny: 8)")
    p.add_argument("--max-tokens", type=int, default=1024, help="every request's max_tokens (trace lengths are cut)")
    p.add_argument("--max-prompt", type=int, default=4096, help="longer prompts are cut to this")
    p.add_argument("--kv-budget", default=None, help="KV budget of every policy (default 4GiB; tiny: 48KiB)")
    p.add_argument("--policies", default="static,odma,paged,odma-map",
                   help="engine policies on the same KV budget; NAME-map: that policy growing by mapping "
                        "(--kv-growth map); NAME:PREDICTOR: that policy with that length predictor (default: "
                        "the running median)")
    p.add_argument("--engine-run", action="append", default=None, metavar="TRACE[:REQUESTS]=POLICIES",
                   help="a burst of TRACE (its first REQUESTS records, default --requests) under each POLICY (comma-"
                        "separated, each optionally POLICY:PREDICTOR: odma:default, odma:median, odma:oracle, "
                        "odma:FOLDER, then @ORDER: odma:default@sjf serves shortest predicted first, then *SHARE: "
                        "odma:default*0.25 reserves a quarter of each prediction); repeat it to "
                        "run several traces on one model (results keyed by trace). "
                        "Without it: --trace under --policies")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--tagging", default="ahead", choices=["ahead", "loop"],
                   help="engine part: where requests get their predicted length: ahead (the tagging worker, in "
                        "batches, while the engine steps the requests already tagged, as odma-serve does) or loop "
                        "(inside the engine step) (default: %(default)s)")
    p.add_argument("--odma-memory", default=ODMA_MEMORY[0], choices=ODMA_MEMORY,
                   help="how odma's contiguous blocks meet a full pool: compact (a block that cannot grow for "
                        "fragmentation gets a range by relocating blocks, else the newest request is swapped out), "
                        "swap (the engine's default; the runs before this flag), wait (the request stalls instead), "
                        "compact-wait (both) (default: %(default)s)")
    gpu_http.add_arguments(p)
    p.add_argument("--tests-log", default=None, help="a pytest log whose summary line goes into the JSON (gpu_check)")
    p.add_argument("--out", default=None, help="also write the JSON here, rewritten after each measurement (a run "
                                               "cut short keeps what it measured)")


def _caps(spec: str) -> dict[str, float]:
    from odma.errors import ConfigError

    caps: dict[str, float] = dict(DEFAULT_CAPS)
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, seconds = item.partition("=")
        try:
            if name not in PARTS:
                raise ValueError(name)
            caps[name] = float(seconds)
        except ValueError:
            raise ConfigError(f"--caps takes PART=SECONDS for parts {', '.join(PARTS)}, got {item!r}") from None
    return caps


# -- the model, the step, the engine ----------------------------------------------------------------------------


_MODELS: dict = {}


def _model(args, device, dtype_name: str):
    """The random model of the paper's shape (tiny: TINY_QWEN2), made once and shared by the step and engine parts."""
    from odma.models import DTYPES
    from odma.models.tiny import PAPER_7B, TINY_QWEN2, random_model

    key = (args.tiny, str(device), dtype_name)
    if key not in _MODELS:
        t0 = time.perf_counter()
        _MODELS[key] = random_model(TINY_QWEN2 if args.tiny else PAPER_7B, DTYPES[dtype_name], str(device))
        _MODELS[key].made_seconds = round(time.perf_counter() - t0, 1)
    return _MODELS[key]


def _engine(args, device, dtype_name: str, model, loaded=None, **overrides):
    from odma.config import PoolConfig
    from odma.engine.config import EngineConfig
    from odma.engine.llm_engine import LLMEngine

    max_prompt, max_tokens = burst_caps(args.max_prompt, args.max_tokens, args.tiny)
    base = dict(
        model="paper-7b" if not args.tiny else "tiny-qwen2", device=str(device), dtype=dtype_name,
        kv_budget=args.kv_budget or ("48KiB" if args.tiny else "4GiB"), policy="odma", kv_growth="copy",
        attention="triton", length_log=None, predictor="median",  # what is measured (auto on a CPU: its C kernel)
        max_tokens_cap=max_tokens, default_max_tokens=max_tokens, max_num_seqs=args.max_num_seqs,
        max_prefill_tokens=max(8192, max_prompt), max_model_len=max_prompt + max_tokens,
        pool=PoolConfig(align=4 if args.tiny else 16), threads=1 if args.tiny else 4)
    return LLMEngine(EngineConfig(**(base | overrides)), model=model, predictor=loaded)


def _odma_memory(args, continue_growth: bool = False) -> dict:
    """EngineConfig fields of odma's policy for --odma-memory (the replay of this part sets the same)."""
    from odma.analyze.gpu_burst import odma_memory

    return odma_memory(getattr(args, "odma_memory", "swap"), align=4 if args.tiny else 16,
                       continue_growth=continue_growth)


def _step_times(times: list) -> dict:
    """Medians of the runner's StepTime records: host and device milliseconds, and how many steps were host-bound."""
    if not times:
        return {}
    host = [t.host_ms for t in times]
    device = [t.device_ms for t in times if t.device_ms is not None]
    out = {"steps_timed": len(times), "host_ms_p50": round(statistics.median(host), 3),
           "graph_steps": sum(t.graph for t in times)}
    if device:
        out["device_ms_p50"] = round(statistics.median(device), 3)
        out["host_bound_steps"] = sum(1 for t in times if t.device_ms is not None and t.host_ms >= t.device_ms)
    return out


def bench_step(args, device, dtype_name: str, report: Report, cap: Cap) -> dict:
    """Decode steps of a batch of 16 requests with 1K-token contexts (tiny: 4 requests, 24 tokens), the batch
    captured as a graph and eager; per mode the step's wall time and the runner's host and device time."""
    from odma.engine import SamplingParams

    batch, context = (4, 24) if args.tiny else (16, 1024)
    out: dict = {"batch": batch, "context": context, "modes": {}, "skipped": []}
    report.result["step"] = out
    model = _model(args, device, dtype_name)
    rng = random.Random(1)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(context)] for _ in range(batch)]
    steps = 4 if args.tiny else 30
    for mode in ("capture", "off"):
        if cap.left() <= 0:
            out["skipped"].append({"mode": mode, "why": "time cap"})
            report.save()
            continue

        def measure(mode=mode) -> dict:
            engine = _engine(args, device, dtype_name, model, decode_graphs=mode, max_num_seqs=batch,
                             kv_budget="1MiB" if args.tiny else "4GiB", max_tokens_cap=steps + 8,
                             max_model_len=context + steps + 8)
            runner = engine.workers[0].runner
            params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
            seqs = [engine.add_request(p, params) for p in prompts]
            for _ in range(100 * batch):  # prefills, then a decode step that captures the batch
                if all(s.num_generated >= 2 for s in seqs) or not engine.has_work():
                    break
                engine.step()
            if not all(s.num_generated >= 2 for s in seqs):
                raise RuntimeError(f"the batch of {batch} never ran together")
            runner.time_steps = True
            walls, times = [], []
            for _ in range(steps):
                t0 = time.perf_counter()
                engine.step()
                walls.append((time.perf_counter() - t0) * 1e3)
                times.append(runner.last_step)
            runner.time_steps = False
            graphs = runner.graphs
            result = {"step_ms_p50": round(statistics.median(walls), 3), **_step_times(times),
                      "graphs": None if graphs is None else {"mode": graphs.mode, "captured": graphs.captured,
                                                              "capture_failures": graphs.capture_failures}}
            if "device_ms_p50" in result:
                result["host_share_of_step"] = round(result["host_ms_p50"] / result["step_ms_p50"], 3)
            while engine.has_work():
                engine.step()
            return result

        attempt(out["modes"], mode, measure, report)
    return out


def engine_burst(engine, prompts, lengths, params, deadline: float, texts=None, tags=None) -> dict:
    """All requests at once (each with its prompt's text for the length predictor, and its tags, where given); each
    is ended at its trace length; past `deadline` (perf_counter) the rest are aborted and the burst is reported as
    cut. The clock starts as the requests arrive, so it holds their length predictions: made inside the steps
    (tagging "loop") or by the tagging worker while the engine steps those already tagged ("ahead"). Returns what
    the burst did, with the accuracy of the lengths the engine predicted, the host seconds spent predicting
    (`tagging_s`) and the time from the burst's start to each request's first token (TTFT)."""
    before = _counts(engine)
    predicting = engine.tagger.predict_seconds
    runner = engine.workers[0].runner
    runner.time_steps = True
    texts = texts or [None] * len(prompts)
    tags = tags or [None] * len(prompts)
    t0, arrived = time.perf_counter(), time.monotonic()  # Sequence stamps its first token on the monotonic clock
    seqs = [engine.add_request(p, params, prompt_text=t, tags=g) for p, t, g in zip(prompts, texts, tags)]
    target = {s.request_id: n for s, n in zip(seqs, lengths)}
    stopped: set[str] = set()
    running, times = [], []
    cut = False
    while engine.has_work():
        if time.perf_counter() > deadline:
            cut = True
            for s in seqs:
                if not s.finished:
                    engine.abort(s.request_id, "abort")
            break
        stepped = engine.steps
        if not engine.step() and engine.steps == stepped:
            continue  # nothing ran nor ended: the engine only waited for the tagging worker
        running.append(engine.num_running)
        if runner.last_step is not None:
            times.append(runner.last_step)
        for s in seqs:
            if s.request_id not in stopped and not s.finished and s.num_generated >= target[s.request_id]:
                engine.abort(s.request_id, "stop")
                stopped.add(s.request_id)
    engine.backend.synchronize()
    seconds = time.perf_counter() - t0
    runner.time_steps = False
    after = _counts(engine)
    generated = sum(min(s.num_generated, target[s.request_id]) for s in seqs)
    ttfts = [s.first_token_at - arrived for s in seqs if s.first_token_at is not None]
    ahead = engine.tagger.ahead
    return {
        "seconds": round(seconds, 2), "output_tokens": generated, "tokens_per_s": round(generated / seconds, 1),
        "requests": len(seqs), "completed": sum(1 for s in seqs if s.num_generated >= target[s.request_id]),
        "cut_at_cap": cut,
        "errors": sum(1 for s in seqs if s.finish_reason == "error"),
        "short": sum(1 for s in seqs if s.num_generated < target[s.request_id]),
        "peak_running": max(running, default=0), "mean_running": round(statistics.mean(running), 1) if running else 0,
        "steps": len(running), **_step_times(times), **{k: after[k] - before[k] for k in after},
        "prediction": _accuracy(seqs, lengths, params.max_tokens),
        "tagging": "ahead" if ahead is not None else "loop",
        "tagging_s": round(engine.tagger.predict_seconds - predicting, 6),
        "tag_timeouts": ahead.timeouts if ahead is not None else 0,
        "ttft_p50_s": _seconds(gpu_http.percentile(ttfts, 0.5)),
        "ttft_p99_s": _seconds(gpu_http.percentile(ttfts, 0.99)),
    }


def _seconds(x: float | None) -> float | None:
    return round(x, 4) if x is not None else None


def _counts(engine) -> dict:
    c = engine.scheduler.counters
    stats = engine.pool.stats()
    kv = engine.workers[0].kv
    return {"preemptions": c.preemptions, "migrations": stats.migrations, "migrated_tokens": stats.migrated_tokens,
            "grown_in_place": stats.grown_in_place, "swap_outs": c.swap_outs,
            # packing's moves: blocks relocated or slid out of a growth's way, and the tokens that moved twice
            "relocated_tokens": stats.relocated_tokens, "overlapped_tokens": stats.overlapped_tokens,
            "slides": getattr(kv, "slides", 0),  # only odma's contiguous KV slides blocks
            "continued": getattr(kv, "continued", 0),  # and continues them elsewhere (--continue-growth)
            # shared prompt prefixes: copied into a contiguous block, or mapped as whole pages (paged)
            "prefix_copies": c.prefix_copies, "prefix_maps": c.prefix_maps, "prefix_tokens": c.prefix_tokens}


@dataclass(frozen=True)
class PolicyRun:
    """One engine policy of a run: `odma`, `paged`, `static`, NAME-map (growing by mapping), `odma-reads` (shared
    prompt prefixes read in place, `--prefix-reads`), `odma-continue` (a block that cannot grow goes on in a new one,
    `--continue-growth`), `odma-pieces` (both), each optionally with the length predictor it runs
    (`odma:default`, `odma:median`, `odma:oracle`, `odma:PATH`, as `predictor.registry` takes specs); none named is
    the running median, as the engine part always ran. A suffix `@ORDER` serves it in that order
    (`odma:default@sjf`: shortest predicted first; default fcfs); a last `*SHARE` makes an odma policy reserve that
    share of each prediction at admission (`PoolConfig.reserve_scale`, default 0.5; `odma-pieces:default@sjf*0.25`,
    the learned encoder's best in the replay on first turns)."""

    label: str  # as given: the key of its results
    policy: str
    mapped: bool
    predictor: str
    schedule: str = "fcfs"
    reads: bool = False
    continues: bool = False
    reserve_scale: float | None = None  # None: the pool's default

    @classmethod
    def parse(cls, label: str) -> "PolicyRun":
        from odma.engine.ordering import ORDERS
        from odma.errors import ConfigError

        spec, star, share = label.rpartition("*") if "*" in label else (label, "", "")
        reserve_scale = None
        if star:
            try:
                reserve_scale = float(share)
            except ValueError:
                reserve_scale = math.nan
            if not 0 < reserve_scale < math.inf:
                raise ConfigError(f"engine policy {label!r}: the share after * is a positive number, got {share!r}")
        spec, at, schedule = spec.rpartition("@") if "@" in spec else (spec, "", "fcfs")
        if at and schedule not in ORDERS:
            raise ConfigError(f"engine policy {label!r}: the order after @ is one of {', '.join(ORDERS)}")
        name, _, predictor = spec.partition(":")
        reads, continues = name in ("odma-reads", "odma-pieces"), name in ("odma-continue", "odma-pieces")
        pieces = reads or continues
        policy, mapped = (name[:-4], True) if name.endswith("-map") else ("odma" if pieces else name, False)
        if policy not in ENGINE_POLICIES:
            raise ConfigError(f"engine policy {label!r}: the policy is one of {', '.join(ENGINE_POLICIES)} (NAME-map "
                              "grows by mapping; odma-reads reads shared prefixes in place, odma-continue continues "
                              "blocks elsewhere, odma-pieces both), optionally followed by :PREDICTOR, @ORDER and *SHARE")
        if reserve_scale is not None and policy != "odma":
            raise ConfigError(f"engine policy {label!r}: only odma's policies reserve a share of a prediction")
        return cls(label, policy, mapped, predictor or "median", schedule, reads, continues, reserve_scale)


@dataclass(frozen=True)
class EngineRun:
    """One trace's burst and the policies that run it (`--engine-run TRACE[:REQUESTS]=POLICY,POLICY,...`)."""

    trace: str
    requests: int | None  # None: --requests (default 400; tiny: 8)
    policies: tuple[PolicyRun, ...]

    @classmethod
    def parse(cls, spec: str) -> "EngineRun":
        from odma.errors import ConfigError

        trace, sep, policies = spec.partition("=")
        names = [p.strip() for p in policies.split(",") if p.strip()]
        if not sep or not trace.strip() or not names:
            raise ConfigError(f"--engine-run takes TRACE[:REQUESTS]=POLICY,POLICY,..., got {spec!r}")
        trace, requests = trace.strip(), None
        head, colon, tail = trace.rpartition(":")
        if colon and tail.isdigit():  # a trace name may hold ':' itself (alpaca-eval:GENERATOR)
            trace, requests = head, int(tail)
            if requests < 1:
                raise ConfigError(f"--engine-run {spec!r}: REQUESTS must be >= 1")
        return cls(trace, requests, tuple(PolicyRun.parse(n) for n in names))


ENGINE_POLICIES = ("static", "odma", "paged")


def engine_runs(args) -> list[EngineRun]:
    """The runs of --engine-run, else the one run of --trace and --policies."""
    specs = args.engine_run or [f"{args.trace}={args.policies}"]
    return [EngineRun.parse(s) for s in specs]


def _predictions(spec: str, work) -> tuple[Any, list]:
    """(the LoadedPredictor the engine runs, each request's RequestTags or None). An oracle reads each request's
    realized length, which the engine's request never carries (a served request has none): its predictions are
    made here by `predictor.oracle` over the burst's forced lengths and handed to the engine as predictions made
    upstream (RequestTags.prediction), the way a cluster's router hands its own."""
    from odma.engine.length_predictor import LoadedPredictor, load_engine_predictor
    from odma.engine.sequence import RequestTags
    from predictor.registry import load_predictor

    predictor = load_predictor(spec) if spec == "oracle" or spec.startswith("noisy-oracle") else None
    if predictor is None:
        return load_engine_predictor(spec), [None] * work.requests
    from types import SimpleNamespace

    asked = [SimpleNamespace(request_id=f"burst-{i}", output_tokens=n) for i, n in enumerate(work.lengths)]
    tags = [RequestTags(prediction=(p.length, p.uncertainty)) for p in predictor.predict(asked)]
    return LoadedPredictor(predictor, f"{predictor.name} (upstream)", None), tags


def _accuracy(seqs, lengths, max_tokens: int) -> dict:
    """How well the predictions the engine tagged the burst with matched the forced lengths: median and mean
    absolute error (tokens; a prediction counts at most max_tokens, as the forced lengths are cut there and no
    request reserves more), the share predicted short (an under-prediction makes a block grow), and how many
    requests were left untagged (an unusable prediction: they reserved the worst case)."""
    pairs = [(min(s.predicted_length, max_tokens), n) for s, n in zip(seqs, lengths) if s.predicted_length is not None]
    out: dict = {"tagged": len(pairs), "untagged": len(lengths) - len(pairs)}
    if pairs:
        errors = [abs(p - n) for p, n in pairs]
        out |= {"median_abs_error": round(statistics.median(errors), 1),
                "mean_abs_error": round(statistics.mean(errors), 1),
                "under_share": round(sum(1 for p, n in pairs if p < n) / len(pairs), 3),
                "mean_predicted": round(statistics.mean(p for p, _ in pairs), 1)}
    return out


def _work(args, run: EngineRun, vocab_size: int):
    from odma.bench.gpu_work import burst_from_trace

    n = run.requests or args.requests or 400
    n = min(n, 8) if args.tiny else n  # a dry run: the same runs, 8 requests each
    max_prompt, max_tokens = burst_caps(args.max_prompt, args.max_tokens, args.tiny)
    return burst_from_trace(run.trace, n, max_prompt=max_prompt, max_tokens=max_tokens,
                            kv_budget=args.kv_budget or ("48KiB" if args.tiny else "4GiB"), vocab_size=vocab_size)


def peer_work(args, vocab_size: int):
    """The burst a peer runs: the engine's first run's (its trace and requests; --peer-requests cuts it), so the
    peer's figures compare with that run's policies on the same work."""
    run = engine_runs(args)[0]
    if args.peer_requests:
        run = EngineRun(run.trace, args.peer_requests, run.policies)
    return _work(args, run, vocab_size)


def bench_engine(args, device, dtype_name: str, report: Report, cap: Cap) -> dict:
    """Every --engine-run on the same model: its trace's burst under each of its policies. The part's time is
    shared by the bursts still to run in proportion to their forced output tokens (a long trace gets more)."""
    model = _model(args, device, dtype_name)
    runs = engine_runs(args)
    out: dict = {"model": "paper-7b" if not args.tiny else "tiny-qwen2", "dtype": dtype_name,
                 "model_seconds": getattr(model, "made_seconds", None), "runs": {}, "skipped": []}
    report.result["engine"] = out
    works: dict[str, Any] = {}
    for run in runs:
        key = run.trace if run.trace not in out["runs"] else f"{run.trace}#{len(out['runs']) + 1}"
        entry: dict = {"trace": run.trace, "policies": {}, "skipped": []}
        out["runs"][key] = entry
        attempt(entry, "work", lambda run=run, key=key: _describe(works.setdefault(key, _work(
            args, run, model.config.vocab_size))), report)
    todo = [(key, p) for key, run in zip(list(out["runs"]), runs) for p in run.policies if key in works]
    attempt(out, "kernels_warmed_s", lambda: _warm_kernels(args, device, dtype_name, model,
                                                            {p.policy == "paged" for _, p in todo}), report)
    for i, (key, policy) in enumerate(todo):
        entry, work = out["runs"][key], works[key]
        weight = work.output_tokens / sum(works[k].output_tokens for k, _ in todo[i:])
        share = cap.left() * weight
        if share <= 0:
            entry["skipped"].append({"policy": policy.label, "why": "time cap"})
            report.save()
            continue
        attempt(entry["policies"], policy.label,
                 lambda policy=policy, work=work, share=share: _measure_policy(args, device, dtype_name, model, work,
                                                                               policy, time.perf_counter() + share),
                 report)
    for entry in out["runs"].values():
        entry.update(_ratios(entry["policies"]))
    report.save()
    return out


WARM_BATCH = 128  # decodes at once in the kernels' warm-up: past where a step splits no context (264 programs / 4 KV heads)


def _warm_kernels(args, device, dtype_name: str, model, paged: set[bool]) -> float:
    """Compile before any clock starts the kernel variants a burst reaches and each policy's own warm-up (six
    requests) does not: decode steps of more requests than the device's programs split contexts for (one split
    each, the kernel without its reduction), on contiguous blocks and on pages as the policies to come need. A
    throwaway engine per layout runs them: Triton keeps what it compiled for the process, and the measured engines'
    buckets and predictors see nothing of it (the replay's warm-up is unchanged). Seconds it took."""
    from odma.engine import SamplingParams
    from odma.engine.length_predictor import LoadedPredictor
    from predictor.running_median import RunningMedian

    started = time.perf_counter()
    for pages in sorted(paged):
        engine = _engine(args, device, dtype_name, model, policy="paged" if pages else "odma", tagging="loop",
                         loaded=LoadedPredictor(RunningMedian(), RunningMedian.name, None))
        n = min(engine.config.max_num_seqs, 8 if args.tiny else WARM_BATCH)
        engine.generate([p[: engine.max_model_len - 4] for p in warm_prompts(n)],  # the tiny model's 32 tokens
                        SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        del engine
        backend_of(str(device)).empty_cache()
    return round(time.perf_counter() - started, 2)


def warm_prompts(n: int) -> list[list[int]]:
    """n prompts that reach what a burst's prompts do: lengths off and on the 16-token grid, one to several pages
    (page tables of several widths), and a shared 48-token prefix (prefills that start after a copied or mapped
    prefix)."""
    prefix = [7 + i % 89 for i in range(48)]
    return [prefix + [1 + i] * (1 + 13 * (i % 7)) if i % 2 else [1 + i % 97] * (8 + 24 * (i % 5)) for i in range(n)]


def _describe(work) -> dict:
    return {"requests": work.requests, "texts": sum(t is not None for t in work.texts),
            "prompt_tokens": work.prompt_tokens, "forced_output_tokens": work.output_tokens,
            "max_tokens": work.max_tokens, "kv_budget": work.kv_budget}


def _measure_policy(args, device, dtype_name: str, model, work, policy: PolicyRun, deadline: float) -> dict:
    """One policy's burst of `work`, ended at `deadline` (perf_counter) whatever it has done by then."""
    from odma.config import PoolConfig
    from odma.engine import SamplingParams
    from odma.engine.length_predictor import LoadedPredictor
    from predictor.running_median import RunningMedian

    memory = _odma_memory(args, continue_growth=policy.continues) if policy.policy == "odma" else {}
    if policy.reserve_scale is not None:
        memory["pool"] = replace(memory.get("pool", PoolConfig(align=4 if args.tiny else 16)),
                                 reserve_scale=policy.reserve_scale)
    # warm-ups run under a throwaway median: the measured predictor (a running median learns) sees only the burst
    engine = _engine(args, device, dtype_name, model, policy=policy.policy,
                     kv_growth="map" if policy.mapped else "copy", tagging=args.tagging, schedule=policy.schedule,
                     prefix_reads=policy.reads,
                     loaded=LoadedPredictor(RunningMedian(), RunningMedian.name, None), **memory)
    prompts = [list(p) for p in work.prompts]
    max_prompt, _ = burst_caps(args.max_prompt, args.max_tokens, args.tiny)
    # compile every kernel variant before the clock starts: short contexts (one split), longer ones (several)
    warm = [p[:8] for p in prompts[:4]] + [(p * 64)[: min(max_prompt, 512)] for p in prompts[:2]]
    engine.generate(warm, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.predictor, tags = _predictions(policy.predictor, work)
    params = SamplingParams(max_tokens=work.max_tokens, temperature=0, ignore_eos=True)
    from backends.triton_attention import compiled_variants

    compiled = compiled_variants()
    result = engine_burst(engine, prompts, work.lengths, params, deadline, texts=work.texts, tags=tags)
    # kernel variants the burst compiled (each is compile time inside a step): none, once the warm-ups cover it
    after = compiled_variants()
    result["compiled_in_burst"] = {k: n - compiled.get(k, 0) for k, n in after.items() if n > compiled.get(k, 0)}
    result["kv_tokens"] = engine.pool.stats().total_tokens
    # how many requests of the burst fit at once if each held its worst case (what static reserves)
    result["worst_case_fit"] = result["kv_tokens"] // (min(map(len, prompts)) + work.max_tokens)
    result["predictor"] = engine.predictor.name
    result["predictor_fallback"] = engine.predictor.fallback_reason
    result["schedule"] = engine.config.schedule
    result["prefix_reads"] = engine.config.prefix_reads
    result["continue_growth"] = engine.config.pool.continue_growth
    result["reserve_scale"] = engine.config.resolved_pool.reserve_scale
    result["preempt"] = engine.config.resolved_preempt
    result["compact_growth"] = engine.config.resolved_pool.compact_growth
    result["packing"] = engine.config.packing_resolved
    result["admission_theta"] = engine.config.resolved_admission_theta
    if policy.policy == "odma":
        result["odma_memory"] = args.odma_memory  # the preset, which `odma-analyze fit-gpu` replays the run with
    result["growth"] = "map" if type(engine.workers[0].kv).__name__ == "MappedKV" else "copy"
    del engine
    backend_of(str(device)).empty_cache()
    return result


def _ratios(policies: dict) -> dict:
    """tok/s of every odma variant over paged and over static (`odma_vs_paged`, `odma:default_vs_static`,
    `odma-reads:median_vs_paged`, ...), and odma-map over odma; only between bursts that ran to the end."""
    tps = {p: r["tokens_per_s"] for p, r in policies.items() if "tokens_per_s" in r and not r["cut_at_cap"]}
    out = {}
    for a in tps:
        if re.split("[:@*]", a)[0] in ("odma", "odma-reads", "odma-continue", "odma-pieces"):
            for b in ("paged", "static"):
                if b in tps:
                    out[f"{a}_vs_{b}"] = round(tps[a] / tps[b], 3)
    if "odma-map" in tps and "odma" in tps:
        out["map_vs_copy"] = round(tps["odma-map"] / tps["odma"], 3)
    return out


# -- the run ----------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict:
    import torch

    from backends import BackendError, triton_attention
    from odma.errors import ConfigError
    from odma.models import DTYPES

    try:
        backend = backend_of(args.device)
    except BackendError as exc:
        raise ConfigError(f"odma-bench gpu: {exc}") from None
    device = backend.device  # "cuda" opens cuda:0
    # a device whose own attention is not Triton's (the CPU's C kernel) runs the Triton kernels only in the
    # interpreter: a dry run, on tiny shapes, in float32
    compiled = backend.capabilities.attention == "triton"
    if not compiled and not args.tiny:
        raise ConfigError(f"odma-bench gpu on {device} runs only with --tiny (a dry run in Triton's interpreter)")
    why = triton_attention.available(device)
    if why is not None:
        raise ConfigError(f"odma-bench gpu: {why}")
    dtype_name = args.dtype if compiled else "float32"
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if set(parts) - set(PARTS):
        raise ConfigError(f"--parts takes {', '.join(PARTS)}, got {args.parts!r}")
    caps = _caps(args.caps)
    if "engine" in parts:
        engine_runs(args)  # a bad --engine-run fails here, before anything runs
    result: dict = {"device": backend.describe(), "torch": torch.__version__, "tiny": args.tiny,
                    "interpreted": triton_attention.interpreting(), "caps_s": {p: caps[p] for p in parts}}
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        pass
    report = Report(result, args.out)
    if args.tests_log:
        result["tests"] = _tests_summary(args.tests_log)
    report.save()
    started = time.perf_counter()
    bench = {"kernels": lambda cap: bench_kernels(args, device, DTYPES[dtype_name], report, cap),
             "runs": lambda cap: bench_runs(args, device, DTYPES[dtype_name], report, cap),
             "vmm": lambda cap: bench_vmm(args, device, DTYPES[dtype_name], report, cap),
             "step": lambda cap: bench_step(args, device, dtype_name, report, cap),
             "engine": lambda cap: bench_engine(args, device, dtype_name, report, cap),
             "http": lambda cap: gpu_http.bench_http(args, device, dtype_name, report, cap),
             "peer": lambda cap: bench_peer(args, device, dtype_name, report, cap,
                                            lambda vocab: peer_work(args, vocab))}
    for name in PARTS:
        if name in parts:
            attempt(result, name, lambda name=name: bench[name](Cap(caps[name])), report)
            result["seconds"] = round(time.perf_counter() - started, 1)
            report.save()
    return result


def _tests_summary(path: str) -> dict:
    """The last pytest summary line of a log ("12 passed, 1 skipped in 40.1s"), or why there is none."""
    try:
        with open(path, errors="replace") as f:
            lines = [line.strip().strip("=").strip() for line in f if " in " in line and (
                "passed" in line or "failed" in line or "error" in line or "skipped" in line)]
    except OSError as exc:
        return {"error": str(exc)}
    return {"summary": lines[-1]} if lines else {"error": f"no pytest summary in {path}"}


def main(argv: list[str] | None = None) -> int:
    """`python -m odma.bench.gpu_bench`: the same as `odma-bench gpu`, without importing the other benchmarks (a
    GPU machine may lack their dependencies)."""
    parser = argparse.ArgumentParser(prog="odma-bench gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    add_arguments(parser)
    args = parser.parse_args(argv)
    json.dump(run(args), sys.stdout, indent=None if args.json else 2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
