"""`odma-analyze fit-gpu` and `odma-analyze gpu-burst`: the GPU engine's profile fitted to raw runs, and the
bench's burst replayed on a profile (odma.analyze.gpu_fit, odma.analyze.gpu_burst, odma.analyze.gpu_profile)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from odma.errors import ConfigError

GIB = 1 << 30


def add_parsers(sub) -> None:
    p = sub.add_parser("fit-gpu", help="fit a GPU step-time profile to raw odma-bench gpu runs and check the replay "
                                       "against every run")
    p.add_argument("runs", nargs="+", help="raw odma-bench gpu JSON files with an engine part")
    p.add_argument("--fit-device", default="H200",
                   help="fit on this device's runs; the other device's profile is the fitted one scaled by the ratio "
                        "of the two devices' step parts, and its runs check it (default: %(default)s)")
    p.add_argument("--out-dir", help="write <device>-7b.json profiles here (the shipped ones: odma/analyze/gpu_profiles)")
    p.add_argument("--profile", help="fit nothing: check this profile (h100-7b | h200-7b | a profile JSON) against the "
                                     "runs of its device, as the runs that were not part of its fit (default: fit)")
    p.add_argument("--json", help="write the comparison rows here")
    p.set_defaults(func=cmd_fit_gpu)
    p = sub.add_parser("gpu-burst", help="the odma-bench gpu engine burst replayed on a GPU profile")
    p.add_argument("--profile", default="h200-7b", help="h100-7b | h200-7b | a profile JSON (default: %(default)s)")
    p.add_argument("--trace", default="azure-conv")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--kv-budget", default="4GiB", help="KV budget of every policy, comma-separated for several")
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--policies", default="static,paged,oracle,odma:swap,odma:compact,odma:packed",
                   help="static, paged, oracle (exact lengths, contiguous) and odma:MEMORY (packed | packed-swap | headroom | compact | swap | "
                        "wait | compact-wait) "
                        "(default: %(default)s)")
    p.add_argument("--json", help="write the rows here")
    p.set_defaults(func=cmd_gpu_burst)


def cmd_fit_gpu(args: argparse.Namespace) -> int:
    from odma.analyze.gpu_fit import compare, fit_profile, format_rows, read_raw_runs, replay_runs, scale_profile
    from odma.analyze.gpu_profile import save_gpu_profile

    runs = [r for p in args.runs for r in read_raw_runs(p) if r.policies]
    if args.profile:
        return _check_profile(args, runs)
    fit_runs = [r for r in runs if r.device == args.fit_device]
    others = [r for r in runs if r.device != args.fit_device]
    if not fit_runs:
        raise ConfigError(f"no {args.fit_device} run among {[r.name for r in runs]}")
    bursts = replay_runs(runs)  # the replay's counts must equal every run's
    fitted = fit_profile(fit_runs, bursts, f"{args.fit_device.lower()}-7b")
    profiles = [fitted]
    for device in sorted({r.device for r in others}):
        mine = [r for r in others if r.device == device]
        profiles.append(scale_profile(fitted, fit_runs, mine, f"{device.lower()}-7b"))
    rows = []
    for prof in profiles:
        rows += compare(prof, [r for r in runs if r.device == prof.device], bursts)
        print(f"{prof.name}: " + ", ".join(f"{k} {getattr(prof, k):.4g}" for k in (
            "step_ms", "ms_per_1k_context", "paged_read_factor", "ms_per_1k_prefill", "host_ms", "paged_host_ms",
            "copy_ms_per_gib", "swap_gbps", "ms_per_slide")))
        if args.out_dir:
            save_gpu_profile(prof, Path(args.out_dir) / f"{prof.name}.json")
    print(format_rows(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


def _check_profile(args: argparse.Namespace, runs) -> int:
    """A shipped profile against runs it was not fitted on: the replay's counts must equal theirs, then tok/s."""
    from odma.analyze.gpu_fit import compare, format_rows, replay_runs
    from odma.analyze.gpu_profile import load_gpu_profile

    profile = load_gpu_profile(args.profile)
    mine = [r for r in runs if r.device == profile.device]
    if not mine:
        raise ConfigError(f"no {profile.device} run among {[r.name for r in runs]} for profile {args.profile}")
    rows = compare(profile, mine, replay_runs(mine))
    print(format_rows(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


def burst_rows(profile, trace: str, requests: int, budgets: list[int], max_tokens: int, policies: list[str]) -> list[dict]:
    """Every policy on every budget: the replay's counts and the profile's seconds and tok/s (odma ÷ paged beside)."""
    from odma.analyze.gpu_burst import BurstConfig, bench_prompts, odma_memory, run_burst

    rows = []
    for budget in budgets:
        config = BurstConfig(trace=trace, requests=requests, max_tokens=max_tokens, kv_budget_bytes=budget)
        prompts = bench_prompts(config)
        for name in policies:
            policy, _, memory = name.partition(":")
            overrides = odma_memory(memory) if policy == "odma" and memory else {}
            if memory and policy != "odma":
                raise ConfigError(f"{name}: only odma takes a memory mode")
            burst = run_burst(config, policy, engine_overrides=overrides, prompts=prompts)
            parts = profile.breakdown(burst.steps, burst.paged)
            rows.append({**burst.summary(), "trace": trace, "kv_gib": round(budget / GIB, 2), "policy": name,
                         "tokens_per_s": round(burst.output_tokens / parts["seconds"], 1),
                         **{k: round(v, 2) for k, v in parts.items()}})
        paged = next((r["tokens_per_s"] for r in rows if r["policy"] == "paged" and r["kv_gib"] == round(budget / GIB, 2)),
                     None)
        for r in rows:
            if paged and r["kv_gib"] == round(budget / GIB, 2):
                r["vs_paged"] = round(r["tokens_per_s"] / paged, 3)
    return rows


def cmd_gpu_burst(args: argparse.Namespace) -> int:
    from odma.analyze.gpu_profile import load_gpu_profile
    from odma.engine.config import parse_bytes

    profile = load_gpu_profile(args.profile)
    budgets = [parse_bytes(b, "kv budget") for b in args.kv_budget.split(",") if b.strip()]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    rows = burst_rows(profile, args.trace, args.requests, budgets, args.max_tokens, policies)
    print(f"{profile.name} ({profile.device}), {args.trace}, {args.requests} requests at once, max_tokens "
          f"{args.max_tokens}")
    print("| KV | policy | tok/s | ÷ paged | steps | mean running | preemptions | swap-outs | migrations | "
          "migrated tokens | relocated tokens | swap s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kv_gib']:g} GiB | {r['policy']} | {r['tokens_per_s']:.0f} | {r.get('vs_paged', '')} | {r['steps']} | "
              f"{r['mean_running']} | {r['preemptions']} | {r['swap_outs']} | {r['migrations']} | "
              f"{r['migrated_tokens']} | {r['relocated_tokens']} | {r['swap_s']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0
