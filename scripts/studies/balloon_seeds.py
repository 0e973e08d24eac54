"""Ballooning off vs on over many seeds of the step-time model (docs/BENCHMARKS.md, "Ballooning"): with four
long prompts per run, one run's long-request median TTFT is the mean of two requests, so single runs swing
by ±30 % on ordering alone. This pools them.

    .venv/bin/python scripts/studies/balloon_seeds.py [--seeds 10] [--runs] [odma-bench balloon flags ...]   # about a minute

Three workload families (the six-run table's L = 4 and L = 8 with max-num-seqs 128, and the 192-short one),
each over seeds 0..N-1, with the given flags on both sides. Prints one Markdown row per family (`--runs`: and a line
per run after it).
"""

from __future__ import annotations

import argparse
import statistics
import sys

from odma.bench import balloon_bench

FAMILIES = {
    "L=4, 96 short": ["--num-long", "4", "--max-num-seqs", "128"],
    "L=8, 96 short": ["--num-long", "8", "--max-num-seqs", "128"],
    "L=4, 192 short at 8/s": ["--num-long", "4", "--num-short", "192", "--rate", "8", "--max-num-seqs", "256"],
}


def main(argv: list[str]) -> None:
    top = argparse.ArgumentParser()
    top.add_argument("--seeds", type=int, default=10)
    top.add_argument("--runs", action="store_true", help="also print each run's numbers")
    ours, extra = top.parse_known_args(argv)
    print("| workload | runs | peak batch ≥ 1.5× | peak batch ratio, median | throughput ratio, median "
          "| long TTFT p50 ratio, median | runs with long p50 > +5 % | pooled long TTFT mean off → on s "
          "| short TTFT p50 ratio, median | runs meeting the target |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, args in FAMILIES.items():
        rows = []
        for seed in range(ours.seeds):
            p = argparse.ArgumentParser()
            balloon_bench.add_arguments(p)
            rows.append(balloon_bench.run(p.parse_args(args + ["--seed", str(seed)] + extra)))
        med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
        off_long = statistics.mean(r["runs"][0]["ttft_long_mean_s"] for r in rows)
        on_long = statistics.mean(r["runs"][1]["ttft_long_mean_s"] for r in rows)
        print(f"| {name} | {len(rows)} | {sum(r['peak_batch_ratio'] >= 1.5 for r in rows)} "
              f"| {med('peak_batch_ratio'):.2f} | {med('throughput_ratio'):.2f} | {med('ttft_long_p50_ratio'):.2f} "
              f"| {sum(r['ttft_long_p50_ratio'] > 1.05 for r in rows)} | {off_long:.0f} → {on_long:.0f} "
              f"| {med('ttft_short_p50_ratio'):.2f} | {sum(_meets(r) for r in rows)} |", flush=True)
        for seed, r in enumerate(rows if ours.runs else []):
            off, on = r["runs"]
            print(f"  seed {seed}: peak {off['peak_running']} → {on['peak_running']} ({r['peak_batch_ratio']:.2f}), "
                  f"long TTFT p50 {off['ttft_long_p50_s']:.0f} → {on['ttft_long_p50_s']:.0f} s "
                  f"({r['ttft_long_p50_ratio']:.2f}), short p50 ratio {r['ttft_short_p50_ratio']:.2f}, "
                  f"throughput ratio {r['throughput_ratio']:.2f}, stalls {off['stalls']} → {on['stalls']}"
                  f"{', meets the target' if _meets(r) else ''}", flush=True)


def _meets(r: dict) -> bool:
    """The ballooning target in one run: >= 1.5x peak batch, and neither median TTFT more than 5 % worse."""
    return r["peak_batch_ratio"] >= 1.5 and r["ttft_long_p50_ratio"] <= 1.05 and r["ttft_short_p50_ratio"] <= 1.05


if __name__ == "__main__":
    main(sys.argv[1:])
