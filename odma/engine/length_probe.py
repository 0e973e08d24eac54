"""The served model's own length probe inside the engine (predictor/probe, predictor/online).

The engine already computes every request's hidden states; the runner hands back the probe's layer at each work
item's last fed position (`ModelRunner.capture_layers`). After a step:
- a request that just finished its prefill (it emits its first token) gets L̂ and u from the probe (the online head
  once it has learned enough, else the shipped one): its predicted length, its predicted remaining work (the sjf
  order and the preemption victim read it) and a growth hint (the block its next growth goes straight to: the
  calibrated reservation for L̂). The row it was predicted from is kept (fp16) for online learning;
- every `refine_every` generated tokens a decoding request's remaining length is refined from its current state,
  which moves its remaining work and its growth hint;
- a request that finishes with a realized length is handed to the online learner with its prompt-end row.
The text predictor still tags requests on arrival (the block must be reserved before the prefill).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from odma.engine.sequence import Sequence
from predictor.base import PredictRequest

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ProbeCounters:
    predicted: int = 0  # prompt-end predictions
    refined: int = 0  # decode-time refinements
    learned: int = 0  # finished requests handed to the online learner
    failures: int = 0  # probe calls that raised (the requests keep their earlier tags)
    seconds: float = 0.0  # time inside the probe (predictions, refinements, learning)


class LengthProbe:
    def __init__(self, probe: Any, online: Any = None, generator: str | None = None) -> None:
        self.probe = probe  # a predictor.probe.ProbePredictor
        self.online = online  # a predictor.online.OnlineProbe, or None (the shipped heads only)
        self.generator = generator
        self.refine_every = probe.refine_every if probe.refine_head is not None else 0
        self.counters = ProbeCounters()
        self._calibrated = {}  # id(calibration) → its bucket manager (select's bound is the calibrated tokens)

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.probe.capture_layers

    @property
    def source(self) -> str:
        return self.online.source if self.online is not None else "shipped"

    def after_step(self, work: list, captured: dict) -> None:
        """Read the step's captured states (one row per work item, in order) before its tokens are appended."""
        if not captured:
            return
        started = time.perf_counter()
        first = [i for i, w in enumerate(work) if w.seq.num_generated == 0 and w.start + w.q_len == w.seq.num_tokens]
        k = self.refine_every
        later = [i for i, w in enumerate(work) if k and w.q_len == 1 and w.seq.num_generated > 0
                 and w.seq.num_generated % k == 0] if k else []
        try:
            if first:
                self._predict([work[i].seq for i in first], captured[self.probe.layer][first])
            if later:
                self._refine([work[i].seq for i in later], captured[self.probe.refine_layer][later])
        except Exception:  # noqa: BLE001 - a failing probe must not fail the step: the requests keep their tags
            self.counters.failures += 1
            log.exception("length probe failed; the requests keep their earlier predictions")
        self.counters.seconds += time.perf_counter() - started

    def learn(self, seq: Sequence) -> None:
        """A request finished with a realized length: the online learner gets its prompt-end row."""
        if self.online is None or seq.probe_features is None:
            return
        started = time.perf_counter()
        try:
            self.online.observe(seq.probe_features, self._request(seq), seq.num_generated)
            self.counters.learned += 1
        except Exception:  # noqa: BLE001 - learning is best effort; serving goes on
            self.counters.failures += 1
            log.exception("online length learner refused a completion")
        self.counters.seconds += time.perf_counter() - started

    def stats(self) -> dict:
        out = {"source": self.source, **{k: getattr(self.counters, k) for k in ProbeCounters.__slots__}}
        if self.online is not None:
            out["online"] = self.online.stats()
        return out

    def close(self) -> None:
        if self.online is not None:
            self.online.close()

    # -- internals --------------------------------------------------------------------------------

    def _request(self, seq: Sequence) -> PredictRequest:
        return seq.predict_request(self.generator)

    def _predict(self, seqs: list[Sequence], rows) -> None:
        rows = rows.numpy() if hasattr(rows, "numpy") else np.asarray(rows)
        requests = [self._request(s) for s in seqs]
        source = self.online if self.online is not None else None
        preds = source.predict(rows, requests) if source is not None else self.probe.predict_features(rows, requests)
        calibration = self.online.calibration if self.online is not None else self.probe.calibration
        for seq, row, (length, u) in zip(seqs, rows, preds):
            if not (np.isfinite(length) and length >= 0 and np.isfinite(u)):
                continue
            seq.probe_features = row.astype(np.float16)
            seq.predicted_length = float(length)
            seq.predicted_remaining = max(0.0, float(length) - 1.0)  # the step emits its first token
            seq.growth_hint = self._hint(seq, float(length), float(u), calibration)
        self.counters.predicted += len(seqs)

    def _refine(self, seqs: list[Sequence], rows) -> None:
        requests = [self._request(s) for s in seqs]
        preds = self.probe.refine(rows, [s.num_generated for s in seqs], requests)
        calibration = self.online.calibration if self.online is not None else self.probe.calibration
        for seq, (remaining, u) in zip(seqs, preds):
            if not (np.isfinite(remaining) and remaining >= 0 and np.isfinite(u)):
                continue
            seq.predicted_remaining = float(remaining)
            seq.growth_hint = self._hint(seq, seq.num_generated + float(remaining), min(1.0, float(u)), calibration)
        self.counters.refined += len(seqs)

    def _hint(self, seq: Sequence, total: float, u: float, calibration) -> float:
        """Output tokens (of the request's current block) its next growth should hold: the calibrated reservation
        for a total output of `total`, less what it generated before this block (a recomputed request's block
        counts its earlier output as prompt)."""
        tokens = total
        if calibration is not None:
            manager = self._calibrated.get(id(calibration))
            if manager is None:  # a refit brings a new calibration: keep the few latest
                if len(self._calibrated) > 8:
                    self._calibrated.clear()
                manager = self._calibrated[id(calibration)] = calibration.bucket_manager()
            tokens = float(manager.select(total, min(u, 1.0)).bound)
        before_block = seq.num_generated - (seq.num_tokens - seq.prompt_tokens)
        return max(0.0, tokens - before_block)
