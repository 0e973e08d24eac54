"""Predictors by name or folder: a small registry. Each entry names its loader as `module:attribute`, imported
only when that predictor is asked for, so this package's interface (`predictor.base`) imports none of its
implementations and a new kind is one line here."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Callable

from odma.errors import PredictorError
from predictor.base import Manifest, Predictor

# predictor.json `kind` → loader(folder, manifest)
KINDS: dict[str, str] = {
    "encoder": "predictor.onnx_runtime:OnnxPredictor",
    "sklearn": "predictor.sklearn_baseline:SklearnPredictor.load",
    "probe": "predictor.probe:ProbePredictor.load",
}
# spec name → loader(), or loader(text after ':') for the names that take an argument (`noisy-oracle:0.5`)
NAMES: dict[str, str] = {
    "default": "predictor.default:load_default",
    "sklearn": "predictor.default:load_default_sklearn",
    "smollm2": "predictor.default:load_default_smollm2",  # the text predictor also trained on SmolLM2's own answers
    "probe": "predictor.default:load_default_probe",  # SmolLM2's own hidden states (the default served model)
    "median": "predictor.running_median:RunningMedian",  # learns from realized lengths; needs nothing trained
    "running-median": "predictor.running_median:RunningMedian",
    "oracle": "predictor.oracle:OraclePredictor",
}
NAMES_WITH_ARGUMENT: dict[str, str] = {
    "noisy-oracle": "predictor.oracle:NoisyOraclePredictor.from_spec",
    # experiments on multi-sample traces only: prompt-oracle, prompt-oracle:with-own
    "prompt-oracle": "predictor.oracle:PromptOraclePredictor.from_spec",
}


def _resolve(target: str) -> Callable:
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def load_predictor(spec: str) -> Predictor:
    """A predictor by name (`default`, `sklearn`, `median`, `oracle`, `noisy-oracle:SIGMA`, ...) or from a folder."""
    if spec in NAMES:
        return _resolve(NAMES[spec])()
    name, _, arg = spec.partition(":")
    if name in NAMES_WITH_ARGUMENT:
        return _resolve(NAMES_WITH_ARGUMENT[name])(arg)
    return load_predictor_folder(Path(spec).expanduser())


def load_predictor_folder(folder: Path) -> Predictor:
    if not folder.is_dir():
        raise PredictorError(f"unknown predictor {str(folder)!r}: use default, smollm2, sklearn, probe, median, oracle, prompt-oracle, noisy-oracle:SIGMA or a folder")
    manifest = Manifest.load(folder)
    if manifest.kind not in KINDS:
        raise PredictorError(f"{folder}: unknown predictor kind {manifest.kind!r}")
    return _resolve(KINDS[manifest.kind])(folder, manifest)
