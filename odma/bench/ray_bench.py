"""`odma-bench ray`: odma on Ray Serve against one odma-serve with the same total KV budget, and the memory-aware
router against Ray Serve's default power-of-two-choices, on the same trace replay, back to back in one process.

Modes (`--modes`, run in the order given, `--rounds` times): `single` (one odma-serve process with the whole
`--kv-budget`), `odma` / `pow2` (`--replicas` engine replicas on a local Ray, each with budget / replicas, behind
the memory-aware router or Ray's default; the predictor runs at the ingress), `odma-replica` (the memory-aware
router with the predictor at the replicas), `odma-hold` (the router holds a request no replica has room for,
up to 10 s; the default never holds), `odma-nohold` (explicitly never holds: the default), `odma-engines` /
`pow2-engines` (the engine replicas are the ingress: Ray's proxy routes to them, no ingress replica between). Each measurement starts from a fresh deployment after a short warm-up.
`--hop` adds the Ray hop's overhead at low load: sequential requests (one at a time), TTFT of `single` vs Ray.
`--guidellm 4:16,16:64` adds a guidellm concurrency sweep (fixed `--shape`) against every mode's endpoint, after
its replay (guidellm from the `odma-bench peer` environment, scripts/peer_setup.sh).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import time
from pathlib import Path

from odma.bench import serve_bench

# Ray modes: the RaySettings each one changes
RAY_MODES = {"odma": {}, "pow2": {"router": "pow2"}, "odma-replica": {"predict_at": "replica"},
             "odma-hold": {"max_hold_s": 10.0}, "odma-nohold": {"max_hold_s": 0.0},
             # the engine replicas are the ingress (Ray's proxy routes to them; no ingress replica in between)
             "odma-engines": {"ingress": "engines"}, "pow2-engines": {"ingress": "engines", "router": "pow2"}}
MODES = ("single", *RAY_MODES)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default="nq")
    p.add_argument("--num", type=int, default=96, help="requests per replay")
    p.add_argument("--rate", type=float, default=math.inf, help="requests/s, Poisson (inf: all at once)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--policy", default="odma", choices=["odma", "static", "s3"])
    p.add_argument("--kv-budget", default="160MiB", help="the TOTAL budget: single gets it all, each replica a share")
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="each replica's batch cap (default 64, as in the recorded runs; odma-serve's own default is 128)")
    p.add_argument("--preempt", default="swap", choices=["wait", "recompute", "swap"])
    p.add_argument("--admission-demand", type=float, default=None, help="every engine's --admission-demand")
    p.add_argument("--predictor", default="default")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--weights", default=None, choices=["auto", "f32", "bf16", "native"],
                   help="every engine's --weights instead of --dtype (native: the GGUF's quantized blocks)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of every engine (single and each replica)")
    p.add_argument("--schedule", default="fcfs", choices=["fcfs", "sjf"], help="every engine's order of service")
    p.add_argument("--sjf-aging-rounds", type=int, default=None, help="every engine's sjf aging bound")
    p.add_argument("--probe", default=None, help="every engine's length probe (e.g. 'probe')")
    p.add_argument("--growth-hint", default=None, choices=["pred", "none"], help="every engine's growth hint")
    p.add_argument("--kv-growth", default=None, choices=["copy", "map", "auto"], help="every engine's --kv-growth")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--modes", default="single,odma,pow2", help=f"comma-separated, of {MODES}")
    p.add_argument("--rounds", type=int, default=1, help="repeat the modes this often (ratios per round)")
    p.add_argument("--warmup", type=int, default=4, help="short requests before each measurement")
    p.add_argument("--hop", action="store_true", help="also measure the Ray hop at low load (sequential requests)")
    p.add_argument("--hop-num", type=int, default=30)
    p.add_argument("--hop-max-tokens", type=int, default=8)
    p.add_argument("--guidellm", default="", help="also a guidellm sweep per mode, STREAMS:REQUESTS,... (e.g. 4:16,16:64)")
    p.add_argument("--shape", default="128/128", help="guidellm synthetic prompt/output tokens")
    p.add_argument("--peer-venv", default=os.environ.get("PEER_VENV", "/work/peer-venv"),
                   help="virtualenv with guidellm (scripts/peer_setup.sh)")
    p.add_argument("--stage-timeout", type=float, default=1800.0, help="seconds per guidellm point")
    p.add_argument("--out", default=None, help="also write the result JSON here (guidellm reports beside it)")


def _server_args(args, kv_budget: str) -> argparse.Namespace:
    """What serve_bench's helpers read, for one engine of this run."""
    return argparse.Namespace(**{**vars(args), "kv_budget": kv_budget, "kv_dtype": None, "length_log": ""})


def _per_replica(total: str, replicas: int) -> str:
    from odma.engine.config import parse_kv_budget

    return str(parse_kv_budget(total, 1 << 40) // replicas)


def _engine_config(args, kv_budget: str):
    """The EngineConfig odma-serve builds from the flags serve_bench's single server gets (same everything)."""
    from odma.server.cli import build_parser, config_from_args

    cap = str(max(args.max_tokens, args.hop_max_tokens, 16))
    argv = ["--model", args.model, "--policy", args.policy, "--kv-budget", kv_budget, "--max-num-seqs",
            str(args.max_num_seqs), "--preempt", args.preempt, "--predictor", args.predictor,
            *(["--weights", args.weights] if args.weights else ["--dtype", args.dtype]), "--threads", str(args.threads), "--length-log", "", "--max-tokens-cap", cap, "--default-max-tokens", cap,
            "--schedule", args.schedule, *(["--sjf-aging-rounds", str(args.sjf_aging_rounds)] if args.sjf_aging_rounds else []),
            *(["--probe", args.probe] if args.probe else []),
            *(["--growth-hint", args.growth_hint] if args.growth_hint else []),
            *(["--kv-growth", args.kv_growth] if args.kv_growth else []),
            *(["--admission-demand", str(args.admission_demand)] if args.admission_demand else [])]
    return config_from_args(build_parser().parse_args(argv))


async def _sequential(url: str, records: list, args) -> dict:
    """One request at a time: TTFT without queueing (what a hop adds)."""
    import httpx

    out: dict = {"done": [], "errors": [], "lost": 0}
    hop = argparse.Namespace(**{**vars(args), "max_tokens": args.hop_max_tokens})
    async with httpx.AsyncClient(timeout=args.timeout) as client:
        for rec in records:
            await serve_bench._one(client, url, rec, hop, 0.0, time.perf_counter(), out)
    ttft = sorted(d["ttft"] for d in out["done"])
    return {"ttft_p50_s": statistics.median(ttft) if ttft else None, "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
            "completed": len(out["done"]), "errors": len(out["errors"]), "num": len(records)}


async def _warm(url: str, records: list, args) -> None:
    import httpx

    warm = argparse.Namespace(**{**vars(args), "max_tokens": 8})
    out: dict = {"done": [], "errors": [], "lost": 0}
    async with httpx.AsyncClient(timeout=args.timeout) as client:
        await asyncio.gather(*(serve_bench._one(client, url, r, warm, 0.0, time.perf_counter(), out) for r in records))
    if out["errors"] or out["lost"]:
        raise SystemExit(f"warm-up failed: {out['errors'][:2]}")


def _measure(url: str, records: list, hop_records: list, args, settle_s: float, label: str) -> dict:
    import httpx

    asyncio.run(_warm(url, records[: args.warmup], args))
    result = asyncio.run(serve_bench._replay(url, records, args))
    time.sleep(settle_s)  # the ingress's /metrics lags the replicas by up to two report periods
    text = httpx.get(url + "/metrics", timeout=30).text
    result["server"] = serve_bench._server_counters(text)
    result["server"].update(_extra_counters(text))
    if args.hop:
        result["hop"] = asyncio.run(_sequential(url, hop_records, args))
    if args.guidellm:
        result["guidellm"] = _guidellm(url, label, args)
    return result


def _guidellm(url: str, label: str, args) -> list[dict]:
    from odma.bench.peer_bench import guidellm_point, sweep
    from odma.models import resolve_model

    peer_python = Path(args.peer_venv) / "bin" / "python"
    if not (peer_python.parent / "guidellm").exists():
        raise SystemExit(f"no guidellm in {args.peer_venv}: run scripts/peer_setup.sh (or pass --peer-venv)")
    out = Path(args.out).with_suffix("") if args.out else Path("runs") / f"ray-guidellm-{time.strftime('%Y%m%d-%H%M%S')}"
    return [guidellm_point(url, label, streams, n, resolve_model(args.model), peer_python, out, args)
            for streams, n in sweep(args.guidellm)]


def _extra_counters(text: str) -> dict:
    import re

    out = {}
    for name in ("odma_router_holds_total", "odma_router_guard_releases_total", "odma_router_routed_total",
                 "odma_ray_failed_requests_total", "odma_predictor_latency_seconds_sum",
                 "odma_router_stats_reads_total", "odma_router_stats_age_seconds_total",
                 "odma_predictor_latency_seconds_count", "odma_swap_outs_total"):
        m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
        if m:
            out[name.removeprefix("odma_")] = float(m.group(1))
    return out


def _run_single(args, records, hop_records) -> dict:
    with serve_bench._server_process(_server_args(args, args.kv_budget)) as url:
        return _measure(url, records, hop_records, args, settle_s=0.0, label="single")


def _run_ray(args, mode: str, records, hop_records, port: int) -> dict:
    from ray import serve

    from odma.serve_ray.app import build_application
    from odma.serve_ray.settings import RaySettings

    config = _engine_config(args, _per_replica(args.kv_budget, args.replicas))
    settings = RaySettings(replicas=args.replicas, replica_cpus=float(args.threads), max_queue=args.num + args.warmup + 1,
                           **RAY_MODES[mode])
    started = time.perf_counter()
    serve.run(build_application(config, settings), name=settings.app_name, route_prefix="/")
    deploy_s = time.perf_counter() - started
    try:
        result = _measure(f"http://127.0.0.1:{port}", records, hop_records, args,
                          settle_s=2 * settings.report_period_s + 0.5, label=mode)
    finally:
        serve.delete(settings.app_name)
    result["deploy_s"] = deploy_s
    result["kv_budget_per_replica"] = config.kv_budget
    return result


def _ratios(rounds: list[dict]) -> dict:
    """Per round, side by side: memory-aware vs power-of-two, each Ray mode vs one odma-serve."""
    out: dict = {}
    for r in rounds:
        for a, b in (("odma", "pow2"), ("odma-hold", "pow2"), ("odma-nohold", "pow2"), ("odma", "single"),
                     ("odma-hold", "single"), ("pow2", "single"), ("odma-replica", "odma"),
                     ("odma-engines", "single"), ("pow2-engines", "single"), ("odma-engines", "pow2-engines"),
                     ("odma-engines", "odma")):
            if a in r and b in r:
                key = f"{a}/{b}"
                entry = out.setdefault(key, {"throughput": [], "ttft_p99": [], "ttft_p50": []})
                entry["throughput"].append(r[a]["throughput_tps"] / r[b]["throughput_tps"])
                for q in ("p99", "p50"):
                    if r[a][f"ttft_{q}_s"] and r[b][f"ttft_{q}_s"]:
                        entry[f"ttft_{q}"].append(r[a][f"ttft_{q}_s"] / r[b][f"ttft_{q}_s"])
                for pa, pb in zip(r[a].get("guidellm", []), r[b].get("guidellm", [])):
                    if pa.get("output_tps") and pb.get("output_tps"):
                        entry.setdefault("guidellm_output_tps", {}).setdefault(str(pa["streams"]), []).append(
                            pa["output_tps"] / pb["output_tps"])
                if "hop" in r[a] and "hop" in r[b] and b == "single":
                    entry.setdefault("hop_ttft_p50_added_ms", []).append(
                        1000 * (r[a]["hop"]["ttft_p50_s"] - r[b]["hop"]["ttft_p50_s"]))
    return out


def run(args: argparse.Namespace) -> dict:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    from odma.models import resolve_model

    resolve_model(args.model)  # convert a first-use model before anything starts
    records = serve_bench._pick(args.trace, args.num, args.seed)
    hop_records = serve_bench._pick(args.trace, args.hop_num, args.seed + 100) if args.hop else []
    rounds: list[dict] = []
    ray_started = False
    port = None
    try:
        for _ in range(args.rounds):
            round_: dict = {}
            for mode in modes:
                if mode == "single":
                    round_[mode] = _run_single(args, records, hop_records)
                    continue
                if not ray_started:
                    import ray
                    from ray import serve

                    from odma.server.threaded import free_port

                    ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False)
                    port = free_port(below_ephemeral=True)
                    serve.start(http_options={"host": "127.0.0.1", "port": port})
                    ray_started = True
                round_[mode] = _run_ray(args, mode, records, hop_records, port)
            rounds.append(round_)
    finally:
        if ray_started:
            import ray
            from ray import serve

            serve.shutdown()
            ray.shutdown()
    result = {"trace": args.trace, "num": args.num, "rate": args.rate, "max_tokens": args.max_tokens,
              "kv_budget_total": args.kv_budget, "replicas": args.replicas, "threads_per_engine": args.threads,
              "predictor": args.predictor, "cores": len(os.sched_getaffinity(0)), "rounds": rounds,
              "ratios": _ratios(rounds)}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result
