"""`odma-bench gpu`'s http part: what serving over HTTP costs against the engine alone, on the same burst.

One `BurstWork` (`burst_work`) runs twice with at most CONCURRENCY requests at a time, both on the same
settings: odma-serve's flags (`server_flags`) build the in-process engine (`odma.server.cli.config_from_args`)
and start the server, so the two cannot drift apart.

1. in process: the engine (the random model of the paper's shape made on the device, SmolLM2's tokenizer:
   `--model random:paper-7b`; tiny: random:tiny-qwen2), fed CONCURRENCY requests at a time;
2. over HTTP: odma-serve in its own process on the same device, started and waited for (a time limit), the same
   requests as streamed completions of their token ids (max_tokens = the forced length, ignore_eos, greedy), by
   CONCURRENCY clients of the soak's async client (`odma.bench.soak_load.send`); then stopped (SIGTERM to its
   process group, a wait, SIGKILL), whatever happened.

Reported for each: tokens/s, TTFT p50/p99 (from a request's submission to its first token; over HTTP its first
streamed text), requests ok (every forced token, nothing else) and failed, output tokens; then whether both made
the burst's every token, and http ÷ engine tokens/s. Both runs share the part's time cap: the engine's burst gets
half of what is left after the server's start is set aside, the HTTP burst what is left then; a run stopped by
the cap says so (`cut_at_cap`) and no ratio is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from odma.bench.gpu_work import BurstWork, burst_caps
from odma.errors import ConfigError

CONCURRENCY = 64  # requests running at once: the engine's max_num_seqs and the HTTP clients
SERVER_SET_ASIDE_S = 30.0  # of the cap: the server's start (imports, the model made, graphs captured) and stop
READY_TIMEOUT_S = 180.0  # the longest wait for the server's /health, cap permitting
STOP_GRACE_S = 15.0  # after SIGTERM, before SIGKILL
LOG_TAIL = 1500  # characters of the server's log in an error


def add_arguments(p) -> None:
    p.add_argument("--http-requests", type=int, default=None,
                   help="requests in the http part's burst (default 128: 25K forced tokens after 113K prompt "
                        "tokens, ~10 s a run at 3K tok/s; tiny: 6)")
    p.add_argument("--http-also-flags", default="",
                   help="odma-serve flags of a second server run after the first, time cap permitting (e.g. "
                        "'--gil-switch-ms 1'): its figures as server_b, http_b_vs_engine (default: none)")


# -- the work ---------------------------------------------------------------------------------------------------


def served_model(args) -> str:
    return "random:tiny-qwen2" if args.tiny else "random:paper-7b"


def burst_work(args) -> BurstWork:
    """The burst the part runs, made here alone: the first requests of --trace with their natural lengths (cut to
    max_tokens), prompts of random ids of SmolLM2's vocabulary (which the served random model covers)."""
    from odma.bench.gpu_work import burst_from_trace
    from odma.models.random_served import RANDOM_TOKENIZER
    from odma.tokenizer import load_tokenizer

    n = args.http_requests or (6 if args.tiny else 128)
    max_prompt, max_tokens = burst_caps(args.max_prompt, args.max_tokens, args.tiny)
    return burst_from_trace(args.trace, n, max_prompt=max_prompt, max_tokens=max_tokens,
                            kv_budget=args.kv_budget or ("48KiB" if args.tiny else "4GiB"),
                            vocab_size=len(load_tokenizer(RANDOM_TOKENIZER).hf))


def server_flags(args, work: BurstWork, device: str, dtype_name: str) -> list[str]:
    """odma-serve's flags for `work` on `device` (no host or port): odma's policy on the work's KV budget, at most
    CONCURRENCY running, the engine part's settings otherwise (Triton attention and decode graphs where the device
    compiles Triton, its own attention elsewhere; the median predictor; no length log)."""
    from odma.engine.config import device_capabilities

    attention = "triton" if device_capabilities(device).attention == "triton" else "auto"
    from odma.analyze.gpu_burst import odma_memory

    name = getattr(args, "odma_memory", "swap")
    memory = odma_memory(name)  # the engine part's odma memory, as flags
    pool = memory.get("pool")
    if pool is not None and not memory.get("packing") and (pool.slide_growth or pool.neighbour_growth
                                                            or pool.growth != "next"):
        # the server's flags give packing's pool fields only through --packing, which waits instead of swapping
        raise ConfigError(f"odma memory {name!r} has no odma-serve flags (its pool packs without --packing)")
    longest = max(map(len, work.prompts))
    return ["--model", served_model(args), "--device", device, "--dtype", dtype_name, "--policy", "odma",
            "--kv-budget", work.kv_budget, "--kv-growth", "copy", "--max-num-seqs", str(CONCURRENCY),
            "--attention", attention, "--decode-graphs", "auto", "--predictor", "median", "--length-log", "",
            "--max-tokens-cap", str(work.max_tokens), "--default-max-tokens", str(work.max_tokens),
            "--max-model-len", str(longest + work.max_tokens), "--max-prefill-tokens", str(max(8192, longest)),
            "--max-queue", str(work.requests + 8), "--threads", "1" if args.tiny else "4",
            "--generation-config", "vllm",
            "--compact-growth" if pool is not None and pool.compact_growth else "--no-compact-growth",
            *(["--preempt", memory["preempt"]] if "preempt" in memory else []),
            *(["--admission-theta", str(memory["admission_theta"])] if "admission_theta" in memory else []),
            "--packing" if memory.get("packing") else "--no-packing"]


def warm_prompts(work: BurstWork) -> list[list[int]]:
    """What runs before each clock starts (as the engine part warms up): short prompts, then two longer ones, so every
    kernel variant is compiled and every decode batch captured."""
    longest = max(map(len, work.prompts))
    return ([list(p[:8]) for p in work.prompts[:4]]
            + [list(p * 64)[: min(longest, 512)] for p in work.prompts[:2]])


# -- figures ----------------------------------------------------------------------------------------------------


def percentile(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile, None for no values."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def _figures(seconds: float, tokens: int, ttfts: list[float], ok: int, failed: int, cut: bool) -> dict:
    return {"seconds": round(seconds, 4), "output_tokens": tokens,  # rounded as TTFT is: a TTFT never exceeds it
            "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None,
            "ttft_p50_s": _round(percentile(ttfts, 0.5)), "ttft_p99_s": _round(percentile(ttfts, 0.99)),
            "requests_ok": ok, "requests_failed": failed, "cut_at_cap": cut}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


# -- 1. the engine in process -----------------------------------------------------------------------------------


def engine_run(flags: list[str], work: BurstWork, seconds: float) -> dict:
    """The work through an engine built from `flags` in this process, CONCURRENCY requests at a time; its burst
    stops at `seconds` (the rest aborted, `cut_at_cap`). The engine and its model are freed before returning."""
    from odma.engine import LLMEngine, SamplingParams
    from odma.server.cli import build_parser, config_from_args

    config = config_from_args(build_parser().parse_args(flags))
    t0 = time.perf_counter()
    engine = LLMEngine(config)
    made = time.perf_counter() - t0
    try:
        engine.generate(warm_prompts(work), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        result = _engine_burst(engine, work, time.perf_counter() + seconds)
        result["made_s"] = round(made, 1)
        return result
    finally:  # the device's memory back before the server takes its own copy of the model
        backend = engine.backend
        engine.close()
        del engine
        gc.collect()
        backend.empty_cache()


def _engine_burst(engine, work: BurstWork, deadline: float) -> dict:
    from odma.engine import SamplingParams

    pending = deque(range(work.requests))
    live: dict[str, tuple[int, object, float]] = {}
    ttfts: list[float] = []
    seen_first: set[str] = set()
    ok = failed = tokens = 0
    cut = False
    t0 = time.perf_counter()
    while pending or live:
        while pending and len(live) < CONCURRENCY:
            i = pending.popleft()
            params = SamplingParams(max_tokens=work.lengths[i], temperature=0, ignore_eos=True)
            seq = engine.add_request(list(work.prompts[i]), params)
            live[seq.request_id] = (i, seq, time.perf_counter())
        if time.perf_counter() > deadline:
            cut = True
            for rid in live:
                engine.abort(rid, "abort")
            while engine.has_work():
                engine.step()
            failed += len(live) + len(pending)
            break
        engine.step()
        now = time.perf_counter()
        for rid, (i, seq, sent) in list(live.items()):
            if rid not in seen_first and seq.num_generated >= 1:
                seen_first.add(rid)
                ttfts.append(now - sent)
            if seq.finished:
                del live[rid]
                done = seq.num_generated == work.lengths[i] and seq.finish_reason != "error"
                ok += done
                failed += not done
                tokens += seq.num_generated if done else 0
    engine.backend.synchronize()
    return _figures(time.perf_counter() - t0, tokens, ttfts, ok, failed, cut)


# -- 2. the server over HTTP ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Server:
    url: str
    pid: int
    log_path: Path
    ready_s: float  # from launch until /health answered (0 until it has)
    exit_code: int | None = None  # once stopped: 0 after a clean stop, -9 when it had to be killed


def server_command(flags: list[str], port: int) -> list[str]:
    return [sys.executable, "-m", "odma.server.cli", *flags, "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning"]


def _log_tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-LOG_TAIL:].strip()
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def running_server(flags: list[str], log_path: Path, ready_timeout_s: float) -> Iterator[Server]:
    """odma-serve with `flags` in its own process group, yielded once /health answers; RuntimeError (with the end of
    its log) if it exits or does not answer in time. Stopped on leaving, whatever happened: SIGTERM to the group,
    STOP_GRACE_S, then SIGKILL."""
    import httpx

    import odma
    from odma.bench.peer_servers import stop

    from odma.server.threaded import free_port  # imports uvicorn: only where a server runs

    port = free_port(below_ephemeral=True)
    url = f"http://127.0.0.1:{port}"
    # the server imports this odma, wherever the interpreter's own install points
    root = str(Path(odma.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        log.write(shlex.join(server_command(flags, port)) + "\n")
        log.flush()
        # its own session: the group is stopped as one; cwd off the repo (its datasets/ would shadow a package)
        proc = subprocess.Popen(server_command(flags, port), stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, cwd=log_path.parent)
    server = Server(url, proc.pid, log_path, ready_s=0.0)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"odma-serve exited with code {proc.returncode} before it was ready; its log "
                                   f"({log_path}) ends: {_log_tail(log_path)}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > ready_timeout_s:
                raise RuntimeError(f"odma-serve did not answer /health within {ready_timeout_s:.0f} s; its log "
                                   f"({log_path}) ends: {_log_tail(log_path)}")
            time.sleep(0.5)
        server.ready_s = time.monotonic() - t0
        yield server
    finally:
        stop(proc, grace_s=STOP_GRACE_S)
        server.exit_code = proc.returncode


def _body(model: str, prompt: list[int], max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


async def _drive(url: str, model: str, work: BurstWork, deadline: float) -> dict:
    """The warm-up prompts, then the work by CONCURRENCY clients until done or `deadline` (perf_counter)."""
    import httpx

    from odma.bench.soak_load import Plan, send

    limits = httpx.Limits(max_connections=CONCURRENCY + 8, max_keepalive_connections=CONCURRENCY + 8)
    async with httpx.AsyncClient(limits=limits) as client:
        warm = [Plan("warm", "/v1/completions", _body(model, p, 4), True, max_tokens=4) for p in warm_prompts(work)]
        t0 = time.perf_counter()
        warmed = await asyncio.gather(*(send(client, url, p, t0, max(1.0, deadline - t0)) for p in warm))
        bad = [o for o in warmed if o.outcome != "full"]
        if bad:
            raise RuntimeError(f"a warm-up request failed: {bad[0].outcome} {bad[0].status} {bad[0].reason}")
        plans = [Plan("burst", "/v1/completions", _body(model, list(p), n), True, max_tokens=n)
                 for p, n in zip(work.prompts, work.lengths)]
        outcomes: list = [None] * len(plans)
        queue = iter(enumerate(plans))

        async def client_loop() -> None:
            for i, plan in queue:  # one iterator shared by the clients: each takes the next request
                left = deadline - time.perf_counter()
                if left <= 0:
                    return
                outcomes[i] = await send(client, url, plan, t0, left)

        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(min(CONCURRENCY, len(plans)))))
        seconds = time.perf_counter() - t0
    answered = [o.outcome == "full" and o.tokens == p.max_tokens if o is not None else False
                for o, p in zip(outcomes, plans)]
    full = [o for o, good in zip(outcomes, answered) if good]
    failed = [o for o, good in zip(outcomes, answered) if o is not None and not good]
    cut = any(o is None for o in outcomes) or any("no answer within" in o.reason for o in failed)
    result = _figures(seconds, sum(o.tokens for o in full), [o.ttft_s for o in full if o.ttft_s is not None],
                      len(full), len(plans) - len(full), cut)
    if failed:
        result["error_samples"] = [f"{o.outcome} {o.status}: {o.reason} ({o.tokens} tokens, finish {o.finish})"
                                   for o in failed[:3]]
    return result


def http_run(flags: list[str], work: BurstWork, log_path: Path, ready_timeout_s: float, deadline: float) -> dict:
    """The work over HTTP against odma-serve started with `flags`; the server is stopped before returning."""
    with running_server(flags, log_path, ready_timeout_s) as server:
        result = asyncio.run(_drive(server.url, served_name(flags), work, deadline))
        result["ready_s"] = round(server.ready_s, 1)
    result["exit_code"] = server.exit_code
    result["server_log"] = str(log_path)
    return result


def served_name(flags: list[str]) -> str:
    from odma.models.weights import model_name

    return model_name(flags[flags.index("--model") + 1])


# -- the part ---------------------------------------------------------------------------------------------------


def _measure(out: dict, key: str, fn, report) -> dict:
    """out[key] = fn(), or {"error": ...}: one run's failure loses only its own figures; saved either way."""
    try:
        out[key] = fn()
    except Exception as exc:  # noqa: BLE001 - recorded in the JSON; the part goes on
        out[key] = {"error": f"{type(exc).__name__}: {exc}"}
    report.save()
    return out[key]


def bench_http(args, device, dtype_name: str, report, cap) -> dict:
    """The part (see the module's doc). `report`: gpu_report's Report (`result`, `save()`); `cap`: its Cap
    (`left()`)."""
    work = burst_work(args)
    flags = server_flags(args, work, str(device), dtype_name)
    out: dict = {"model": served_model(args), "dtype": dtype_name, "trace": work.name, "requests": work.requests,
                 "prompt_tokens": work.prompt_tokens, "forced_output_tokens": work.output_tokens,
                 "max_tokens": work.max_tokens, "kv_budget": work.kv_budget, "concurrency": CONCURRENCY,
                 "server_flags": flags, "skipped": []}
    report.result["http"] = out
    report.save()
    share = (cap.left() - SERVER_SET_ASIDE_S) / 2
    if share > 0:
        _measure(out, "engine", lambda: engine_run(flags, work, share), report)
    else:
        out["skipped"].append({"run": "engine", "why": "time cap"})
    log_dir = Path(report.path).parent if report.path else Path(tempfile.mkdtemp(prefix="odma-gpu-http-"))

    def server_run(key: str, run_flags: list[str], room: float) -> None:
        if cap.left() <= room:
            out["skipped"].append({"run": key, "why": "time cap"})
            return
        _measure(out, key, lambda: http_run(
            run_flags, work, log_dir / f"http_{key}.log", max(5.0, min(READY_TIMEOUT_S, cap.left() - 5)),
            # the burst's end: what is left of the cap then, less the server's stop
            time.perf_counter() + max(1.0, cap.left() - 5)), report)

    server_run("server", flags, 0)
    also = shlex.split(getattr(args, "http_also_flags", "") or "")
    if also:
        out["server_b_flags"] = also
        server_run("server_b", flags + also, SERVER_SET_ASIDE_S)
    engine = out.get("engine", {})
    for key, ratio in (("server", "http_vs_engine"), ("server_b", "http_b_vs_engine")):
        server = out.get(key, {})
        if "output_tokens" in engine and "output_tokens" in server:
            out["tokens_equal" if key == "server" else "tokens_equal_b"] = (
                engine["output_tokens"] == server["output_tokens"] == work.output_tokens)
            if not (engine["cut_at_cap"] or server["cut_at_cap"]) and engine["tokens_per_s"]:
                out[ratio] = round(server["tokens_per_s"] / engine["tokens_per_s"], 3)
    report.save()
    return out
