"""Why long requests can wait longer with ballooning on (docs/BENCHMARKS.md, "Ballooning"): the step-time model
of `odma-bench balloon` on nine workloads, three ways.

    .venv/bin/python scripts/studies/balloon_long_ttft.py     # under a minute

- as measured: the defaults (CPU decode steps that grow with the batch);
- no activation wait: a prefill never waits for lent activation room (as if long prompts were prefilled in
  chunks of the room that is never lent), to see how much of the wait is the reclaim;
- flat decode steps: a decode step costs the same at any batch (as on a bandwidth-bound accelerator).

Prints one Markdown row per workload and variant: peak batch off → on and the long requests' median TTFT.
"""

from __future__ import annotations

import argparse
from unittest import mock

from odma.bench import balloon_bench
from odma.kv import ElasticKV

WORKLOADS = [(f"L={n} seed {s}", ["--num-long", str(n), "--seed", str(s), "--max-num-seqs", "128"])
             for n in (4, 8) for s in (0, 1, 2)]
WORKLOADS += [(f"192 short, seed {s}", ["--num-long", "4", "--num-short", "192", "--rate", "8", "--seed", str(s),
                                        "--max-num-seqs", "256"]) for s in (0, 1, 2)]
FLAT_STEPS = "1:62,256:70"  # ms per decode step by batch: the batch-1 cost at every batch


_need = ElasticKV._need


def no_activation_wait(self: ElasticKV, prefill_tokens: int) -> int:
    return min(_need(self, prefill_tokens), self.keep_bytes)


def run(extra: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    balloon_bench.add_arguments(parser)
    return balloon_bench.run(parser.parse_args(extra))


def main() -> None:
    print("| workload | variant | peak batch off → on | long TTFT p50 off → on (s) | ratio |")
    print("|---|---|---|---|---|")
    for name, args in WORKLOADS:
        for variant in ("as measured", "no activation wait", "flat decode steps"):
            if variant == "no activation wait":
                with mock.patch.object(ElasticKV, "_need", no_activation_wait):
                    d = run(args)
            else:
                d = run(args + (["--step-ms", FLAT_STEPS] if variant == "flat decode steps" else []))
            off, on = d["runs"]
            print(f"| {name} | {variant} | {off['peak_running']} → {on['peak_running']} "
                  f"| {off['ttft_long_p50_s']:.0f} → {on['ttft_long_p50_s']:.0f} | {d['ttft_long_p50_ratio']:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
