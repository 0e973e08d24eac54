"""Between a request and the pool: the length predictor's tag (L̂, u, the bucket it selects), and what the
predictor learns when a request finishes. Nothing a predictor returns can fail a step (predictor.serving)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from odma.engine.length_predictor import LoadedPredictor
from odma.engine.sequence import Sequence
from odma.engine.tag_ahead import TagAhead
from odma.errors import OdmaError
from odma.kv import ReservationPolicy
from predictor.serving import ServedPredictor

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TagAheadConfig:
    """Tagging ahead's settings (EngineConfig.tag_batch, tag_timeout_s)."""

    max_batch: int  # requests one predictor call tags at most (the first of a burst start sooner)
    timeout_s: float  # a tag later than this after the request arrived is dropped: it goes on untagged


class LengthTagger:
    def __init__(self, predictor: LoadedPredictor, policy: ReservationPolicy, generator: str, metrics: Any,
                 growth_hint: bool = False, ahead: TagAheadConfig | None = None) -> None:
        self._loaded = predictor
        self.served = ServedPredictor(predictor.predictor, on_call=self._on_call)
        self.predict_seconds = 0.0  # host time inside the predictor's calls (one thread calls it at a time)
        self.predicted = 0  # requests asked of the predictor
        # None: requests are tagged inside the engine step (`tag`); else on a worker thread as they arrive
        self.ahead: TagAhead | None = None
        if ahead is not None:
            self.tag_ahead(ahead)
        self.policy = policy
        # the first growth goes straight to the block that holds L̂ (a probe, when on, later refines this hint)
        self.growth_hint = growth_hint
        self.generator = generator  # the predictor's `generator` field: whose lengths these are
        self.metrics = metrics
        self.unselectable = 0  # usable predictions the policy could not place in a bucket

    def _on_call(self, seconds: float, requests: int) -> None:
        self.predict_seconds += seconds
        self.predicted += requests
        self.metrics.on_predict(seconds, requests)

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

    def tag(self, seqs: list[Sequence], asked: list[bool] | None = None) -> None:
        """Predict (L̂, u) for the new requests in one batch (a request that brings a prediction made upstream, e.g.
        at a cluster's router or by `ahead`, keeps it) and record the bucket each selects. An unusable prediction
        (not finite, negative) or a failing call leaves the request untagged: it reserves for the worst case.
        `asked[i]`: the predictor was already asked for seqs[i] (ahead of the loop); without an answer it stays
        untagged rather than being asked again here."""
        asked = asked if asked is not None else [False] * len(seqs)
        todo = [s for s, done in zip(seqs, asked) if not done and (s.tags is None or s.tags.prediction is None)]
        predicted = iter(self.served.predict([s.predict_request(self.generator) for s in todo],
                                             [s.request_id for s in todo]))
        select = getattr(self.policy, "select", None)  # bucketed policies: the bucket reserve() will pick
        for seq, done in zip(seqs, asked):
            given = seq.tags.prediction if seq.tags is not None else None
            if given is not None:
                checked = self.served.usable(given, seq.request_id)
            else:
                checked = None if done else next(predicted)
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
        """A request finished with a realized length: the predictor sees it as it saw the request (on the worker
        thread when tagging ahead: the predictor is never called from two threads)."""
        if self.ahead is not None:
            if self.served.learns:
                self.ahead.learn(seq.predict_request(self.generator), seq.num_generated)
        else:
            self.served.observe(seq.predict_request(self.generator), seq.num_generated)

    def tag_ahead(self, config: TagAheadConfig) -> None:
        """From now on, requests are tagged on a worker thread as they arrive (`ask_ahead`), and finished ones are
        learned from there; call it before any request is added."""
        if self.ahead is None:
            self.ahead = TagAhead(self.served, max_batch=config.max_batch, timeout_s=config.timeout_s)

    def ask_ahead(self, seq: Sequence, waiter: Any) -> None:
        """Have `ahead` predict `seq` (the first sample of `waiter`) off the loop."""
        self.ahead.ask(seq.request_id, seq.predict_request(self.generator), waiter)

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.close()
