"""ProbePredictor: the served model predicts its own output length from its hidden states (kind "probe").

Two heads over the residual stream of one decoder layer of the served model:
- at the end of prefill (`predict_features`): the state at the last prompt token + the request metadata →
  L̂ and u, calibrated like every predictor (predictor/calibration.py) so the bucket manager gets α, τ, the
  ceiling or a reservation table;
- during decode (`refine`): the state at the newest generated token + how many were generated → the
  *remaining* length and its u.

The engine already computes these states (`ModelRunner.capture_layers = probe.capture_layers`), so serving adds
one small matrix-vector product per request. Standalone (`predict`, `odma-train --eval-only`), the probe runs
the served model's prefill itself with odma's own model code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Sequence

import numpy as np

from odma.errors import PredictorError
from predictor.base import Calibration, Manifest, Prediction, Predictor
from predictor.features import MetadataEncoder
from predictor.probe.fit import LengthHead

HEADS_FILE = "probe_heads.safetensors"
KIND = "probe"


def refine_features(states: np.ndarray, generated: Sequence[int], meta: np.ndarray) -> np.ndarray:
    """The decode-time head's input: state ⊕ metadata ⊕ log(1 + generated so far)."""
    t = np.log1p(np.maximum(np.asarray(generated, dtype=np.float32), 0.0))[:, None]
    return np.hstack([np.asarray(states, dtype=np.float32), meta, t]).astype(np.float32)


class ProbePredictor(Predictor):
    name = "probe"
    reads_hidden_states: ClassVar[bool] = True  # the engine captures `capture_layers` and calls predict_features

    def __init__(self, prompt_head: LengthHead, metadata: MetadataEncoder, settings: dict,
                 refine_head: LengthHead | None = None, calibration: Calibration | None = None,
                 manifest: Manifest | None = None, folder: Path | None = None) -> None:
        self.prompt_head = prompt_head
        self.refine_head = refine_head
        self.metadata = metadata
        self.settings = settings
        self.calibration = calibration
        self.manifest = manifest
        self.folder = folder
        self.layer = int(settings["layer"])
        self.refine_layer = int(settings["refine_layer"]) if refine_head is not None else None
        self.refine_every = int(settings.get("refine_every", 16))
        self.hidden_size = int(settings["hidden_size"])
        self.model_identity = settings.get("model_identity")
        self.median_length = float(settings.get("train_stats", {}).get("median_length", 128.0))
        self._states = None  # the served model, loaded on the first standalone predict()
        self._cache = None
        expected = self.hidden_size + metadata.size
        if len(prompt_head.length.weight) != expected:
            raise PredictorError(f"probe head takes {len(prompt_head.length.weight)} features, but the settings "
                                 f"say {self.hidden_size} hidden + {metadata.size} metadata")
        if refine_head is not None and len(refine_head.length.weight) != expected + 1:
            raise PredictorError("probe refine head does not match hidden size + metadata + 1")

    # -- what the engine calls ------------------------------------------------------------------

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """The layers whose states the engine should capture (`ModelRunner.capture_layers`)."""
        return tuple(sorted({self.layer} | ({self.refine_layer} if self.refine_layer is not None else set())))

    def check_model(self, identity: str) -> None:
        """Refuse to read another model's hidden states (`predictor.probe.identity.model_identity`)."""
        if self.model_identity is not None and identity != self.model_identity:
            raise PredictorError(f"this probe was trained on model {self.model_identity}, not on {identity}: "
                                 "its heads mean nothing on another model's hidden states")

    def predict_features(self, features: Any, requests: Sequence[Any]) -> list[Prediction]:
        """L̂, u from the states at the last prompt token (layer `self.layer`, one row per request, in order)."""
        x = self._rows(features, len(requests))
        length, unc = self.prompt_head.predict(np.hstack([x, self.metadata.encode(requests)]))
        return [Prediction(float(a), float(b)) for a, b in zip(length, unc)]

    def refine(self, features: Any, generated_so_far: Sequence[int], requests: Sequence[Any]) -> list[Prediction]:
        """The REMAINING length (tokens still to generate) and its u, from the state the engine captured at the
        step that fed the `generated_so_far`-th generated token (layer `self.refine_layer`)."""
        if self.refine_head is None:
            raise PredictorError("this probe has no decode-time head (trained without answers)")
        if len(generated_so_far) != len(requests):
            raise PredictorError("refine needs one generated_so_far count per request")
        x = self._rows(features, len(requests))
        length, unc = self.refine_head.predict(refine_features(x, generated_so_far, self.metadata.encode(requests)))
        return [Prediction(float(a), float(b)) for a, b in zip(length, unc)]

    def _rows(self, features: Any, n: int) -> np.ndarray:
        x = np.asarray(features.numpy() if hasattr(features, "numpy") else features, dtype=np.float32)
        if x.ndim != 2 or x.shape != (n, self.hidden_size):
            raise PredictorError(f"probe features must be [{n}, {self.hidden_size}], got {list(x.shape)}")
        if not np.all(np.isfinite(x)):
            raise PredictorError("probe features hold non-finite values")
        return x

    # -- standalone -----------------------------------------------------------------------------

    def attach_model(self, states_model, cache_dir: Path | None = None) -> None:
        """Use this served model (a `ServedModelStates`) for standalone predictions; with `cache_dir`, prompt
        states are kept on disk (training and evaluation runs)."""
        from predictor.probe.identity import model_identity
        from predictor.probe.state_cache import StateCache

        identity = model_identity(states_model.model)
        self.check_model(identity)
        if states_model.hidden_size != self.hidden_size:
            raise PredictorError(f"served model hidden size {states_model.hidden_size} != probe's {self.hidden_size}")
        self._states = states_model
        self._cache = StateCache(cache_dir, identity) if cache_dir is not None else None

    def prompt_states(self, requests: Sequence[Any], progress: bool = False) -> np.ndarray:
        """[n, hidden]: the served model's state at each prompt's last token (layer `self.layer`)."""
        from predictor.probe.state_cache import prompt_states

        if self._states is None:
            from predictor.probe.hidden import ServedModelStates

            self.attach_model(ServedModelStates.load(self.settings.get("served_model", "smollm2"),
                                                     self.settings.get("dtype", "float32")))
        prompts = [getattr(r, "prompt", None) or "" for r in requests]
        if self._cache is not None:
            return prompt_states(self._states, prompts, self._cache, progress=progress)[:, self.layer]
        seqs = [self._states.prompt_ids(p) for p in prompts]
        return self._states.last_states(seqs, (self.layer,))[self.layer]

    def predict(self, requests: Sequence[Any]) -> list[Prediction]:
        """Standalone: runs the served model's prefill of each prompt. Requests without prompt text get the
        training median with u = 1 (nothing to read)."""
        if not requests:
            return []
        out: list[Prediction | None] = [None] * len(requests)
        with_text = [i for i, r in enumerate(requests) if getattr(r, "prompt", None)]
        if with_text:
            chosen = [requests[i] for i in with_text]
            for i, p in zip(with_text, self.predict_features(self.prompt_states(chosen), chosen)):
                out[i] = p
        return [p if p is not None else Prediction(self.median_length, 1.0) for p in out]

    # -- files ----------------------------------------------------------------------------------

    def save(self, folder: Path, manifest: Manifest) -> None:
        from safetensors.numpy import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = self.prompt_head.tensors("prompt")
        if self.refine_head is not None:
            tensors.update(self.refine_head.tensors("refine"))
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(folder / HEADS_FILE))
        (folder / HEADS_FILE).chmod(0o644)
        manifest.settings = {**manifest.settings, **self.settings, "metadata": self.metadata.to_json()}
        manifest.save(folder)

    @classmethod
    def load(cls, folder: Path, manifest: Manifest) -> "ProbePredictor":
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        path = Path(folder) / HEADS_FILE
        if not path.exists():
            raise PredictorError(f"{folder}: missing {HEADS_FILE}")
        try:
            tensors = load_file(str(path))
        except (SafetensorError, OSError, ValueError) as exc:
            raise PredictorError(f"corrupt probe heads {path}: {exc}") from None
        s = manifest.settings
        for key in ("layer", "hidden_size"):
            if key not in s:
                raise PredictorError(f"{folder}: probe settings lack {key!r}")
        refine = LengthHead.from_tensors(tensors, "refine") if "refine.length.weight" in tensors else None
        return cls(LengthHead.from_tensors(tensors, "prompt"), MetadataEncoder.from_json(s.get("metadata", {})), s,
                   refine, manifest.calibration, manifest, Path(folder))


def remaining_median(lengths: np.ndarray, generated: int) -> float:
    """Predict-the-median for the remaining length after `generated` tokens: the median of L − generated over
    the lengths still running then (a baseline for `refine`)."""
    alive = lengths[lengths > generated]
    return float(np.median(alive - generated)) if len(alive) else 1.0


