"""Batch-1 latency and batched throughput of a length predictor (the default one unless told otherwise)."""

from __future__ import annotations

import argparse
import os


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--predictor", default="default",
                   help="default, sklearn, oracle, noisy-oracle:SIGMA, or a predictor folder")
    p.add_argument("--trace", default="sharegpt", help="requests to time (their prompts, as served)")
    p.add_argument("--requests", type=int, default=1024, help="requests in the batched throughput run")
    p.add_argument("--single", type=int, default=300, help="one-request calls timed for the latency percentiles")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="onnxruntime intra-op threads")


def run(args: argparse.Namespace) -> dict:
    os.environ["ODMA_PREDICTOR_THREADS"] = str(args.threads)
    from odma.traces import load_trace
    from predictor import load_predictor
    from predictor.latency import measure

    predictor = load_predictor(args.predictor)
    records = load_trace(args.trace, limit=max(args.requests, args.single)).records
    result = measure(predictor, records, n_single=args.single, batch=args.batch, max_batched=args.requests)
    return {"predictor": args.predictor, "name": predictor.name, "trace": args.trace, "threads": args.threads,
            "load_average_1m": round(os.getloadavg()[0], 2), **result}
