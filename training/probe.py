"""`odma-train --model probe`: fit the served model's own length probe (predictor/probe) on a trace.

Prompt-end states of every layer come from the served model's prefill (cached per model and prompt), so the
layer is chosen by measurement: the one whose ridge ranks a holdout of the training split best (Spearman),
unless `--probe-layer` fixes it. With answer texts in the trace (`output`), the decode-time head is fitted too,
from teacher-forced states at generated positions (predictor/probe/teacher.py), on the remaining length.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from odma.config import default_cache_dir
from odma.errors import PredictorError
from predictor.base import Manifest
from predictor.features import MetadataEncoder
from predictor.probe.fit import fit_length_head, fit_ridge
from predictor.probe.predictor import ProbePredictor, refine_features, remaining_median

REFINE_REPORT_POINTS = (8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class ProbeOptions:
    served_model: str = "smollm2"
    dtype: str = "float32"
    layer: int | None = None  # None: chosen on a holdout of train
    refine_layer: int | None = None  # None: the prompt layer
    refine_every: int = 16  # the decode period the engine is told to refine at
    refine: bool = True  # fit the decode-time head when the trace has answer texts
    seed: int = 0


def serving_metadata(records: Sequence) -> MetadataEncoder:
    """The metadata encoder without the trace's `type` field: the engine never passes one (RequestTags), so a
    head that leaned on it would read an all-zero block in serving."""
    fitted = MetadataEncoder.fit(records)
    return MetadataEncoder({k: v for k, v in fitted.vocab.items() if k != "type"}, fitted.numeric,
                           fitted.log_length_scale)


def choose_layer(states: np.ndarray, meta: np.ndarray, lengths: np.ndarray, cap: int, seed: int = 0,
                 holdout: float = 0.2) -> tuple[int, list[float]]:
    """The layer whose ridge ranks a random holdout of these rows best (Spearman), and every layer's score."""
    from scipy.stats import spearmanr

    perm = np.random.default_rng(seed).permutation(len(states))
    n_hold = max(5, int(len(states) * holdout))
    hold, fit = perm[:n_hold], perm[n_hold:]
    y = np.log1p(np.minimum(lengths, cap))
    scores = []
    for layer in range(states.shape[1]):
        x = np.hstack([states[:, layer].astype(np.float32), meta])
        head = fit_ridge(x[fit], y[fit], seed=seed)
        scores.append(float(spearmanr(head.predict(x[hold]), y[hold])[0]))
    return int(np.nanargmax(scores)), scores


def train_probe(opts: ProbeOptions, trace, train_t, val_t, y_train: np.ndarray, stats, out: Path,
                progress: bool = True, log=print) -> ProbePredictor:
    from predictor.probe.hidden import ServedModelStates
    from predictor.probe.identity import model_identity
    from predictor.probe.state_cache import StateCache, prompt_states

    states_model = ServedModelStates.load(opts.served_model, opts.dtype)
    identity = model_identity(states_model.model)
    cache = StateCache(default_cache_dir(), identity)
    states = prompt_states(states_model, [r.prompt for r in train_t.records], cache, progress=progress)
    metadata = serving_metadata(train_t.records)
    meta = metadata.encode(train_t.records)
    layer_scores = None
    if opts.layer is None:
        layer, layer_scores = choose_layer(states, meta, y_train, stats.cap, opts.seed)
        log(f"probe layer {layer} (holdout Spearman by layer: {[round(s, 3) for s in layer_scores]})")
    else:
        layer = opts.layer
        if not 0 <= layer < states.shape[1]:
            raise PredictorError(f"--probe-layer must be in [0, {states.shape[1] - 1}], got {layer}")
    head = fit_length_head(np.hstack([states[:, layer], meta]), y_train, stats.cap, seed=opts.seed)
    refine_layer = layer if opts.refine_layer is None else opts.refine_layer
    refine_head, n_refine = None, 0
    if opts.refine and any(getattr(r, "output", None) for r in train_t.records):
        rows = _decode_rows(states_model, identity, train_t.records, progress)
        if len(rows.remaining) >= 50:
            x = refine_features(rows.states[:, refine_layer].astype(np.float32), rows.generated,
                                meta[rows.record])
            refine_head = fit_length_head(x, rows.remaining, stats.cap, seed=opts.seed)
            n_refine = len(rows.remaining)
            log(f"decode-time head on {n_refine} teacher-forced points of "
                f"{len(np.unique(rows.record))} answers (layer {refine_layer})")
    settings = {
        "model": "probe", "served_model": opts.served_model, "dtype": opts.dtype, "model_identity": identity,
        "model_name": Path(str(opts.served_model)).name, "layer": layer, "pooling": "last prompt token",
        "hidden_size": states_model.hidden_size, "num_layers": states_model.num_layers,
        "refine_layer": refine_layer if refine_head is not None else None, "refine_every": opts.refine_every,
        "n_refine_rows": n_refine, "layer_scores": layer_scores, "train_stats": stats.to_json(),
        "trace": trace.name, "n_train": len(train_t), "meta_dim": metadata.size,
        "length_target": "log(1 + output tokens), ridge; u = 1 - exp(-predicted |log error|)",
    }
    predictor = ProbePredictor(head, metadata, settings, refine_head)
    manifest = Manifest("probe", None, {})
    predictor.save(out, manifest)
    predictor.manifest = Manifest.load(out)
    predictor.folder = out
    predictor.attach_model(states_model, default_cache_dir())
    return predictor


def _decode_rows(states_model, identity: str, records: Sequence, progress: bool):
    from predictor.probe.teacher import TeacherCache, decode_rows

    return decode_rows(states_model, records, TeacherCache(default_cache_dir(), identity), progress=progress)


def refine_report(predictor: ProbePredictor, records: Sequence, prompt_lengths: np.ndarray,
                  train_lengths: np.ndarray, cap: int, progress: bool = False) -> dict | None:
    """Remaining-length MAE at each report point j on the records still running there: the decode-time head,
    the prompt-time L̂ (remaining = max(L̂, j + 1) − j) and predict-the-median (of the training lengths still
    running at j). None without a decode head or answers."""
    if predictor.refine_head is None or predictor._states is None:
        return None
    from predictor.probe.identity import model_identity

    rows = _decode_rows(predictor._states, model_identity(predictor._states.model), records, progress)
    if not len(rows.remaining):
        return None
    meta = predictor.metadata.encode(records)
    refined, _ = predictor.refine_head.predict(refine_features(
        rows.states[:, predictor.refine_layer].astype(np.float32), rows.generated, meta[rows.record]))
    realized = np.minimum(np.array([r.output_tokens for r in records]), cap)
    train_lengths = np.minimum(train_lengths, cap)
    out = {}
    for j in REFINE_REPORT_POINTS:
        at = rows.generated == j
        if at.sum() < 5:
            continue
        truth = np.minimum(rows.remaining[at], cap - j)
        from_prompt = np.maximum(prompt_lengths[rows.record[at]], j + 1) - j
        out[str(j)] = {
            "n": int(at.sum()),
            "refined_mae": round(float(np.mean(np.abs(refined[at] - truth))), 2),
            "prompt_time_mae": round(float(np.mean(np.abs(from_prompt - truth))), 2),
            "median_mae": round(float(np.mean(np.abs(remaining_median(train_lengths, j) - truth))), 2),
            "refined_spearman": _spearman(refined[at], truth),
            "prompt_time_spearman": _spearman(from_prompt, truth),
        }
    alive = realized > 0
    out["prompt_time_mae_all"] = round(float(np.mean(np.abs(prompt_lengths[alive] - realized[alive]))), 2)
    return out


def _spearman(a: np.ndarray, b: np.ndarray) -> float | None:
    from scipy.stats import spearmanr

    if len(a) < 3 or np.all(a == a[0]) or np.all(b == b[0]):
        return None
    return round(float(spearmanr(a, b)[0]), 4)
