"""`odma-bench serve`: replay a trace against an OpenAI-compatible server with real HTTP calls.

Each request is a streaming chat completion of a trace prompt (same sampling for every policy, a per-request
seed so every run generates the same tokens). Reports throughput (completion tokens / makespan), TTFT and
TPOT percentiles, completed / errors / lost, the server's migrations and preemptions, and the peak number
of running requests. `--start-server` starts odma-serve as a separate process (`--policy`, `--kv-budget`...);
`--baseline hf` instead runs transformers `generate` in static batches over the same prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import random
import re
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--start-server", action="store_true", help="start odma-serve in this process")
    p.add_argument("--trace", default="nq", help="trace spec (odma.traces.load_trace)")
    p.add_argument("--rate", type=float, default=math.inf, help="requests/s, Poisson arrivals (inf: all at once)")
    p.add_argument("--num", type=int, default=64, help="requests to send")
    p.add_argument("--seed", type=int, default=0, help="selects the prompts and the arrival times")
    p.add_argument("--max-tokens", type=int, default=512, help="max_tokens of every request (the length cap)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per request")
    p.add_argument("--no-seed", dest="send_seed", action="store_false",
                   help="send no per-request seed (vLLM-CPU's sampler crashes its engine on seeded requests)")
    # --start-server / --baseline hf
    p.add_argument("--policy", default="odma", choices=["odma", "static", "s3"])
    p.add_argument("--kv-budget", default="160MiB")
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="the started server's batch cap (default 64, the server's default before it was 128, so that "
                        "the commands recorded in docs/BENCHMARKS.md reproduce; the server's own default is 128)")
    p.add_argument("--preempt", default="swap", choices=["wait", "recompute", "swap"])
    p.add_argument("--kv-growth", default=None, choices=["copy", "map", "auto"],
                   help="the started server's --kv-growth (default: the server's, copy)")
    p.add_argument("--admission-demand", type=float, default=None,
                   help="the started server's --admission-demand (admission by the running set's predicted final KV)")
    p.add_argument("--predictor", default="default")
    p.add_argument("--schedule", default="fcfs", choices=["fcfs", "sjf"], help="the started server's order of service")
    p.add_argument("--sjf-aging-rounds", type=int, default=None, help="the started server's sjf aging bound")
    p.add_argument("--probe", default=None, help="the started server's length probe (e.g. 'probe')")
    p.add_argument("--growth-hint", default=None, choices=["pred", "none"], help="the started server's growth hint")
    p.add_argument("--weights", default=None, choices=["auto", "f32", "bf16", "native"],
                   help="odma-serve's --weights instead of --dtype (native: the GGUF's quantized blocks)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights dtype of the started server and of the HF baseline")
    p.add_argument("--kv-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="KV dtype of the started server (default: the server's)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (server: its default, all cores but one; HF baseline: all cores)")
    p.add_argument("--length-log", default="", help="JSONL of realized lengths for the started server ('' = none)")
    p.add_argument("--baseline", default=None, choices=["hf"], help="run transformers generate instead of a server")
    p.add_argument("--hf-batch", type=int, default=48)
    p.add_argument("--out", default=None, help="also write the result JSON here")
    p.add_argument("--per-request-lengths", action="store_true",
                   help="add each request's id and realized length, in the order sent (`output_tokens`; what "
                        "scripts/run_oracle_bound.py replays for the run's own oracle bound)")


def _pick(trace_spec: str, num: int, seed: int) -> list:
    from odma.traces import load_trace

    records = [r for r in load_trace(trace_spec).records if r.prompt]
    if num > len(records):
        raise SystemExit(f"trace {trace_spec!r} has {len(records)} prompts, fewer than --num {num}")
    return random.Random(seed).sample(records, num)


def _req_seed(request_id: str) -> int:
    return int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:4], "little")


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


async def _one(client, url: str, rec, args, start_at: float, t0: float, out: dict, index: int | None = None) -> None:
    await asyncio.sleep(max(0.0, t0 + start_at - time.perf_counter()))
    body = {"model": args.model, "messages": [{"role": "user", "content": rec.prompt}], "max_tokens": args.max_tokens,
            "temperature": args.temperature, "top_p": args.top_p, "stream": True,
            "stream_options": {"include_usage": True}}
    if getattr(args, "send_seed", True):
        body["seed"] = _req_seed(rec.request_id)
    body.update(getattr(args, "extra_body", None) or {})  # a server's own fields (llama.cpp's sampler chain)
    sent = time.perf_counter()
    first = None
    tokens = None
    finish = None
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=args.timeout) as r:
            if r.status_code != 200:
                out["errors"].append(f"{r.status_code}: {(await r.aread())[:200]!r}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["errors"].append(str(chunk["error"]))
                    return
                for ch in chunk.get("choices") or []:
                    if first is None and ch.get("delta", {}).get("content"):
                        first = time.perf_counter()
                    finish = ch.get("finish_reason") or finish
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except Exception as exc:  # noqa: BLE001 - every failure is counted, none is fatal to the run
        out["errors"].append(f"{type(exc).__name__}: {exc}")
        return
    end = time.perf_counter()
    if tokens is None or finish is None:
        out["lost"] += 1
        return
    first = first or end
    out["done"].append({"ttft": first - sent, "tpot": (end - first) / (tokens - 1) if tokens > 1 else None,
                        "latency": end - sent, "tokens": tokens, "end": end, "finish": finish, "index": index})


async def _poll(client, url: str, stop: asyncio.Event, peak: dict) -> None:
    peer = False  # vLLM's /health has no body, llama.cpp's only a status: their gauges are on /metrics
    while not stop.is_set():
        try:
            if not peer:
                r = await client.get(url + "/health", timeout=5)
                h = r.json() if r.content else None
                peer = h is None or "running" not in h
            if peer:
                h = _vllm_gauges((await client.get(url + "/metrics", timeout=5)).text)
            peak["running"] = max(peak["running"], h.get("running", 0))
            peak["waiting"] = max(peak["waiting"], h.get("waiting", 0))
        except Exception:  # noqa: BLE001 - health polling is best effort
            pass
        await asyncio.sleep(0.5)


def _vllm_gauges(text: str) -> dict:
    """Running and waiting requests from a peer's /metrics: vLLM's, or llama.cpp's (processing, deferred)."""
    out = {}
    for key, name in (("running", "vllm:num_requests_running"), ("waiting", "vllm:num_requests_waiting"),
                      ("running", "llamacpp:requests_processing"), ("waiting", "llamacpp:requests_deferred")):
        m = re.search(rf"^{name}(?:\{{[^}}]*\}})? ([0-9.e+]+)$", text, re.M)
        if m:
            out[key] = int(float(m.group(1)))
    return out


def _server_counters(text: str) -> dict:
    out = {}
    for name in ("odma_migrations_total", "odma_grown_in_place_total", "odma_preemptions_total", "odma_stalls_total", "odma_reservation_refusals_total",
                 "odma_migration_refusals_total", "odma_demand_refusals_total", "odma_kv_budget_bytes", "odma_engine_steps_total",
                 "odma_engine_busy_seconds_total", "odma_engine_decode_tokens_total", "odma_engine_prefill_tokens_total"):
        m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
        if m:
            out[name.removeprefix("odma_").removesuffix("_total")] = float(m.group(1))
    m = re.search(r'odma_predictor_info\{[^}]*name="([^"]+)"', text)
    if m:
        out["predictor"] = m.group(1)
    return out


async def _replay(url: str, records: list, args) -> dict:
    import httpx

    rng = random.Random(args.seed + 1)
    arrivals, t = [], 0.0
    for _ in records:
        arrivals.append(t)
        t += 0.0 if math.isinf(args.rate) else rng.expovariate(args.rate)
    out: dict = {"done": [], "errors": [], "lost": 0}
    peak = {"running": 0, "waiting": 0}
    limits = httpx.Limits(max_connections=len(records) + 4, max_keepalive_connections=len(records) + 4)
    async with httpx.AsyncClient(limits=limits, timeout=args.timeout) as client:
        stop = asyncio.Event()
        poller = asyncio.create_task(_poll(client, url, stop, peak))
        t0 = time.perf_counter()
        await asyncio.gather(*(_one(client, url, r, args, a, t0, out, i)
                               for i, (r, a) in enumerate(zip(records, arrivals))))
        makespan = time.perf_counter() - t0
        stop.set()
        await poller
        counters = _server_counters((await client.get(url + "/metrics")).text)
    done = out["done"]
    tokens = sum(d["tokens"] for d in done)
    result = {
        "throughput_tps": tokens / makespan if makespan > 0 else 0.0,
        "ttft_p50_s": _pct([d["ttft"] for d in done], 0.5),
        "ttft_p99_s": _pct([d["ttft"] for d in done], 0.99),
        "tpot_p50_s": _pct([d["tpot"] for d in done if d["tpot"] is not None], 0.5),
        "ttft_mean_s": statistics.fmean([d["ttft"] for d in done]) if done else None,
        "latency_mean_s": statistics.fmean([d["latency"] for d in done]) if done else None,
        "latency_p99_s": _pct([d["latency"] for d in done], 0.99),
        # inter-token latency as guidellm counts it: a request's (latency - TTFT) / (tokens - 1), averaged
        "itl_mean_s": statistics.fmean(tp) if (tp := [d["tpot"] for d in done if d["tpot"] is not None]) else None,
        "completed": len(done),
        "errors": len(out["errors"]),
        "lost": out["lost"],
        "num": len(records),
        "rate": args.rate,
        "completion_tokens": tokens,
        "mean_completion_tokens": statistics.fmean([d["tokens"] for d in done]) if done else 0.0,
        "hit_length_cap": sum(d["finish"] == "length" for d in done),
        # ended for length before max_tokens: the server cut the answer (llama.cpp's static slots when one is full)
        "cut_short": sum(d["finish"] == "length" and d["tokens"] < args.max_tokens for d in done),
        "makespan_s": makespan,
        "peak_running": peak["running"],
        "peak_waiting": peak["waiting"],
        "server": counters,
        "error_samples": out["errors"][:5],
    }
    if getattr(args, "per_request_lengths", False):
        # each request's id and realized length in the order sent (None: it failed), for the run's own oracle bound
        realized: list[list] = [[r.request_id, None] for r in records]
        for d in done:
            realized[d["index"]][1] = d["tokens"]
        result["output_tokens"] = realized
    return result


def _hf_baseline(records: list, args) -> dict:
    """transformers `generate` in static batches (left-padded), same sampling and cap; counts useful tokens:
    each row's tokens up to and including its first EOS (what a user receives)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from odma.models import resolve_model

    torch.set_num_threads(args.threads or torch.get_num_threads())
    threads = torch.get_num_threads()
    folder = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, args.dtype)).eval()
    eos = model.generation_config.eos_token_id
    useful = generated = 0
    t0 = time.perf_counter()
    for i in range(0, len(records), args.hf_batch):
        batch = records[i : i + args.hf_batch]
        texts = [tok.apply_chat_template([{"role": "user", "content": r.prompt}], add_generation_prompt=True, tokenize=False)
                 for r in batch]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        torch.manual_seed(args.seed + i)
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=args.max_tokens, do_sample=args.temperature > 0,
                                 temperature=args.temperature or None, top_p=args.top_p, pad_token_id=tok.pad_token_id)
        new = out[:, enc["input_ids"].shape[1]:]
        generated += new.numel()
        for row in new.tolist():
            useful += row.index(eos) + 1 if eos in row else len(row)
    wall = time.perf_counter() - t0
    return {"baseline": "hf-generate", "throughput_tps": useful / wall, "useful_tokens": useful,
            "generated_tokens_incl_padding": generated, "batch": args.hf_batch, "threads": threads, "dtype": args.dtype, "num": len(records),
            "makespan_s": wall, "completed": len(records), "errors": 0, "lost": 0}


@contextlib.contextmanager
def _server_process(args):
    """odma-serve in its own process (as a user runs it): the client's work never competes with the engine
    for one interpreter lock. Yields the base URL once /health answers; stops the server afterwards."""
    import httpx

    from odma.server.threaded import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "odma.server.cli", "--port", str(port), "--log-level", "warning",
           "--model", args.model, "--policy", args.policy, "--kv-budget", args.kv_budget, "--max-num-seqs",
           str(args.max_num_seqs), "--preempt", args.preempt, "--predictor", args.predictor,
           *(["--weights", args.weights] if args.weights else ["--dtype", args.dtype]),
           *(["--kv-dtype", args.kv_dtype] if args.kv_dtype else []),
           *(["--threads", str(args.threads)] if args.threads else []), "--length-log", args.length_log, "--max-tokens-cap", str(max(args.max_tokens, 16)),
           "--default-max-tokens", str(max(args.max_tokens, 16)), "--max-queue", str(args.num + 1),
           "--schedule", args.schedule, *(["--sjf-aging-rounds", str(args.sjf_aging_rounds)] if args.sjf_aging_rounds else []),
           *(["--probe", args.probe] if args.probe else []),
           *(["--growth-hint", args.growth_hint] if args.growth_hint else []),
           *(["--kv-growth", args.kv_growth] if args.kv_growth else []),
           *(["--admission-demand", str(args.admission_demand)] if args.admission_demand else [])]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600  # a first start converts the model and builds the predictor
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"odma-serve exited with code {proc.returncode} before it was ready")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("odma-serve did not become ready within 600 s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def run(args: argparse.Namespace) -> dict:
    records = _pick(args.trace, args.num, args.seed)
    from odma.engine.config import default_threads

    common = {"trace": args.trace, "max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
              "threads": args.threads or default_threads(), "cores": len(os.sched_getaffinity(0))}
    if args.baseline == "hf":
        result = {**common, **_hf_baseline(records, args)}
    elif args.start_server:
        with _server_process(args) as url:
            result = asyncio.run(_replay(url, records, args))
        result.update(policy=args.policy, kv_budget=args.kv_budget, preempt=args.preempt, dtype=args.dtype,
                      max_num_seqs=args.max_num_seqs, admission_demand=args.admission_demand,
                      kv_dtype=args.kv_dtype or "server default", growth_hint=args.growth_hint or "server default",
                      kv_growth=args.kv_growth or "server default", **common)
    elif args.url:
        result = {**asyncio.run(_replay(args.url.rstrip("/"), records, args)), **common}
    else:
        raise SystemExit("odma-bench serve: give --url URL, --start-server, or --baseline hf")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result
