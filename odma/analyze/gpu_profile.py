"""Step-time profiles of the GPU engine (7B shape, bf16), fitted to raw `odma-bench gpu` runs: what a replayed
engine step (`odma.analyze.gpu_burst.StepRecord`) costs on an H100 or H200.

A step's device time is a fixed part (weights, launches) plus its decode attention's reads (per 1K context
tokens; the paged pool reads through page tables at `paged_read_factor` times that) plus its prefill chunks
(per 1K tokens of `PrefillCost`, the scheduler's own measure: tokens plus their attention over the context
before them). Beside the device: the host's part of a step (scheduling, launches, the sync), more for pages
(the page tables), and for each growth that slides blocks over the gaps (a packed pool's) the scheduling thread's
search for the slides and its dispatch of their copies (`ms_per_slide`); migrations copy at the device's measured
copy speed (a move over its own old place twice: through a temporary); swaps cross PCIe at `swap_gbps`.
No torch. Profiles are JSON files (odma/analyze/gpu_profiles/NAME.json, or any path).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from odma.errors import ConfigError

GIB = 1 << 30
PROFILE_DIR = Path(__file__).resolve().parent / "gpu_profiles"


@dataclass(frozen=True, slots=True)
class GpuProfile:
    name: str
    device: str
    step_ms: float  # device time of a step besides its attention reads and prefill
    ms_per_1k_context: float  # decode attention: per 1K context tokens read (contiguous blocks)
    paged_read_factor: float  # the same reads through page tables cost this many times as much
    ms_per_1k_prefill: float  # per 1K prefill-cost tokens (odma.engine.prefill_cost)
    host_ms: float  # per step, beside the device: scheduling, launches, the step's sync
    paged_host_ms: float  # the same for the paged pool (its page tables are built on the host)
    copy_ms_per_gib: float  # a migration's copy (read + write), measured (odma-bench gpu, part vmm)
    swap_gbps: float  # swap-out / swap-in payload over the host link
    # a growth that slides blocks over the gaps: the scheduling thread's search for the cheapest run of blocks to
    # slide (after window clearing found none) while the device waits, beside its copies (fitted; 0: not modelled)
    ms_per_slide: float = 0.0
    bytes_per_token: int = 57344  # KV bytes per token of the 7B shape in bf16
    prefill_span: float = 8064.0  # PrefillCost.span of the 7B shape (attention cost relative to the linears)
    fitted_on: tuple[str, ...] = ()  # the raw runs the parameters came from
    notes: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("name", "device", "fitted_on", "notes"):
                continue
            least = 0 if f.name == "ms_per_slide" else None
            if not (isinstance(v, (int, float)) and (v >= least if least is not None else v > 0)):
                raise ConfigError(f"GPU profile {self.name!r}: {f.name} must be a "
                                  f"{'non-negative' if least is not None else 'positive'} number, got {v!r}")

    def device_ms(self, step, paged: bool) -> float:
        """Device milliseconds of one step (0 for a step without work)."""
        if not step.decodes and not step.prefill:
            return 0.0
        read = self.ms_per_1k_context * step.context / 1e3 * (self.paged_read_factor if paged else 1.0)
        cost = sum(q * (1 + (start + (q - 1) / 2) / self.prefill_span) for start, q in step.prefill)
        return self.step_ms + read + self.ms_per_1k_prefill * cost / 1e3

    def breakdown(self, steps, paged: bool) -> dict:
        """Seconds of a burst by part: device, host (slides' planning with it), copies, swaps (and their sum)."""
        device = sum(self.device_ms(s, paged) for s in steps) / 1e3
        host = (len(steps) * (self.paged_host_ms if paged else self.host_ms)
                + sum(s.slides for s in steps) * self.ms_per_slide) / 1e3
        copy = sum(s.copied_tokens for s in steps) * self.bytes_per_token / GIB * self.copy_ms_per_gib / 1e3
        swap = sum(s.swap_tokens for s in steps) * self.bytes_per_token / (self.swap_gbps * 1e9)
        return {"seconds": device + host + copy + swap, "device_s": device, "host_s": host, "copy_s": copy,
                "swap_s": swap}

    def device_p50_ms(self, steps, paged: bool) -> float:
        """The median device time of the steps that ran the model (what the runner's timer reports)."""
        times = [self.device_ms(s, paged) for s in steps if s.decodes or s.prefill]
        return statistics.median(times) if times else 0.0

    def scaled(self, name: str, device: str, factor: float, copy_ms_per_gib: float, note: str) -> "GpuProfile":
        """This profile on another device: every device term times `factor`, its own copy speed; host and swap
        unchanged."""
        return replace(self, name=name, device=device, step_ms=self.step_ms * factor,
                       ms_per_1k_context=self.ms_per_1k_context * factor,
                       ms_per_1k_prefill=self.ms_per_1k_prefill * factor, copy_ms_per_gib=copy_ms_per_gib,
                       notes=note)

    def to_json(self) -> dict:
        d = asdict(self)
        d["fitted_on"] = list(self.fitted_on)
        return d

    @classmethod
    def from_json(cls, data: dict, source: str = "profile") -> "GpuProfile":
        try:
            known = {f.name for f in fields(cls)}
            unknown = set(data) - known
            if unknown:
                raise ValueError(f"unknown fields {sorted(unknown)}")
            data = dict(data)
            data["fitted_on"] = tuple(data.get("fitted_on", ()))
            return cls(**data)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"bad GPU profile {source}: {exc}") from None


def gpu_profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_gpu_profile(spec: str) -> GpuProfile:
    """A shipped profile by name (h100-7b, h200-7b) or a JSON file written by `odma-analyze fit-gpu`."""
    path = PROFILE_DIR / f"{spec}.json"
    if not path.is_file():
        path = Path(spec).expanduser()
    if not path.is_file():
        raise ConfigError(f"unknown GPU profile {spec!r}: use one of {', '.join(gpu_profile_names())} or a JSON file")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"bad GPU profile {path}: {exc}") from None
    return GpuProfile.from_json(data, str(path))


def save_gpu_profile(profile: GpuProfile, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile.to_json(), indent=1) + "\n")
