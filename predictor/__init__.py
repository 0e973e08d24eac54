"""Length predictors behind one interface: `predict(requests) -> [(L̂, u)]`, and `observe(request, realized)`
when a request finishes (what a predictor that `learns` learns from); `serving.ServedPredictor` drives one.

Implementations: the trained encoder served by onnxruntime (`onnx_runtime.OnnxPredictor`), the scikit-learn
fallback (`sklearn_baseline.SklearnPredictor`), the running median (`running_median.RunningMedian`, `median`: it
learns), the served model's probe (`probe.ProbePredictor`), and for experiments only `oracle` /
`noisy-oracle:SIGMA`.
"""

from predictor.base import Calibration, Manifest, Prediction, Predictor
from predictor.registry import load_predictor, load_predictor_folder

__all__ = ["Calibration", "Manifest", "Prediction", "Predictor", "load_predictor", "load_predictor_folder"]
