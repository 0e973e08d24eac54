"""The trained encoder predictor served by onnxruntime (no torch on this path once the graph exists)."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from odma.config import default_cache_dir
from odma.errors import PredictorError
from predictor.base import Manifest, Prediction, Predictor
from predictor.features import MetadataEncoder
from predictor.onnx_files import HEADS_FILE, ONNX_FILE, TOKENIZER_DIR
from predictor.text import encode_texts

log = logging.getLogger(__name__)

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
        self._session = self._open(threads)
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
            self._build(cached)
        return cached

    def _build(self, dest: Path) -> None:
        from predictor.build import build_onnx_from_heads

        start = time.perf_counter()
        with _quiet_unless_debugging():
            build_onnx_from_heads(self.folder, self.manifest, dest)
        _checksum_file(dest).write_text(_sha256(dest))
        log.info("built the %s predictor graph from the installed backbone in %.1f s (cached: %s)", self.folder.name,
                 time.perf_counter() - start, dest)

    def _open(self, threads: int | None):
        """The onnxruntime session. A graph built into the cache that no longer loads, does not match the checksum
        written when it was built (a truncated or damaged file), or cannot be checked against it (the checksum
        file is missing or unreadable) is rebuilt, not served around forever nor adopted unverified."""
        from predictor.onnx_export import session

        derived = self.onnx_path != self.folder / ONNX_FILE
        damage = _damage(self.onnx_path) if derived else None
        if damage is None:
            try:
                return session(self.onnx_path, threads)
            except PredictorError as exc:
                if not derived:
                    raise
                damage = str(exc)
        log.warning("cached predictor graph %s cannot be trusted (%s); rebuilding it", self.onnx_path, damage)
        self.onnx_path.unlink(missing_ok=True)
        self._build(self.onnx_path)
        return session(self.onnx_path, threads)

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


def _checksum_file(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _damage(path: Path) -> str | None:
    """Why a cached graph cannot be trusted (None: its checksum matches)."""
    check = _checksum_file(path)
    if not check.exists():
        return "no checksum file: the graph is unverified (a build that stopped before writing it)"
    try:
        expected = check.read_bytes().decode("ascii").strip()
        return None if expected == _sha256(path) else "checksum mismatch: the graph is damaged"
    except UnicodeDecodeError:
        return "the checksum file is damaged (not a hex digest)"
    except OSError as exc:
        return str(exc)


@contextmanager
def _quiet_unless_debugging():
    """The export and quantization tools are chatty (tracer warnings, ~40 lines of onnxruntime messages on the
    root logger, progress bars): the build says one line instead; --log-level debug shows them all."""
    if log.isEnabledFor(logging.DEBUG):
        yield
        return
    root = logging.getLogger()
    level = root.level
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers is a dependency
        hf_logging = None
    bars = hf_logging.is_progress_bar_enabled() if hf_logging else False
    root.setLevel(logging.ERROR)
    if bars:
        hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        root.setLevel(level)
        if bars:
            hf_logging.enable_progress_bar()
