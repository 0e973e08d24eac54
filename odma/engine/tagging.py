"""Between a request and the pool: the length predictor's tag (L̂, u, the bucket it selects), and what the
predictor learns when a request finishes. Nothing a predictor returns can fail a step (predictor.serving)."""

from __future__ import annotations

import logging
from typing import Any

from odma.engine.length_predictor import LoadedPredictor
from odma.engine.sequence import Sequence
from odma.errors import OdmaError
from odma.kv import ReservationPolicy
from predictor.serving import ServedPredictor

log = logging.getLogger(__name__)


class LengthTagger:
    def __init__(self, predictor: LoadedPredictor, policy: ReservationPolicy, generator: str, metrics: Any,
                 growth_hint: bool = False) -> None:
        self._loaded = predictor
        self.served = ServedPredictor(predictor.predictor, on_call=metrics.on_predict)
        self.policy = policy
        # the first growth goes straight to the block that holds L̂ (a probe, when on, later refines this hint)
        self.growth_hint = growth_hint
        self.generator = generator  # the predictor's `generator` field: whose lengths these are
        self.metrics = metrics
        self.unselectable = 0  # usable predictions the policy could not place in a bucket

    @property
    def predictor(self) -> LoadedPredictor:
        return self._loaded

    @predictor.setter
    def predictor(self, loaded: LoadedPredictor) -> None:
        self._loaded = loaded
        self.served.predictor = loaded.predictor

    @property
    def rejected(self) -> int:
        """Predictions not finite, out of range or not selectable: those requests reserved the worst case."""
        return self.served.rejected + self.unselectable

    def tag(self, seqs: list[Sequence]) -> None:
        """Predict (L̂, u) for the new requests in one batch (a request that brings a prediction made upstream, e.g.
        at a cluster's router, keeps it) and record the bucket each selects. An unusable prediction (not finite,
        negative) or a failing call leaves the request untagged: it reserves for the worst case."""
        todo = [s for s in seqs if s.tags is None or s.tags.prediction is None]
        predicted = iter(self.served.predict([s.predict_request(self.generator) for s in todo],
                                             [s.request_id for s in todo]))
        select = getattr(self.policy, "select", None)  # bucketed policies: the bucket reserve() will pick
        for seq in seqs:
            given = seq.tags.prediction if seq.tags is not None else None
            checked = self.served.usable(given, seq.request_id) if given is not None else next(predicted)
            if checked is None:
                continue
            if select is not None:
                try:
                    seq.bucket = select(checked[0], checked[1]).index
                except OdmaError as exc:
                    self.unselectable += 1
                    log.warning("prediction %r for %s not usable (%s); it reserves for the worst case", checked,
                                seq.request_id, exc)
                    continue
            seq.predicted_length = seq.predicted_tokens = checked[0]
            seq.uncertainty = checked[1]
            if self.growth_hint:
                seq.growth_hint = checked[0]

    def learn(self, seq: Sequence) -> None:
        """A request finished with a realized length: the predictor sees it as it saw the request."""
        self.served.observe(seq.predict_request(self.generator), seq.num_generated)
