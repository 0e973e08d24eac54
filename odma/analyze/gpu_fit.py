"""`odma-analyze fit-gpu`: a `GpuProfile` fitted to raw `odma-bench gpu` runs, and the replay checked against them.

Each raw run's engine part is replayed (`odma.analyze.gpu_burst`, the same burst: its counts must equal the
run's, or the fit stops) and the profile's parameters are chosen so that the replayed steps cost what the run
measured: each policy's seconds and device p50, and the step part's device time (batch 16 at 1K contexts), in
relative (log) error. Seven parameters are fitted (step_ms, ms_per_1k_context, paged_read_factor,
ms_per_1k_prefill, host_ms, swap_gbps, ms_per_slide); two are read, not fitted: the copy speed (part vmm: one 1 GiB block
copied) and paged's extra host time (the runner's host p50, paged minus contiguous). Another device's profile
is the fitted one with its device terms scaled by the ratio of the two devices' step parts (and its own copy
speed): no engine run of that device is used, so its runs check the profile.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from odma.analyze.gpu_burst import GIB, ODMA_MEMORY, BurstConfig, BurstResult, bench_prompts, odma_memory, run_burst
from odma.analyze.gpu_profile import GpuProfile
from odma.engine.prefill_cost import PrefillCost
from odma.engine.config import parse_bytes
from odma.errors import ConfigError

FIT_POLICIES = ("static", "odma", "paged")  # the runs a profile is fitted on
# and those it is checked against, replayed but not fitted: odma continuing blocks elsewhere reads pieces, whose
# cost the profile does not model (the gap to it is what such a run measures)
POLICIES = (*FIT_POLICIES, "odma-continue")
FITTED = ("step_ms", "ms_per_1k_context", "paged_read_factor", "ms_per_1k_prefill", "host_ms", "swap_gbps",
          "ms_per_slide")
CHECKED_COUNTS = ("steps", "preemptions", "swap_outs", "migrations", "migrated_tokens", "mean_running",
                  "grown_in_place", "relocated_tokens", "overlapped_tokens", "slides", "continued", "prefix_copies",
                  "prefix_maps", "prefix_tokens")


@dataclass(frozen=True)
class RawRun:
    """What one raw GPU run measured: its burst, each policy's numbers, and the step and copy parts if it ran them."""

    path: str
    device: str  # "H100" / "H200" (from the run's device string)
    config: BurstConfig
    policies: dict[str, dict]  # policy → the run's numbers (tokens_per_s, seconds, steps, device_ms_p50, ...)
    micro_device_ms: float | None  # part step: device ms of a captured batch of 16 at 1K contexts
    micro_context: int  # tokens that batch reads
    copy_ms_per_gib: float | None  # part vmm: one 1 GiB block copied
    odma_memory: str = "swap"  # the run's --odma-memory (odma.analyze.gpu_burst.ODMA_MEMORY): how its odma is replayed
    several: bool = False  # its file holds several engine runs (one per trace): its name says which
    paged_prefixes: bool = False  # its paged pool mapped shared prompt prefixes (runs before that shared none)

    @property
    def name(self) -> str:
        return f"{Path(self.path).stem} {self.config.trace}" if self.several else Path(self.path).stem

    @property
    def burst_key(self) -> tuple[BurstConfig, str, bool]:
        """What its replay depends on: the burst, how its odma meets pressure, whether its pages shared prefixes."""
        return self.config, self.odma_memory, self.paged_prefixes


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a readable JSON file ({exc})") from None


# the names a run gives odma's policy under the running median, the predictor this replay runs
_MEDIAN_ODMA = ("odma", "odma:median", "odma:running-median")


def read_raw_runs(path: str | Path) -> list[RawRun]:
    """Every engine run of a raw `odma-bench gpu` JSON: one per trace where the bench ran several
    (`engine.runs`, keyed by trace), else the one run (`read_raw_run`). Of a run's policies the replay takes static,
    paged and odma under the running median; the others (another predictor, the oracle) are left out."""
    path = Path(path)
    data = _read_json(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a raw odma-bench gpu result (its JSON is a {type(data).__name__})")
    engine = data.get("engine")
    if not isinstance(engine, dict) or not isinstance(engine.get("runs"), dict):
        return [read_raw_run(path)]
    out = []
    for run in engine["runs"].values():
        work = run.get("work")
        if not isinstance(work, dict):
            continue  # its work could not be made: nothing ran
        policies = {("odma" if name in _MEDIAN_ODMA else name): r for name, r in run.get("policies", {}).items()
                    if name in _MEDIAN_ODMA or ":" not in name}
        flat = {"model": engine.get("model"), "trace": _local_trace(run["trace"]), "requests": work["requests"],
                "max_tokens": work["max_tokens"], "kv_budget": work["kv_budget"], "policies": policies}
        out.append(replace(_raw_run(path, data, flat), several=True))
    return out


def _local_trace(spec: str) -> str:
    """The trace a run names, as this machine finds it: a text trace staged for the GPU machine
    (`odma.bench.gpu_stage`: .gpu/traces/NAME.jsonl, the first records of the named trace NAME) is the named trace
    where the staged file is not here."""
    path = Path(spec)
    if path.suffix == ".jsonl" and path.parent.name == "traces" and not path.is_file():
        return path.stem
    return spec


def read_raw_run(path: str | Path) -> RawRun:
    """A raw `odma-bench gpu` JSON with one engine run (the bench's format before several traces ran in one);
    policies that failed or were cut are left out."""
    path = Path(path)
    data = _read_json(path)
    engine = data.get("engine") if isinstance(data, dict) else None
    if not isinstance(engine, dict) or "policies" not in engine:
        raise ConfigError(f"{path}: no engine part with one run (odma-bench gpu --parts engine; several runs: "
                          f"read_raw_runs)")
    return _raw_run(path, data, engine)


def _raw_run(path: Path, data: dict, engine: dict) -> RawRun:
    if engine.get("model") != "paper-7b" or data.get("tiny"):
        raise ConfigError(f"{path}: not a paper-7b run (tiny runs time Triton's interpreter)")
    name = str(data.get("device", ""))
    device = next((d for d in ("H100", "H200", "A100", "B200") if d in name), name.split(" (")[0] or "gpu")
    config = BurstConfig(trace=engine["trace"], requests=int(engine["requests"]), max_tokens=int(engine["max_tokens"]),
                         kv_budget_bytes=parse_bytes(engine["kv_budget"], "kv budget"))
    policies = {p: r for p, r in engine["policies"].items()
                if p in POLICIES and "tokens_per_s" in r and not r.get("cut_at_cap")}
    micro, context = None, 0
    step = data.get("step")
    if isinstance(step, dict):
        capture = step.get("modes", {}).get("capture", {})
        if "device_ms_p50" in capture:
            micro, context = float(capture["device_ms_p50"]), int(step["batch"]) * int(step["context"])
    copy = None
    for row in (data.get("vmm") or {}).get("rows", []):
        if row.get("block_bytes") == GIB and "copy_block_ms" in row.get("result", {}):
            copy = float(row["result"]["copy_block_ms"])
    # a run's paged policy records its prefix maps since the pool has them; before, it shared nothing
    paged_prefixes = "prefix_maps" in engine["policies"].get("paged", {})
    return RawRun(str(path), device, config, policies, micro, context, copy, _odma_memory(path, engine),
                  paged_prefixes=paged_prefixes)


def _odma_memory(path: Path, engine: dict) -> str:
    """The run's odma memory preset: recorded (`odma_memory`, in the engine part or odma's policy), or "swap" for a run
    whose odma neither compacted nor waited (the first runs, before the bench had presets)."""
    odma = engine["policies"].get("odma", {})
    memory = engine.get("odma_memory") or odma.get("odma_memory")
    if memory is None and not odma.get("compact_growth") and odma.get("preempt", "swap") == "swap":
        memory = "swap"
    if memory == "packed" and odma.get("preempt") == "swap":
        memory = "packed-swap"  # the first packed runs, before packing waited instead of swapping
    if memory not in ODMA_MEMORY:
        raise ConfigError(f"{path}: which --odma-memory the run's odma used is not recorded ({memory!r}); its replay "
                          f"needs it (one of {', '.join(ODMA_MEMORY)})")
    return memory


Bursts = dict[tuple[BurstConfig, str, bool], dict[str, BurstResult]]  # RawRun.burst_key → policy → its replay


def replay_runs(runs: list[RawRun], check: bool = True) -> Bursts:
    """Each distinct burst (and odma memory) once per policy. `check`: its counts must equal every run's (else
    ConfigError)."""
    out: Bursts = {}
    prompts: dict[BurstConfig, tuple] = {}
    for run in runs:
        if run.config not in prompts:
            prompts[run.config] = bench_prompts(run.config)
        overrides = {"odma": odma_memory(run.odma_memory),
                     "odma-continue": odma_memory(run.odma_memory, continue_growth=True),
                     "paged": None if run.paged_prefixes else {"prefix_share_min_tokens": 0}}
        bursts = out.setdefault(run.burst_key, {})
        for p in dict.fromkeys([*FIT_POLICIES, *run.policies]):  # a policy another run of this burst ran: once
            if p not in bursts:
                bursts[p] = run_burst(run.config, "odma" if p == "odma-continue" else p, prompts=prompts[run.config],
                                      engine_overrides=overrides.get(p))
        if check:
            for policy, measured in run.policies.items():
                replayed = out[run.burst_key][policy].summary()
                wrong = {k: (measured.get(k), replayed[k]) for k in CHECKED_COUNTS
                         if k in measured and measured[k] != replayed[k]}
                if wrong:
                    raise ConfigError(f"{run.name} {policy}: the replay's counts differ from the run's "
                                      f"(measured, replayed): {wrong}")
    return out


def _profile_from(x: dict, name: str, device: str, copy: float, paged_extra: float, fitted_on, span: float,
                  bytes_per_token: int) -> GpuProfile:
    return GpuProfile(name=name, device=device, step_ms=x["step_ms"], ms_per_1k_context=x["ms_per_1k_context"],
                      paged_read_factor=x["paged_read_factor"], ms_per_1k_prefill=x["ms_per_1k_prefill"],
                      host_ms=x["host_ms"], paged_host_ms=x["host_ms"] + paged_extra, copy_ms_per_gib=copy,
                      swap_gbps=x["swap_gbps"], ms_per_slide=x["ms_per_slide"],
                      bytes_per_token=bytes_per_token, prefill_span=span,
                      fitted_on=tuple(fitted_on))


def fit_profile(runs: list[RawRun], bursts: Bursts, name: str,
                copy_ms_per_gib: float | None = None) -> GpuProfile:
    """The profile whose replayed seconds and device p50s are closest (least squares of log ratios) to the runs'."""
    from scipy.optimize import least_squares

    if not runs:
        raise ConfigError("fit-gpu needs at least one raw run")
    devices = {r.device for r in runs}
    if len(devices) > 1:
        raise ConfigError(f"one profile is fitted on one device's runs, got {sorted(devices)}")
    copies = [r.copy_ms_per_gib for r in runs if r.copy_ms_per_gib]
    copy = copy_ms_per_gib or (statistics.mean(copies) if copies else None)
    if copy is None:
        raise ConfigError("no run measured the copy speed (part vmm); pass copy_ms_per_gib")
    host = {kind: [r.policies[p]["host_ms_p50"] for r in runs for p in r.policies
                   if p in FIT_POLICIES and (p == "paged") == (kind == "paged") and "host_ms_p50" in r.policies[p]]
            for kind in ("contiguous", "paged")}
    paged_extra = (statistics.mean(host["paged"]) - statistics.mean(host["contiguous"])
                   if host["paged"] and host["contiguous"] else 0.0)
    model = runs[0].config.model
    span = PrefillCost.for_model(model).span
    bpt = model.kv_bytes_per_token

    # a slide's cost is fitted where the replayed bursts slid (a packing pool's runs), else it stays 0
    slid = any(s.slides for r in runs for p in r.policies for s in bursts[r.burst_key][p].steps)
    names = [n for n in FITTED if slid or n != "ms_per_slide"]

    def profile(v) -> GpuProfile:
        x = {"ms_per_slide": 0.0, **dict(zip(names, map(math.exp, v)))}
        return _profile_from(x, name, runs[0].device, copy, max(paged_extra, 1e-6), [r.name for r in runs], span, bpt)

    def residuals(v) -> list[float]:
        prof = profile(v)
        out = []
        for run in runs:
            for policy, measured in run.policies.items():
                if policy not in FIT_POLICIES:
                    continue
                burst = bursts[run.burst_key][policy]
                out.append(math.log(prof.breakdown(burst.steps, burst.paged)["seconds"] / measured["seconds"]))
                if measured.get("device_ms_p50"):
                    out.append(math.log(prof.device_p50_ms(burst.steps, burst.paged) / measured["device_ms_p50"]))
            if run.micro_device_ms:
                out.append(math.log((prof.step_ms + prof.ms_per_1k_context * run.micro_context / 1e3)
                                    / run.micro_device_ms))
        return out

    start = [math.log(v) for v in (6.0, 0.03, 1.5, 0.05, 2.0, 20.0, 1.0)[:len(names)]]
    fit = least_squares(residuals, start, method="trf", x_scale=1.0)
    return profile(fit.x)


def scale_profile(profile: GpuProfile, fit_runs: list[RawRun], other: list[RawRun], name: str) -> GpuProfile:
    """`profile` moved to the device of `other`: device terms × (its step part / the fit runs' step part), its own
    copy speed. Needs a step part on both sides."""
    mine = [r.micro_device_ms for r in fit_runs if r.micro_device_ms]
    theirs = [r.micro_device_ms for r in other if r.micro_device_ms]
    copies = [r.copy_ms_per_gib for r in other if r.copy_ms_per_gib]
    if not mine or not theirs or not copies:
        raise ConfigError("scaling a profile needs a step part (and a vmm part) on both devices")
    factor = statistics.mean(theirs) / statistics.mean(mine)
    device = other[0].device
    note = (f"{profile.name} with its device terms x {factor:.3f} (the step parts' device times, {device} / "
            f"{profile.device}) and {device}'s copy speed; host, slides and swap as fitted; no {device} engine run used")
    return profile.scaled(name, device, factor, statistics.mean(copies), note)


def compare(profile: GpuProfile, runs: list[RawRun], bursts: Bursts) -> list[dict]:
    """Per run and policy: measured and replayed tok/s (and odma ÷ paged where both ran)."""
    rows = []
    for run in runs:
        replayed = {}
        for policy, measured in run.policies.items():
            burst = bursts[run.burst_key][policy]
            parts = profile.breakdown(burst.steps, burst.paged)
            tps = burst.output_tokens / parts["seconds"]
            replayed[policy] = tps
            rows.append({"run": run.name, "device": run.device, "policy": policy,
                         "measured_tps": measured["tokens_per_s"], "replayed_tps": round(tps, 1),
                         "error": round(tps / measured["tokens_per_s"] - 1, 4),
                         "measured_p50_ms": measured.get("device_ms_p50"),
                         "replayed_p50_ms": round(profile.device_p50_ms(burst.steps, burst.paged), 3),
                         **{k: round(v, 2) for k, v in parts.items()}})
        for odma in ("odma", "odma-continue"):
            if odma in run.policies and "paged" in run.policies:
                m = run.policies[odma]["tokens_per_s"] / run.policies["paged"]["tokens_per_s"]
                r = replayed[odma] / replayed["paged"]
                rows.append({"run": run.name, "device": run.device, "policy": f"{odma}/paged",
                             "measured_tps": round(m, 3), "replayed_tps": round(r, 3), "error": round(r / m - 1, 4)})
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = ["| run | policy | measured tok/s | replayed tok/s | error | device p50 ms (measured / replayed) |",
             "|---|---|---:|---:|---:|---|"]
    for r in rows:
        p50 = f"{r['measured_p50_ms']} / {r['replayed_p50_ms']}" if r.get("measured_p50_ms") else ""
        lines.append(f"| {r['run']} ({r['device']}) | {r['policy']} | {r['measured_tps']} | {r['replayed_tps']} | "
                     f"{100 * r['error']:+.1f} % | {p50} |")
    return "\n".join(lines)
