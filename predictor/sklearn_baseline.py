"""The tiny fallback: hand-made prompt features + gradient boosting (no encoder, no torch at serving).

L̂: gradient boosting with absolute loss on log(1 + length), i.e. the conditional median (see docs).
u: normalized entropy of a gradient-boosted classifier over the same coarse buckets the encoder uses.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from odma.errors import PredictorError
from predictor.base import Calibration, Manifest, Prediction, Predictor
from predictor.features import MetadataEncoder

MODEL_FILE = "model.joblib"
# Words that announce long or short answers; a cheap stand-in for what the encoder reads.
CUE_WORDS = ("write", "essay", "story", "article", "blog", "explain", "describe", "list", "steps", "code",
             "function", "script", "translate", "summarize", "summary", "rewrite", "poem", "email", "plan",
             "compare", "example", "detail", "what", "who", "when", "which", "how", "why", "yes", "name",
             "one word", "short", "brief", "sentence", "table", "outline", "continue")
QUESTION_STARTS = ("what", "who", "when", "where", "which", "how", "why", "is ", "are ", "do ")
_WORD = re.compile(r"\w+")


def text_features(prompts: Sequence[str | None]) -> np.ndarray:
    rows = []
    for p in prompts:
        p = p or ""
        low = p[:4000].lower()
        words = _WORD.findall(low)
        rows.append([
            math.log1p(len(p)), math.log1p(len(words)), math.log1p(p.count("\n")), float("?" in p),
            sum(c.isdigit() for c in p[:4000]) / max(1, min(len(p), 4000)),
            sum(c in "{}();=<>" for c in p[:4000]) / max(1, min(len(p), 4000)),
            float(low.strip().startswith(QUESTION_STARTS)),
            *(float(w in low) for w in CUE_WORDS),
        ])
    return np.asarray(rows, dtype=np.float32).reshape(len(prompts), -1)


def normalized_entropy(probs: np.ndarray) -> np.ndarray:
    k = probs.shape[1]
    if k < 2:
        return np.zeros(len(probs))
    ent = -(probs * np.log(np.clip(probs, 1e-12, None))).sum(1)
    return np.clip(ent / math.log(k), 0.0, 1.0)


class SklearnPredictor(Predictor):
    name = "sklearn"

    def __init__(self, regressor, classifier, metadata: MetadataEncoder,
                 calibration: Calibration | None = None, manifest: Manifest | None = None) -> None:
        self.regressor = regressor
        self.classifier = classifier
        self.metadata = metadata
        self.calibration = calibration
        self.manifest = manifest

    def features(self, requests: Sequence[Any]) -> np.ndarray:
        return np.hstack([text_features([getattr(r, "prompt", None) for r in requests]),
                          self.metadata.encode(requests)])

    @classmethod
    def fit(cls, requests: Sequence[Any], lengths: np.ndarray, bucket_bounds: tuple[int, ...],
            seed: int = 0) -> "SklearnPredictor":
        from sklearn.ensemble import HistGradientBoostingClassifier, HistGradientBoostingRegressor
        from threadpoolctl import threadpool_limits

        with threadpool_limits(1):  # OpenMP threads spin against each other on a shared 2-core machine
            return cls._fit(requests, lengths, bucket_bounds, seed, HistGradientBoostingRegressor,
                            HistGradientBoostingClassifier)

    @classmethod
    def _fit(cls, requests, lengths, bucket_bounds, seed, HistGradientBoostingRegressor,
             HistGradientBoostingClassifier) -> "SklearnPredictor":
        metadata = MetadataEncoder.fit(requests)
        model = cls(None, None, metadata)
        X = model.features(requests)
        y = np.asarray(lengths, dtype=np.float64)
        model.regressor = HistGradientBoostingRegressor(
            loss="absolute_error", max_iter=300, learning_rate=0.05, max_leaf_nodes=15, min_samples_leaf=30,
            l2_regularization=1.0, early_stopping=True, validation_fraction=0.15, random_state=seed,
        ).fit(X, np.log1p(y))
        labels = np.searchsorted(np.asarray(bucket_bounds), y, side="left")
        model.classifier = HistGradientBoostingClassifier(
            max_iter=150, learning_rate=0.05, max_leaf_nodes=15, min_samples_leaf=30, early_stopping=True,
            validation_fraction=0.15, random_state=seed,
        ).fit(X, labels)
        return model

    def predict(self, requests: Sequence[Any]) -> list[Prediction]:
        if not requests:
            return []
        from threadpoolctl import threadpool_limits

        X = self.features(requests)
        with threadpool_limits(1):
            length = np.expm1(self.regressor.predict(X)).clip(min=1.0)
            unc = normalized_entropy(self.classifier.predict_proba(X))
        return [Prediction(float(a), float(b)) for a, b in zip(length, unc)]

    def save(self, folder: Path, manifest: Manifest) -> None:
        import joblib

        folder.mkdir(parents=True, exist_ok=True)
        joblib.dump({"regressor": self.regressor, "classifier": self.classifier}, folder / MODEL_FILE, compress=3)
        manifest.settings = {**manifest.settings, "metadata": self.metadata.to_json()}
        manifest.save(folder)

    @classmethod
    def load(cls, folder: Path, manifest: Manifest) -> "SklearnPredictor":
        import joblib

        path = Path(folder) / MODEL_FILE
        if not path.exists():
            raise PredictorError(f"{folder}: missing {MODEL_FILE}")
        try:
            parts = joblib.load(path)
            regressor, classifier = parts["regressor"], parts["classifier"]
        except Exception as exc:  # unpickling can fail in many ways; all mean a corrupt checkpoint
            raise PredictorError(f"corrupt sklearn predictor {path}: {exc}") from None
        metadata = MetadataEncoder.from_json(manifest.settings.get("metadata", {}))
        return cls(regressor, classifier, metadata, manifest.calibration, manifest)
