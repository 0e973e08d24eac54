"""The sampling-noise ceiling of predicting one sampled length from the prompt (docs/predictor.md).

The same prompt answered several times by SmolLM2 (datasets/smollm2_answers: `sample` 0..K-1) gives a spread of
lengths that no prompt-time predictor can remove. Two estimates of the best any predictor of a single sampled
length can do, per prompt source and pooled:
- leave-one-out: predict each sample by the median (or mean) of the prompt's OTHER samples: a real predictor
  that knows the prompt's length distribution from K-1 draws (a slight underestimate of the ceiling, since K-1
  draws estimate the median with noise);
- variance components of log(1 + L): the correlation of E[log L | prompt] with one draw is
  sqrt(between-prompt variance / total variance), between estimated without the K-draw noise (the Pearson
  ceiling on log lengths for infinitely many draws).
With --predictor, each named predictor is scored on the same records (prompt-time L̂ of one request per sample).

    .venv/bin/python scripts/studies/noise_ceiling.py --json runs/noise_ceiling.json --predictor probe,default
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
from scipy.stats import pearsonr, spearmanr

DEFAULT = Path(__file__).resolve().parents[2] / "datasets" / "smollm2_answers" / "answers.jsonl"


def groups_of(rows: list[dict], min_samples: int) -> dict[str, list[dict]]:
    by_prompt: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_prompt[r["prompt_id"]].append(r)
    return {k: sorted(v, key=lambda r: r["sample"]) for k, v in by_prompt.items() if len(v) >= min_samples}


def ceiling(groups: dict[str, list[dict]], cap: int) -> dict:
    y, loo_median, loo_mean, group_means, within = [], [], [], [], []
    k_sizes = []
    for samples in groups.values():
        lengths = np.minimum([r["output_tokens"] for r in samples], cap).astype(float)
        for i in range(len(lengths)):
            others = np.delete(lengths, i)
            y.append(lengths[i])
            loo_median.append(np.median(others))
            loo_mean.append(np.mean(others))
        logs = np.log1p(lengths)
        group_means.append(logs.mean())
        within.append(logs.var(ddof=1))
        k_sizes.append(len(lengths))
    y, loo_median, loo_mean = map(np.asarray, (y, loo_median, loo_mean))
    k = float(np.mean(k_sizes))
    within_var = float(np.mean(within))  # per-draw variance of log L around its prompt's mean
    between_var = max(float(np.var(group_means, ddof=1)) - within_var / k, 0.0)
    spread = [np.std(np.log1p(np.minimum([r["output_tokens"] for r in s], cap))) for s in groups.values()]
    ratio = [np.max(np.minimum([r["output_tokens"] for r in s], cap)) / max(1, np.min(
        np.minimum([r["output_tokens"] for r in s], cap))) for s in groups.values()]
    return {
        "prompts": len(groups), "samples_per_prompt": k, "requests": int(len(y)),
        "loo_median_spearman": round(float(spearmanr(loo_median, y)[0]), 4),
        "loo_mean_spearman": round(float(spearmanr(loo_mean, y)[0]), 4),
        "loo_median_mae_tokens": round(float(np.mean(np.abs(loo_median - y))), 1),
        "pooled_median_mae_tokens": round(float(np.mean(np.abs(np.median(y) - y))), 1),
        "log_within_prompt_sd": round(float(np.sqrt(within_var)), 3),
        "log_between_prompt_sd": round(float(np.sqrt(between_var)), 3),
        "pearson_log_ceiling": round(float(np.sqrt(between_var / (between_var + within_var))), 4)
        if between_var + within_var > 0 else None,
        "median_prompt_sd_log": round(float(np.median(spread)), 3),
        "median_max_over_min": round(float(np.median(ratio)), 2),
        "share_hitting_cap": round(float(np.mean(y >= cap)), 4),
    }


def score_predictor(spec: str, rows: list[dict], cap: int) -> dict:
    from types import SimpleNamespace

    from predictor import load_predictor

    predictor = load_predictor(spec)
    requests = [SimpleNamespace(prompt=r["prompt"], prompt_tokens=r["prompt_tokens"], temperature=r["temperature"],
                                generator=r["generator"]) for r in rows]
    if getattr(predictor, "attach_model", None) is not None:  # a probe: prefill states cached on disk
        from odma.config import default_cache_dir
        from predictor.probe.hidden import ServedModelStates

        s = predictor.settings
        predictor.attach_model(ServedModelStates.load(s.get("served_model", "smollm2"), s.get("dtype", "float32")),
                               default_cache_dir())
    pred = np.array([p.length for p in predictor.predict(requests)])
    y = np.minimum([r["output_tokens"] for r in rows], cap).astype(float)
    return {"spearman": round(float(spearmanr(pred, y)[0]), 4), "mae_tokens": round(float(np.mean(np.abs(pred - y))), 1),
            "pearson_log": round(float(pearsonr(np.log1p(pred), np.log1p(y))[0]), 4)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--answers", type=Path, default=DEFAULT)
    p.add_argument("--min-samples", type=int, default=3)
    p.add_argument("--cap", type=int, default=512)
    p.add_argument("--predictor", default="", help="comma-separated predictors to score on the same records")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in args.answers.read_text().splitlines() if line.strip()]
    groups = groups_of(rows, args.min_samples)
    report: dict = {"answers": str(args.answers), "cap": args.cap, "by_source": {}}
    sources = sorted({g[0]["source"] for g in groups.values()})
    report["pooled"] = ceiling(groups, args.cap)
    for src in sources:
        report["by_source"][src] = ceiling({k: g for k, g in groups.items() if g[0]["source"] == src}, args.cap)
    multi_rows = [r for g in groups.values() for r in g]
    for spec in filter(None, args.predictor.split(",")):
        report.setdefault("predictors", {})[spec] = {"pooled": score_predictor(spec, multi_rows, args.cap)}
        for src in sources:
            part = [r for r in multi_rows if r["source"] == src]
            report["predictors"][spec][src] = score_predictor(spec, part, args.cap)
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
