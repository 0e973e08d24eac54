"""The results table of `odma-bench peer` runs at real model shapes: per system and concurrency, the median over
rounds of guidellm's output tok/s and TTFT p50 (at one stream also the prompt's tokens over its TTFT: the prefill
rate, the 2,048-token run's figure), the server's sampled peak RSS and PSS (its process group, the highest over rounds), and the 1-minute load
average before each round's point. Reads every PEER.json under the folders given (a --repeats run's round-N/), and
the guidellm reports beside it that it does not hold yet (a round cut short by its timeout writes its PEER.json
after each system: those points come without memory or load).

    .venv/bin/python docs/results/cpu_shapes/table.py RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from odma.bench.peer_bench import guidellm_metrics


def rows(folders: list[Path]) -> dict[tuple[str, int], list[dict]]:
    """(system label, concurrency) → one guidellm point per round (failed points kept, with their error)."""
    out: dict[tuple[str, int], list[dict]] = {}
    for folder in folders:
        for path in sorted(folder.rglob("PEER.json")):
            result = json.loads(path.read_text())
            held = set()
            for label, run in result.get("stages", {}).get("guidellm", {}).items():
                for p in run.get("points", [run]):
                    held.add((label, p.get("streams", 0)))
                    out.setdefault((label, p.get("streams", 0)), []).append(
                        {**p, "_server": result.get("servers", {}).get(label, {})})
            for report in sorted((path.parent / "guidellm").glob("*-c*.json")):  # LABEL-cSTREAMS.json
                label, _, streams = report.stem.rpartition("-c")
                if (label, int(streams)) not in held:
                    out.setdefault((label, int(streams)), []).append(
                        {**guidellm_metrics(json.loads(report.read_text())), "_server": {}})
    return out


def table(folders: list[Path]) -> str:
    lines = ["| system | c | out tok/s (median) | rounds | TTFT p50 s (median) | prefill tok/s (median; rounds) "
             "| peak RSS MB | peak PSS MB | load 1m before |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (label, streams), points in sorted(rows(folders).items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ok = [p for p in points if "error" not in p and p.get("output_tps")]
        if not ok:
            lines.append(f"| {label} | {streams} | error: {points[0].get('error', '?')} | | | | | | |")
            continue
        tps = [p["output_tps"] for p in ok]
        ttft = statistics.median(p["ttft_p50_s"] for p in ok)
        rss = max(p.get("server_peak_rss_mb") or p["_server"].get("peak_rss_mb") or 0 for p in ok)
        pss = max(p.get("server_peak_pss_mb") or p["_server"].get("peak_pss_mb") or 0 for p in ok)
        prefill = ""
        if streams == 1 and all(p.get("prompt_tokens_mean") for p in ok):
            rates = [p["prompt_tokens_mean"] / p["ttft_p50_s"] for p in ok]
            prefill = f"{statistics.median(rates):.1f}; {', '.join(f'{r:.1f}' for r in rates)}"
        load = ", ".join(f"{p['load_avg_1m_before']:.1f}" if "load_avg_1m_before" in p else "?" for p in ok)
        lines.append(f"| {label} | {streams} | {statistics.median(tps):.1f} | "
                     f"{', '.join(f'{t:.1f}' for t in tps)} | {ttft:.2f} | {prefill} | {rss:.0f} | {pss:.0f} | {load} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(table([Path(a) for a in sys.argv[1:]]), end="")
