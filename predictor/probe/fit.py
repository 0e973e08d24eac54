"""The probe's heads: standardized ridge regressions, fitted in closed form (a refit takes milliseconds, so the
online loop can afford one every few hundred completions without a training framework).

`LengthHead` = a ridge on log(1 + L) (the length), plus a ridge on the absolute log error of out-of-fold
predictions (the uncertainty: u = 1 − exp(−predicted |log error|), in [0, 1), larger where the length head
has been wrong by more on similar requests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from odma.errors import PredictorError

RIDGE_GRID = (0.1, 1.0, 10.0, 100.0, 1000.0, 10000.0)  # relative to the number of samples' scale: see fit_ridge


@dataclass(frozen=True)
class LinearHead:
    """y ≈ ((x − mean) / scale) · weight + bias."""

    mean: np.ndarray
    scale: np.ndarray
    weight: np.ndarray
    bias: float
    ridge: float

    def predict(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != len(self.weight):
            raise PredictorError(f"probe head expects [n, {len(self.weight)}] features, got {list(x.shape)}")
        return ((x - self.mean) / self.scale) @ self.weight + self.bias

    def tensors(self, prefix: str) -> dict[str, np.ndarray]:
        return {f"{prefix}.mean": self.mean.astype(np.float32), f"{prefix}.scale": self.scale.astype(np.float32),
                f"{prefix}.weight": self.weight.astype(np.float32),
                f"{prefix}.bias_ridge": np.array([self.bias, self.ridge], np.float32)}

    @classmethod
    def from_tensors(cls, t: dict[str, np.ndarray], prefix: str) -> "LinearHead":
        try:
            mean, scale, weight = (np.asarray(t[f"{prefix}.{k}"], np.float32) for k in ("mean", "scale", "weight"))
            bias, ridge = (float(v) for v in np.asarray(t[f"{prefix}.bias_ridge"]).reshape(2))
        except (KeyError, ValueError, TypeError) as exc:
            raise PredictorError(f"probe head {prefix!r} is missing or malformed: {exc}") from None
        if not (mean.shape == scale.shape == weight.shape) or mean.ndim != 1:
            raise PredictorError(f"probe head {prefix!r}: mismatched shapes {mean.shape}, {scale.shape}, {weight.shape}")
        if not (np.all(np.isfinite(weight)) and np.all(np.isfinite(mean)) and np.all(scale > 0) and math.isfinite(bias)):
            raise PredictorError(f"probe head {prefix!r} holds non-finite values")
        return cls(mean, scale, weight, bias, ridge)


def _standardize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mean = x.mean(0)
    scale = x.std(0)
    return mean.astype(np.float32), np.where(scale > 1e-6, scale, 1.0).astype(np.float32)


def _solve(z: np.ndarray, y: np.ndarray, ridges: tuple[float, ...]) -> list[tuple[np.ndarray, float]]:
    """Ridge solutions on centred z, y for each strength (one eigendecomposition of zᵀz serves them all)."""
    y_mean = float(y.mean())
    gram = z.T.astype(np.float64) @ z.astype(np.float64)
    vals, vecs = np.linalg.eigh(gram)
    proj = vecs.T @ (z.T.astype(np.float64) @ (y - y_mean))
    return [((vecs @ (proj / (vals + lam))).astype(np.float32), y_mean) for lam in ridges]


def fit_ridge(x: np.ndarray, y: np.ndarray, ridges: tuple[float, ...] = RIDGE_GRID, holdout: float = 0.15,
              seed: int = 0) -> LinearHead:
    """Standardize, choose the ridge strength on a random holdout of the data (squared error), refit on all.
    Strengths are per sample (λ·n), so the same grid fits a window of 300 and a training set of 30,000."""
    x = np.asarray(x, dtype=np.float32)
    y = np.asarray(y, dtype=np.float64)
    if len(x) < 2 or x.ndim != 2 or len(x) != len(y):
        raise PredictorError(f"ridge needs at least 2 rows of [n, d] features and n targets, got {x.shape}, {y.shape}")
    mean, scale = _standardize(x)
    z = (x - mean) / scale
    best = ridges[0]
    n_hold = int(round(len(x) * holdout))
    if len(ridges) > 1 and n_hold >= 5 and len(x) - n_hold >= 5:
        perm = np.random.default_rng(seed).permutation(len(x))
        hold, fit = perm[:n_hold], perm[n_hold:]
        zf_mean = z[fit].mean(0)
        errors = []
        for (w, b), lam in zip(_solve(z[fit] - zf_mean, y[fit], tuple(r * len(fit) / 1000 for r in ridges)), ridges):
            pred = (z[hold] - zf_mean) @ w + b
            errors.append(float(np.mean((pred - y[hold]) ** 2)))
        best = ridges[int(np.argmin(errors))]
    z_mean = z.mean(0)
    (w, b), = _solve(z - z_mean, y, (best * len(x) / 1000,))
    # fold the centring into the bias: predict() only standardizes
    return LinearHead(mean, scale, w, float(b - z_mean @ w), best)


@dataclass(frozen=True)
class LengthHead:
    """log(1 + L) and the uncertainty u from one feature row."""

    length: LinearHead
    error: LinearHead | None  # None: u = 0 (no error model, e.g. too few samples)
    max_log_length: float  # predictions are clipped to [0, this] (the length cap)

    def predict(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        log_len = np.clip(self.length.predict(x), 0.0, self.max_log_length)
        if self.error is None:
            return np.maximum(np.expm1(log_len), 1.0), np.zeros(len(log_len))
        err = np.maximum(self.error.predict(x), 0.0)
        return np.maximum(np.expm1(log_len), 1.0), 1.0 - np.exp(-err)

    def tensors(self, prefix: str) -> dict[str, np.ndarray]:
        out = self.length.tensors(f"{prefix}.length")
        if self.error is not None:
            out.update(self.error.tensors(f"{prefix}.error"))
        out[f"{prefix}.max_log_length"] = np.array([self.max_log_length], np.float32)
        return out

    @classmethod
    def from_tensors(cls, t: dict[str, np.ndarray], prefix: str) -> "LengthHead":
        error = LinearHead.from_tensors(t, f"{prefix}.error") if f"{prefix}.error.weight" in t else None
        if f"{prefix}.max_log_length" not in t:
            raise PredictorError(f"probe head {prefix!r} has no max_log_length")
        return cls(LinearHead.from_tensors(t, f"{prefix}.length"), error, float(t[f"{prefix}.max_log_length"][0]))


def fit_length_head(x: np.ndarray, lengths: np.ndarray, cap: int, folds: int = 5, seed: int = 0) -> LengthHead:
    """The length ridge on all rows; the error ridge on out-of-fold |log errors| (what the length head gets
    wrong on rows it did not see), when there are enough rows for folds."""
    y = np.log1p(np.minimum(np.asarray(lengths, dtype=np.float64), cap))
    length = fit_ridge(x, y, seed=seed)
    error = None
    if len(x) >= 10 * folds:
        fold = np.random.default_rng(seed + 1).permutation(len(x)) % folds
        oof = np.zeros(len(x))
        for k in range(folds):
            part = fit_ridge(x[fold != k], y[fold != k], ridges=(length.ridge,))
            oof[fold == k] = part.predict(x[fold == k])
        error = fit_ridge(x, np.abs(np.clip(oof, 0, math.log1p(cap)) - y), seed=seed)
    return LengthHead(length, error, math.log1p(cap))
