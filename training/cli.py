"""odma-train: train, calibrate, evaluate and export a length predictor; or evaluate a saved one."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from odma.errors import OdmaError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="odma-train", description=__doc__)
    p.add_argument("--trace", required=True,
                   help="alpaca, nq, sharegpt, alpaca-eval:<generator>, a JSONL path, or several joined with ','")
    p.add_argument("--out", type=Path, help="output folder (predictor.json, predictor.onnx, report.json)")
    p.add_argument("--model", choices=("encoder", "sklearn", "probe"), default="encoder",
                   help="probe: the served model's own hidden states (predictor/probe)")
    p.add_argument("--probe-layer", type=int, help="--model probe: layer of the served model (default: measured)")
    p.add_argument("--served-model", default="smollm2", help="--model probe: the model whose states are read")
    p.add_argument("--refine-every", type=int, default=16, help="--model probe: decode steps between refinements")
    p.add_argument("--no-refine", action="store_true",
                   help="--model probe: only the prompt-time head (the decode-time head teacher-forces every answer)")
    p.add_argument("--backbone", default="minilm", help="'minilm' (offline default) or a local HF encoder folder")
    p.add_argument("--layers", type=int, default=3,
                   help="keep the first N encoder layers (0 = all); fewer is faster, see docs/predictor.md")
    p.add_argument("--max-len", type=int, default=64, help="encoder tokens per prompt (head and tail kept)")
    p.add_argument("--finetune-layers", type=int, default=0,
                   help="also train the top N encoder layers (slower; 0 = frozen encoder, cached embeddings)")
    p.add_argument("--finetune-epochs", type=int, default=3)
    p.add_argument("--no-quantize", action="store_true", help="export fp32 instead of int8 weights")
    p.add_argument("--target", type=float, default=0.02, help="under-prediction rate α and τ are calibrated for")
    p.add_argument("--table-groups", type=int, default=10,
                   help="L̂ groups of the per-group reservation table calibration may choose (0: only α, τ, ceiling)")
    p.add_argument("--max-new-tokens", type=int, default=2048, help="length cap = the large bucket's bound")
    p.add_argument("--limit", type=int, help="use only the first N requests of the trace")
    p.add_argument("--no-s3-baseline", action="store_true", help="skip training the S3 comparison classifier")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bars or log lines")
    p.add_argument("--eval-only", action="store_true", help="evaluate --predictor on --trace instead of training")
    p.add_argument("--predictor", help="with --eval-only: a predictor folder, 'default', 'sklearn', 'oracle', ...")
    p.add_argument("--split", choices=("all", "train", "val", "test"), default="all",
                   help="with --eval-only: which split of the trace to evaluate on")
    p.add_argument("--json", type=Path, help="also write the report here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        report = _run(args)
    except OdmaError as exc:
        print(f"odma-train: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    keys = ("bucket_accuracy", "s3_bucket_accuracy", "baseline_s3_bucket_accuracy", "majority_s3_bucket_accuracy",
            "mae_tokens", "median_mae_tokens", "spearman", "underprediction_rate", "mean_overreservation",
            "alpha", "tau", "onnx_p50_ms_batch1", "onnx_throughput_rps")
    print(json.dumps({k: report.get(k) for k in keys}, indent=2))
    return 0


def _run(args) -> dict:
    from odma.errors import ConfigError

    if args.eval_only:
        if not args.predictor:
            raise ConfigError("--eval-only needs --predictor")
        from training.pipeline import evaluate_existing

        return evaluate_existing(args.predictor, args.trace, split=args.split, limit=args.limit,
                                 s3_baseline=not args.no_s3_baseline, progress=not args.quiet, threads=args.threads)
    if args.out is None:
        raise ConfigError("training needs --out")
    if not 0 < args.target < 1:
        raise ConfigError(f"--target must be in (0, 1), got {args.target}")
    if args.table_groups < 0:
        raise ConfigError(f"--table-groups must be >= 0, got {args.table_groups}")
    if args.max_len < 8:
        raise ConfigError(f"--max-len must be >= 8, got {args.max_len}")
    from training.pipeline import TrainOptions, train

    return train(TrainOptions(
        trace=args.trace, out=args.out, model=args.model, backbone=args.backbone, layers=args.layers or None,
        max_len=args.max_len, quantize=not args.no_quantize, target=args.target, max_new_tokens=args.max_new_tokens,
        table_groups=args.table_groups, limit=args.limit, s3_baseline=not args.no_s3_baseline, threads=args.threads, seed=args.seed,
        finetune_layers=args.finetune_layers, finetune_epochs=args.finetune_epochs, progress=not args.quiet,
        probe_layer=args.probe_layer, served_model=args.served_model, refine_every=args.refine_every, refine=not args.no_refine))


if __name__ == "__main__":
    sys.exit(main())
