"""Between a request and the pool: the length predictor's tag (L̂, u, the bucket it selects), and what the
predictor learns when a request finishes. Nothing a predictor returns can fail a step."""

from __future__ import annotations

import logging
import time
from typing import Any

from odma.engine.length_predictor import LoadedPredictor, RunningMedian, usable_prediction
from odma.engine.sequence import Sequence
from odma.errors import OdmaError
from odma.kv import ReservationPolicy

log = logging.getLogger(__name__)


class LengthTagger:
    def __init__(self, predictor: LoadedPredictor, policy: ReservationPolicy, generator: str, metrics: Any,
                 growth_hint: bool = False) -> None:
        self.predictor = predictor
        self.policy = policy
        # the first growth goes straight to the block that holds L̂ (a probe, when on, later refines this hint)
        self.growth_hint = growth_hint
        self.generator = generator  # the predictor's `generator` field: whose lengths these are
        self.metrics = metrics
        self.rejected = 0  # predictions not finite or out of range: those requests reserved the worst case

    def tag(self, seqs: list[Sequence]) -> None:
        """Predict (L̂, u) for the new requests in one batch (a request that brings a prediction made upstream, e.g.
        at a cluster's router, keeps it) and record the bucket each selects. An unusable prediction (not finite,
        negative) or a failing call leaves the request untagged: it reserves for the worst case."""
        given = {id(s): s.tags.prediction for s in seqs if s.tags is not None and s.tags.prediction is not None}
        todo = [s for s in seqs if id(s) not in given]
        predicted = iter(self._predict(todo) if todo else ())
        preds = [given[id(s)] if id(s) in given else next(predicted) for s in seqs]
        select = getattr(self.policy, "select", None)  # bucketed policies: the bucket reserve() will pick
        for seq, pred in zip(seqs, preds):
            checked = usable_prediction(pred)
            if checked is None:
                if pred is not None and pred[0] is not None:
                    self.rejected += 1
                    log.warning("length predictor returned %r for %s; it reserves for the worst case", pred, seq.request_id)
                continue
            if select is not None:
                try:
                    seq.bucket = select(checked[0], checked[1]).index
                except OdmaError as exc:
                    self.rejected += 1
                    log.warning("prediction %r for %s not usable (%s); it reserves for the worst case", pred,
                                seq.request_id, exc)
                    continue
            seq.predicted_length = seq.predicted_tokens = checked[0]
            seq.uncertainty = checked[1]
            if self.growth_hint:
                seq.growth_hint = checked[0]

    def _predict(self, seqs: list[Sequence]) -> list:
        requests = [s.predict_request(self.generator) for s in seqs]
        start = time.perf_counter()
        try:
            preds = list(self.predictor.predictor.predict(requests))
            if len(preds) != len(seqs):
                raise ValueError(f"{len(preds)} predictions for {len(seqs)} requests")
        except Exception:  # noqa: BLE001 - a failing predictor must not lose requests: reserve for the worst case
            log.exception("length predictor failed; these requests go to the large bucket")
            preds = [None] * len(seqs)
        self.metrics.on_predict(time.perf_counter() - start, len(seqs))
        return preds

    def learn(self, seq: Sequence) -> None:
        """A request finished with a realized length."""
        if isinstance(self.predictor.predictor, RunningMedian):
            self.predictor.predictor.observe(seq.num_generated)
