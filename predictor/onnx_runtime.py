"""The trained encoder predictor served by onnxruntime (no torch on this path once the graph exists)."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from odma.config import default_cache_dir
from odma.errors import PredictorError
from predictor.base import Manifest, Prediction, Predictor
from predictor.features import MetadataEncoder
from predictor.text import encode_texts

ONNX_FILE = "predictor.onnx"
HEADS_FILE = "heads.safetensors"
TOKENIZER_DIR = "tokenizer"
BATCH = 64


class OnnxPredictor(Predictor):
    """A predictor folder: predictor.json + predictor.onnx (+ tokenizer/).

    A folder holding only the small heads (`heads.safetensors`, as the committed default does) gets its
    predictor.onnx built once from the installed backbone weights and cached under ~/.cache/odma."""

    def __init__(self, folder: Path, manifest: Manifest | None = None, threads: int | None = None) -> None:
        self.folder = Path(folder)
        self.manifest = manifest or Manifest.load(self.folder)
        s = self.manifest.settings
        try:
            self.max_len = int(s["max_len"])
            self.backbone = str(s["backbone"])
            self.layers = s.get("layers")
            self.metadata = MetadataEncoder.from_json(s.get("metadata", {}))
        except (KeyError, TypeError, ValueError) as exc:
            raise PredictorError(f"{self.folder}: predictor.json lacks encoder settings ({exc})") from None
        self.calibration = self.manifest.calibration
        self.name = f"encoder:{self.folder.name}"
        self.onnx_path = self._onnx_path()
        from predictor.onnx_export import session

        self._session = session(self.onnx_path, threads)
        self._tokenizer = self._load_tokenizer()
        self._lock = threading.Lock()  # the HF fast tokenizer is not safe to call from several threads

    def _load_tokenizer(self):
        from transformers import AutoTokenizer

        from predictor.encoder import resolve_backbone

        folder = self.folder / TOKENIZER_DIR
        source = folder if folder.exists() else resolve_backbone(self.backbone)
        try:
            return AutoTokenizer.from_pretrained(str(source))
        except (OSError, ValueError) as exc:
            raise PredictorError(f"cannot load the predictor's tokenizer from {source}: {exc}") from None

    def _onnx_path(self) -> Path:
        own = self.folder / ONNX_FILE
        if own.exists():
            return own
        heads = self.folder / HEADS_FILE
        if not heads.exists():
            raise PredictorError(f"{self.folder}: neither {ONNX_FILE} nor {HEADS_FILE} is there")
        digest = hashlib.sha256(heads.read_bytes() + (self.folder / "predictor.json").read_bytes()).hexdigest()[:16]
        cached = default_cache_dir() / "predictors" / digest / ONNX_FILE
        if not cached.exists():
            from predictor.build import build_onnx_from_heads

            build_onnx_from_heads(self.folder, self.manifest, cached)
        return cached

    def run_batch(self, requests: Sequence[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Raw outputs for one batch: lengths, uncertainties, bucket probabilities."""
        with self._lock:
            enc = encode_texts(self._tokenizer, [getattr(r, "prompt", None) for r in requests], self.max_len)
        meta = self.metadata.encode(requests)
        length, unc, probs = self._session.run(
            None, {"input_ids": enc.input_ids, "attention_mask": enc.attention_mask, "meta": meta})
        return length, unc, probs

    def predict(self, requests: Sequence[Any]) -> list[Prediction]:
        if not requests:
            return []
        # Batch prompts of similar length together: padding is wasted encoder work.
        order = np.argsort([len(getattr(r, "prompt", None) or "") for r in requests], kind="stable")
        out: list[Prediction | None] = [None] * len(requests)
        for start in range(0, len(order), BATCH):
            idx = order[start : start + BATCH]
            length, unc, _ = self.run_batch([requests[i] for i in idx])
            for i, a, b in zip(idx, length, unc):
                out[i] = Prediction(float(a), float(b))
        return out  # type: ignore[return-value]
