"""The `probe` predictor: the served model's own hidden states → its output length.

- hidden.py       the served model's prefill / teacher forcing, standalone (odma's own model code)
- state_cache.py  prompt-end states of every layer, cached on disk per model
- identity.py     which model a probe belongs to
- fit.py          closed-form ridge heads: log(1 + L) and its expected error (→ u)
- predictor.py    ProbePredictor: predict / predict_features (prefill) / refine (decode, remaining length)
"""

from predictor.probe.predictor import HEADS_FILE, KIND, ProbePredictor

__all__ = ["HEADS_FILE", "KIND", "ProbePredictor"]
