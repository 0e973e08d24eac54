"""Length predictors behind one interface: `predict(requests) -> [(L̂, u)]`.

Implementations: the trained encoder served by onnxruntime (`onnx_runtime.OnnxPredictor`), the scikit-learn
fallback (`sklearn_baseline.SklearnPredictor`), and for experiments only `oracle` / `noisy-oracle:SIGMA`.
"""

from predictor.base import Calibration, Manifest, Prediction, Predictor
from predictor.registry import load_predictor, load_predictor_folder

__all__ = ["Calibration", "Manifest", "Prediction", "Predictor", "load_predictor", "load_predictor_folder"]
