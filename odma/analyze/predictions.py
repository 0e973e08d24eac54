"""Predicted lengths for a workload, from the project's predictor interface (`predictor.load_predictor`).

Predictions are made once per workload and shared by every policy that uses the predictor, so all
policies see the same (L̂, u) for the same request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from odma.analyze.workload import Workload
from odma.config import ReservationTable
from odma.errors import PredictorError


@dataclass(frozen=True, slots=True)
class Predictions:
    source: str  # the predictor spec that produced them
    lengths: tuple[float, ...]  # L̂ per workload item
    uncertainties: tuple[float, ...]  # u per workload item
    alpha: float | None = None  # the predictor's own calibration, when it has one
    tau: float | None = None
    ceiling: float | None = None
    table: ReservationTable | None = None
    # the predictor's calibrated reservation: L̂, u → a bucket manager whose `select` is the allocator's choice
    # at the calibrated under-prediction target (growth hints read its bound); None without a calibration
    calibrated: Any = None

    def summary(self, workload: Workload) -> dict:
        """How far L̂ is from the realized (clipped) lengths."""
        n = len(self.lengths)
        if n == 0:
            return {"source": self.source}
        logs = [abs(math.log(max(p, 1.0) / it.output_tokens)) for p, it in zip(self.lengths, workload.items)]
        under = sum(p < it.output_tokens for p, it in zip(self.lengths, workload.items))
        return {
            "source": self.source,
            "mean_abs_log_error": round(sum(logs) / n, 4),
            "under_prediction_rate": round(under / n, 4),
            "mean_uncertainty": round(sum(self.uncertainties) / n, 4),
            "alpha": self.alpha,
            "tau": None if self.tau is None or math.isinf(self.tau) else self.tau,  # JSON has no infinity
            "ceiling": None if self.ceiling is None or math.isinf(self.ceiling) else self.ceiling,
            "table": None if self.table is None else self.table.to_json(),
        }


def oracle_predictions(workload: Workload) -> Predictions:
    """The realized length itself (clipped to max_new_tokens), u = 0."""
    return Predictions("oracle", tuple(float(i.output_tokens) for i in workload.items), (0.0,) * len(workload.items))


def predict(workload: Workload, spec: str) -> Predictions:
    """L̂, u for every item from `predictor.load_predictor(spec)` (PATH | default | sklearn | oracle |
    noisy-oracle:SIGMA)."""
    if spec == "oracle":
        return oracle_predictions(workload)
    try:
        from predictor import load_predictor
    except ImportError as exc:  # the predictor package is optional for the replay's own baselines
        raise PredictorError(f"predictor {spec!r} needs the predictor package: {exc}") from exc
    try:
        model = load_predictor(spec)
    except ImportError as exc:
        raise PredictorError(f"predictor {spec!r} is not available: {exc}") from exc
    if spec.startswith("noisy-oracle"):  # its noise is drawn per request id: every tiled copy differs
        preds = model.predict([item.record for item in workload.items])
    else:  # a real predictor reads only the request's content: predict each distinct record once
        first: dict[int, int] = {}
        for i, item in enumerate(workload.items):
            first.setdefault(item.source_index, i)
        unique = model.predict([workload.items[i].record for i in first.values()])
        if len(unique) != len(first):
            raise PredictorError(f"predictor {spec!r} returned {len(unique)} predictions for {len(first)} requests")
        by_source = dict(zip(first, unique))
        preds = [by_source[item.source_index] for item in workload.items]
    if len(preds) != len(workload.items):
        raise PredictorError(f"predictor {spec!r} returned {len(preds)} predictions for {len(workload.items)} requests")
    cal = getattr(model, "calibration", None)
    return Predictions(
        source=getattr(model, "name", spec) if spec.startswith("noisy") else spec,
        lengths=tuple(max(0.0, float(p[0])) for p in preds),
        uncertainties=tuple(min(1.0, max(0.0, float(p[1]))) for p in preds),
        alpha=None if cal is None else cal.alpha,
        tau=None if cal is None else cal.tau,
        ceiling=None if cal is None else cal.ceiling,
        table=None if cal is None else cal.table,
        calibrated=None if cal is None else cal.bucket_manager(),
    )
