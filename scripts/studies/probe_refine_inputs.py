"""What the decode-time remaining-length head gains from its inputs (docs/predictor.md, "the decode-time
refinement"): on SmolLM2's own answers, teacher-forced (states cached under the cache dir by `odma-train --model
probe`), remaining-length MAE at j generated tokens on the test split for heads fit on the training split with

- `state+meta+t`: the served model's state at the j-th generated token, the metadata and log(1 + j) (the shipped
  head's inputs, `predictor.probe.predictor.refine_features`);
- `lhat+t`: only the prompt-time estimate L̂ (out-of-fold on the training rows) and j;
- `state+meta+t+lhat`: both;

next to the prompt-time estimate itself (remaining = max(L̂, j + 1) − j) and predict-the-median of the training
lengths still running at j.

    .venv/bin/python scripts/studies/probe_refine_inputs.py [--trace smollm2-answers,nq] [--layer 17] [--json F]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

CAP = 512
POINTS = (8, 16, 32, 64, 128, 256)
VARIANTS = ("state+meta+t", "lhat+t", "state+meta+t+lhat")


def main() -> None:
    import torch

    from odma.traces import load_trace, split_trace
    from predictor.probe.fit import fit_length_head
    from predictor.probe.hidden import ServedModelStates
    from predictor.probe.identity import model_identity
    from predictor.probe.predictor import remaining_median
    from predictor.probe.state_cache import StateCache, prompt_states
    from predictor.probe.teacher import TeacherCache, decode_rows
    from training.pipeline import default_cache_dir
    from training.probe import serving_metadata

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default="smollm2-answers,nq")
    p.add_argument("--layer", type=int, default=17, help="the served model's layer (the shipped probe's: 17)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    splits = split_trace(load_trace(args.trace))
    train, test = splits.train.records, splits.test.records
    model = ServedModelStates.load("smollm2", "float32")
    identity = model_identity(model.model)
    states, teacher = StateCache(default_cache_dir(), identity), TeacherCache(default_cache_dir(), identity)
    metadata = serving_metadata(train)

    def prompt_x(records):
        s = prompt_states(model, [r.prompt for r in records], states, progress=False)
        return np.hstack([s[:, args.layer].astype(np.float32), metadata.encode(records)])

    x_train, x_test = prompt_x(train), prompt_x(test)
    y_train = np.array([r.output_tokens for r in train])
    lhat_test = fit_length_head(x_train, y_train, CAP).predict(x_test)[0]
    fold = np.random.default_rng(1).permutation(len(x_train)) % 5  # out-of-fold: L̂ as on unseen prompts
    lhat_train = np.zeros(len(x_train))
    for k in range(5):
        lhat_train[fold == k] = fit_length_head(x_train[fold != k], y_train[fold != k], CAP).predict(x_train[fold == k])[0]
    rows_train, rows_test = decode_rows(model, train, teacher), decode_rows(model, test, teacher)

    def features(rows, records, lhat, variant):
        t = np.log1p(rows.generated.astype(np.float32))[:, None]
        lp = np.log1p(lhat[rows.record]).astype(np.float32)[:, None]
        rest = np.log1p(np.maximum(lhat[rows.record] - rows.generated, 1)).astype(np.float32)[:, None]
        state = rows.states[:, args.layer].astype(np.float32)
        meta = metadata.encode(records)[rows.record]
        return {"state+meta+t": np.hstack([state, meta, t]), "lhat+t": np.hstack([lp, rest, t, lp * t]),
                "state+meta+t+lhat": np.hstack([state, meta, t, lp, rest, lp * t])}[variant]

    lengths = np.minimum(y_train, CAP)
    out = {"trace": args.trace, "layer": args.layer, "train_answers": int(len(np.unique(rows_train.record))),
           "train_points": int(len(rows_train.remaining)), "points": {}}
    predictions = {v: fit_length_head(features(rows_train, train, lhat_train, v), rows_train.remaining, CAP)
                   .predict(features(rows_test, test, lhat_test, v))[0] for v in VARIANTS}
    for j in POINTS:
        at = rows_test.generated == j
        truth = np.minimum(rows_test.remaining[at], CAP - j)
        point = {"n": int(at.sum()),
                 "prompt_time_mae": float(np.mean(np.abs(np.maximum(lhat_test[rows_test.record[at]], j + 1) - j - truth))),
                 "median_mae": float(np.mean(np.abs(remaining_median(lengths, j) - truth)))}
        point |= {f"{v}_mae": float(np.mean(np.abs(pred[at] - truth))) for v, pred in predictions.items()}
        out["points"][str(j)] = {k: round(v, 1) if isinstance(v, float) else v for k, v in point.items()}
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
