"""The heads ablation of docs/predictor.md ("Multi-turn requests"): which head and feature choices make the
earlier replies' lengths count. Heads only, on the frozen encoder's cached embeddings of `sharegpt-chat`.

    .venv/bin/python scripts/studies/heads_ablation.py [--seed 0]

Prints a Markdown table: Spearman on the test split (all, later and first turns) and MAE in tokens.
"""

from __future__ import annotations

import argparse

import numpy as np
from scipy.stats import spearmanr

from odma.traces import load_trace
from predictor.features import MetadataEncoder
from training import data
from training.heads import HeadTraining, fit_heads, predict_heads
from training.pipeline import TrainOptions, embed, embedder

# metadata columns (MetadataEncoder with the current NUMERIC_FIELDS): 0 log prompt tokens, 1–2 temperature,
# 3–4 depth, 5–6 earlier replies' mean length, 7–8 the latest reply's length
LOG_LENGTH_COLUMNS = [0, 6, 8]
REPLY_COLUMNS = slice(5, 9)

VARIANTS = (  # name, log/8 scale (the first heads'), reply lengths, linear metadata path, regression weight
    ("the first heads, no reply lengths", True, False, False, 1.0),
    ("the first heads + reply lengths", True, True, False, 1.0),
    ("+ length features in log units (were log/8)", False, True, False, 1.0),
    ("+ a linear metadata path to log L̂ (`meta_skip`)", False, True, True, 1.0),
    ("+ regression weight 4 (the default now)", False, True, True, 4.0),
    ("the new heads without reply lengths", False, False, True, 4.0),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    train, _, test = data.splits(load_trace("sharegpt-chat"))
    opts = TrainOptions(trace="sharegpt-chat", out=".", progress=True)
    _, tokenizer, encoder, cache = embedder(opts)
    emb = {name: embed(opts, tokenizer, encoder, cache, part.records)
           for name, part in (("train", train), ("test", test))}
    metadata = MetadataEncoder.fit(train.records)
    meta = {"train": metadata.encode(train.records), "test": metadata.encode(test.records)}
    y_train, y_test = (data.capped_lengths(t, data.DEFAULT_MAX_NEW_TOKENS) for t in (train, test))
    later = np.array([(r.depth or 0) > 0 for r in test.records])
    bounds = data.TrainStats.from_lengths(y_train, data.DEFAULT_MAX_NEW_TOKENS, 0.02).bounds
    labels = np.minimum(data.bucket_index(y_train, bounds), len(bounds) - 1)

    print("| heads / features | Spearman all turns | later turns | first turns | MAE |\n|---|---|---|---|---|")
    for name, legacy_scale, replies, skip, weight in VARIANTS:
        m = {k: v.copy() for k, v in meta.items()}
        for v in m.values():
            if legacy_scale:
                v[:, LOG_LENGTH_COLUMNS] /= 8.0
            if not replies:
                v[:, REPLY_COLUMNS] = 0.0
        heads = fit_heads(emb["train"], m["train"], y_train, labels, len(bounds),
                          HeadTraining(regression_weight=weight, meta_skip=skip, seed=args.seed))
        length, _ = predict_heads(heads, emb["test"], m["test"])
        rho = [spearmanr(length[s], y_test[s]).correlation for s in (slice(None), later, ~later)]
        print(f"| {name} | {rho[0]:.3f} | {rho[1]:.3f} | {rho[2]:.3f} | {np.mean(np.abs(length - y_test)):.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
