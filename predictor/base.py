"""The one predictor interface: requests → [(L̂, u)], batched; what a saved predictor folder holds."""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, Sequence

from odma.config import ReservationTable
from odma.errors import ConfigError, PredictorError

MANIFEST = "predictor.json"
FORMAT_VERSION = 1


class Prediction(NamedTuple):
    length: float  # L̂: predicted output tokens
    uncertainty: float  # u in [0, 1]


@dataclass(frozen=True, slots=True)
class PredictRequest:
    """What a predictor reads about one request, under the trace records' names (a `TraceRecord` reads the same,
    so a predictor trained on traces is served the fields it learned from). Unknown fields are None."""

    prompt: str | None
    prompt_tokens: int
    temperature: float | None = None
    generator: str | None = None  # whose answers the lengths are of (the served model)
    depth: int | None = None  # turns before this one in its conversation
    system_prompt_id: str | None = None
    prior_output_tokens: int | None = None  # the conversation's earlier answers, summed
    last_output_tokens: int | None = None  # ... and the last one
    type: str | None = None  # the task kind, where a trace names one


@dataclass(frozen=True)
class Calibration:
    """How predictions become reservations: the bucket bounds the model was calibrated against, α, τ and the
    reservation ceiling, or a reservation table."""

    bounds: tuple[int, ...]
    large_bound: int
    align: int = 16
    alpha: float = 0.0
    tau: float = math.inf
    target: float | None = None  # under-prediction rate α and τ were chosen for
    ceiling: float = math.inf  # no admission reservation above the bucket holding this (absent in old manifests)
    table: ReservationTable | None = None  # per-L̂-group reservations; replaces α and the ceiling when present

    def to_json(self) -> dict:
        d = asdict(self)
        d["bounds"] = list(self.bounds)
        for key in ("tau", "ceiling"):  # JSON has no infinity
            d[key] = None if math.isinf(d[key]) else d[key]
        d["table"] = None if self.table is None else self.table.to_json()
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Calibration":
        try:
            ceiling = math.inf if d.get("ceiling") is None else float(d["ceiling"])
            table = None if d.get("table") is None else ReservationTable.from_json(d["table"])
            cal = cls(tuple(int(b) for b in d["bounds"]), int(d["large_bound"]), int(d.get("align", 16)),
                      float(d.get("alpha", 0.0)), math.inf if d.get("tau") is None else float(d["tau"]),
                      d.get("target"), ceiling, table)
            cal.bucket_manager()  # the allocator's own checks (a ceiling < 1, a table with α, bad bounds) at load
            return cal
        except (KeyError, TypeError, ValueError, ConfigError) as exc:
            raise PredictorError(f"bad calibration block in {MANIFEST}: {exc}") from None

    def bucket_manager(self):
        """A static manager with these bounds, α, τ, ceiling and table: `select` is exactly the allocator's
        choice."""
        from odma.kv import BucketManager

        return BucketManager.fixed(self.bounds, self.large_bound, alpha=self.alpha, tau=self.tau,
                                   ceiling=self.ceiling, table=self.table)


@dataclass
class Manifest:
    """predictor.json: what a saved predictor folder holds and how it was made."""

    kind: str  # "encoder" | "sklearn" | "probe"
    calibration: Calibration | None = None
    settings: dict = field(default_factory=dict)  # kind-specific (backbone, layers, max_len, metadata vocab...)
    report: dict = field(default_factory=dict)  # test metrics at export time

    def save(self, folder: Path) -> None:
        data = {"format_version": FORMAT_VERSION, "kind": self.kind, "settings": self.settings,
                "calibration": self.calibration.to_json() if self.calibration else None, "report": self.report}
        (Path(folder) / MANIFEST).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, folder: Path) -> "Manifest":
        path = Path(folder) / MANIFEST
        if not path.exists():
            raise PredictorError(f"{folder} is not a predictor folder (no {MANIFEST})")
        try:
            data = json.loads(path.read_text())
            kind = data["kind"]
        except (ValueError, KeyError, TypeError) as exc:
            raise PredictorError(f"corrupt {path}: {exc}") from None
        if data.get("format_version") != FORMAT_VERSION:
            raise PredictorError(f"{path}: unsupported format_version {data.get('format_version')!r}")
        cal = Calibration.from_json(data["calibration"]) if data.get("calibration") else None
        return cls(kind, cal, data.get("settings") or {}, data.get("report") or {})


class Predictor(ABC):
    """Predicts each request's output length L̂ and an uncertainty u in [0, 1], and may learn from the requests
    that finish.

    A request is any object with a `prompt` (text or None) and optionally `prompt_tokens`, `type`,
    `temperature`, `system_prompt_id`, `depth`, `generator` (a `TraceRecord` works).

    What a predictor declares, so that a server asks it rather than checks its class:
    - `learns`: `observe` changes its later predictions, so every finished request must be told to it where it
      finishes. A trained predictor does not learn (its calibration is fixed at export) and `observe` is a no-op;
      a probe's online head (predictor/online.py) learns from the prompt-end hidden-state row, which the engine's
      probe path hands it, not from what `observe` carries.
    - `reads_hidden_states`: it predicts from the served model's own hidden states (a probe), which only the
      engine that runs the model can hand it; the engine serves it beside the text predictor, not as one, through
      the probe's interface (`layer`, `hidden_size`, `capture_layers`, `check_model`, `predict_features`,
      `refine`: predictor.probe.ProbePredictor)."""

    name: str = "predictor"
    calibration: Calibration | None = None
    fallback_reason: str | None = None  # set when this predictor stands in for one that could not be loaded
    learns: ClassVar[bool] = False
    reads_hidden_states: ClassVar[bool] = False

    @abstractmethod
    def predict(self, requests: Sequence[Any]) -> list[Prediction]:
        """One (L̂, u) per request, in order."""

    def predict_one(self, request: Any) -> Prediction:
        return self.predict([request])[0]

    def observe(self, request: Any, realized_length: int) -> None:
        """A request finished with `realized_length` output tokens; `request` is what `predict` was given for it
        (the same fields), or None when it finished before it was predicted. Nothing to learn unless the predictor
        declares `learns`."""
