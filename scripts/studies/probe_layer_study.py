"""Which layer of the served model, and which pooling, predicts its own output length best (docs/predictor.md).

For every prompt of a trace: the residual stream after each decoder layer (0 = embeddings) at the last prompt
token ("last") and averaged over the prompt tokens ("mean"), from odma's own SmolLM2 prefill of the
chat-templated prompt. Then, per layer and pooling, a ridge regression of log(1 + L) on the standardized
state (+ the request metadata), fitted on the train split and scored on the validation split (Spearman, MAE),
with the ridge strength chosen on a slice of train. The test split is not touched.

    .venv/bin/python scripts/studies/probe_layer_study.py --trace nq,datasets/smollm2_answers/answers.jsonl \
        --json runs/probe_layers.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def pooled_states(states_model, prompts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(last, mean): [n, layers + 1, hidden] each."""
    import torch

    model = states_model.model
    n_layers = states_model.num_layers
    last = np.zeros((len(prompts), n_layers + 1, states_model.hidden_size), np.float16)
    mean = np.zeros_like(last)
    seqs = [states_model.prompt_ids(p) for p in prompts]
    for batch in states_model._batches([len(s) for s in seqs]):
        taken: dict[int, torch.Tensor] = {}
        modules = [model.model.embed_tokens, *model.model.layers]
        hooks = [m.register_forward_hook(lambda _m, _i, out, k=k: taken.__setitem__(k, out.float()))
                 for k, m in enumerate(modules)]
        try:
            states_model._forward([seqs[i] for i in batch], None)
        finally:
            for h in hooks:
                h.remove()
        ends = np.cumsum([len(seqs[i]) for i in batch])
        starts = ends - np.array([len(seqs[i]) for i in batch])
        for k in range(n_layers + 1):
            x = taken[k]
            for j, i in enumerate(batch):
                seg = x[starts[j] : ends[j]]
                last[i, k] = seg[-1].numpy()
                mean[i, k] = seg.mean(0).numpy()
    return last, mean


def cached_states(states_model, prompts: list[str], last_cache, mean_cache):
    """Last-token states go to the training pipeline's cache (odma-train --model probe reads them), mean-pooled
    ones to the study's own."""
    _, miss_last = last_cache.lookup(prompts)
    _, miss_mean = mean_cache.lookup(prompts)
    missing = sorted(set(miss_last) | set(miss_mean))
    for s in range(0, len(missing), 256):
        idx = missing[s : s + 256]
        a, b = pooled_states(states_model, [prompts[i] for i in idx])
        last_cache.add([prompts[i] for i in idx], a)
        mean_cache.add([prompts[i] for i in idx], b)
        print(f"  states {min(s + 256, len(missing))}/{len(missing)}", flush=True)
    last, _ = last_cache.lookup(prompts)
    mean, _ = mean_cache.lookup(prompts)
    return np.stack(last), np.stack(mean)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True)
    p.add_argument("--json", type=Path)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache", type=Path, default=Path("runs/probe_study"))
    p.add_argument("--max-new-tokens", type=int, default=512)
    args = p.parse_args(argv)
    import torch
    from scipy.stats import spearmanr

    from predictor.features import MetadataEncoder
    from predictor.probe.fit import fit_ridge
    from odma.config import default_cache_dir
    from predictor.probe.hidden import ServedModelStates
    from predictor.probe.identity import model_identity
    from predictor.probe.state_cache import StateCache
    from training import data

    torch.set_num_threads(args.threads)
    trace = data.load_for_training(args.trace)
    cap = min(args.max_new_tokens, data.length_cap(trace, args.max_new_tokens))
    train_t, val_t, _ = data.splits(trace)
    states_model = ServedModelStates.load("smollm2")
    identity = model_identity(states_model.model)
    last_cache = StateCache(default_cache_dir(), identity)
    mean_cache = StateCache(args.cache, identity + "-mean")
    tr_last, tr_mean = cached_states(states_model, [r.prompt for r in train_t.records], last_cache, mean_cache)
    va_last, va_mean = cached_states(states_model, [r.prompt for r in val_t.records], last_cache, mean_cache)
    y_tr, y_va = data.capped_lengths(train_t, cap), data.capped_lengths(val_t, cap)
    meta = MetadataEncoder.fit(train_t.records)
    m_tr, m_va = meta.encode(train_t.records), meta.encode(val_t.records)
    rows = []
    for pooling, tr, va in (("last", tr_last, va_last), ("mean", tr_mean, va_mean)):
        for layer in range(tr.shape[1]):
            head = fit_ridge(np.hstack([tr[:, layer].astype(np.float32), m_tr]), np.log1p(y_tr))
            pred = np.expm1(head.predict(np.hstack([va[:, layer].astype(np.float32), m_va])))
            rows.append({"pooling": pooling, "layer": layer, "ridge": head.ridge,
                         "spearman": round(float(spearmanr(pred, y_va)[0]), 4),
                         "mae": round(float(np.mean(np.abs(pred - y_va))), 1)})
            print(json.dumps(rows[-1]), flush=True)
    metadata_only = fit_ridge(m_tr, np.log1p(y_tr))
    pred = np.expm1(metadata_only.predict(m_va))
    report = {"trace": trace.name, "n_train": len(train_t), "n_val": len(val_t), "cap": cap, "rows": rows,
              "metadata_only": {"spearman": round(float(spearmanr(pred, y_va)[0]), 4),
                                "mae": round(float(np.mean(np.abs(pred - y_va))), 1)},
              "median_mae": round(float(np.mean(np.abs(np.median(y_tr) - y_va))), 1)}
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
