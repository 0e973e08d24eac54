"""LengthModel → predictor.onnx (optionally int8), checked against torch on real inputs."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from odma.errors import PredictorError
from predictor.encoder import LengthModel

INPUTS = ("input_ids", "attention_mask", "meta")
OUTPUTS = ("length", "uncertainty", "bucket_probs")
OPSET = 17


@dataclass(frozen=True, slots=True)
class ExportCheck:
    max_abs_diff_length: float  # tokens
    max_abs_diff_log_length: float
    max_abs_diff_uncertainty: float


def export_onnx(model: LengthModel, path: Path, example: dict[str, np.ndarray], quantize: bool = False) -> None:
    """Dynamic batch and sequence axes; `quantize`: int8 weights (dynamic quantization), about 4x smaller."""
    model.eval()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    args = tuple(torch.from_numpy(example[k]) for k in INPUTS)
    dynamic = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}, "meta": {0: "batch"},
               "length": {0: "batch"}, "uncertainty": {0: "batch"}, "bucket_probs": {0: "batch"}}
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".onnx.tmp")
    os.close(fd)
    try:
        with torch.no_grad():
            torch.onnx.export(model, args, tmp, input_names=list(INPUTS), output_names=list(OUTPUTS),
                              dynamic_axes=dynamic, opset_version=OPSET, dynamo=False)
        if quantize:
            from onnxruntime.quantization import QuantType, quantize_dynamic

            fd, qtmp = tempfile.mkstemp(dir=path.parent, suffix=".int8.tmp")
            os.close(fd)
            # Per-channel weight scales: 4x smaller error in log L̂ than one scale per tensor (measured).
            quantize_dynamic(tmp, qtmp, weight_type=QuantType.QInt8, per_channel=True)
            os.replace(qtmp, tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)  # atomic: a half-written model is never loaded
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def session(path: Path, threads: int | None = None):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads or int(os.environ.get("ODMA_PREDICTOR_THREADS", "2"))
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    try:
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own types for unreadable graphs
        raise PredictorError(f"corrupt or unreadable ONNX model {path}: {exc}") from None


@torch.no_grad()
def compare_with_torch(model: LengthModel, onnx_path: Path, batches: list[dict[str, np.ndarray]]) -> ExportCheck:
    """Largest disagreement between the torch model and the exported graph over the given inputs."""
    sess = session(onnx_path)
    d_len = d_log = d_unc = 0.0
    model.eval()
    for feed in batches:
        t_len, t_unc, _ = (x.numpy() for x in model(*(torch.from_numpy(feed[k]) for k in INPUTS)))
        o_len, o_unc, _ = sess.run(None, {k: feed[k] for k in INPUTS})
        d_len = max(d_len, float(np.max(np.abs(t_len - o_len))))
        d_log = max(d_log, float(np.max(np.abs(np.log(t_len) - np.log(o_len)))))
        d_unc = max(d_unc, float(np.max(np.abs(t_unc - o_unc))))
    return ExportCheck(d_len, d_log, d_unc)
