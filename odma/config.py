"""The memory core's typed configuration (buckets, pool, reservation table) and the data and cache folders.

The engine's `odma.engine.config.EngineConfig` holds one `PoolConfig` and one `BucketConfig`: together they are
the one configuration of a serving process, and `odma-serve`'s flags map onto them (docs/serving.md says which
fields are config-only).
"""

from __future__ import annotations

import bisect
import math
import os
from dataclasses import dataclass
from pathlib import Path

from odma.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parent.parent


def default_data_dir() -> Path:
    """$ODMA_DATA_DIR, else ../shared/datasets beside the repo (the shared read-only data). An installed wheel has
    no repo around it: there the first of ./shared/datasets and ../shared/datasets (from the working directory)
    that exists, else the path beside the package (named in the error of whatever reads it)."""
    env = os.environ.get("ODMA_DATA_DIR")
    if env:
        return Path(env).expanduser()
    beside_repo = REPO_ROOT.parent / "shared" / "datasets"
    if beside_repo.is_dir():
        return beside_repo
    for candidate in (Path.cwd() / "shared" / "datasets", Path.cwd().parent / "shared" / "datasets"):
        if candidate.is_dir():
            return candidate
    return beside_repo


def default_cache_dir() -> Path:
    """$ODMA_CACHE_DIR, else ~/.cache/odma: converted models, tokenizers, tokenized traces."""
    env = os.environ.get("ODMA_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "odma"


@dataclass(frozen=True, slots=True)
class ReservationTable:
    """Admission reservations by L̂ group, calibrated offline (`predictor.calibration.reservation_table`):
    L̂ < edges[0] reserves tokens[0], edges[i-1] <= L̂ < edges[i] reserves tokens[i], the rest tokens[-1].
    With a weak L̂ a per-group reservation fits the tail of each group, which one inflation factor cannot."""

    edges: tuple[float, ...]
    tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.edges) + 1:
            raise ConfigError(f"a reservation table needs one more token count than edges, got "
                              f"{len(self.edges)} edges and {len(self.tokens)} token counts")
        if any(not math.isfinite(e) for e in self.edges) or any(a >= b for a, b in zip(self.edges, self.edges[1:])):
            raise ConfigError(f"reservation table edges must be finite and increasing, got {self.edges}")
        if any(t < 1 for t in self.tokens):
            raise ConfigError(f"reservation table token counts must be >= 1, got {self.tokens}")

    def lookup(self, predicted: float) -> int:
        return self.tokens[bisect.bisect_right(self.edges, predicted)]

    def to_json(self) -> dict:
        return {"edges": list(self.edges), "tokens": list(self.tokens)}

    @classmethod
    def from_json(cls, d: dict) -> "ReservationTable":
        """Raises ConfigError, KeyError, TypeError or ValueError on a malformed block."""
        return cls(tuple(float(e) for e in d["edges"]), tuple(int(t) for t in d["tokens"]))


@dataclass(frozen=True, slots=True)
class BucketConfig:
    """How realized lengths become bucket bounds, and how a prediction picks a bucket."""

    max_buckets: int = 8
    align: int = 16  # bounds are multiples of this many tokens
    window: int = 2000  # realized lengths kept for the quantiles
    min_samples: int = 64  # fewer than this: keep the bootstrap bounds
    refresh_every_n: int = 256  # completions between refreshes
    refresh_every_s: float = 30.0  # or seconds, whichever comes first
    # "optimal" (min expected reserved tokens, DP) beat "quantile" (equal occupancy) on every replayed trace
    method: str = "optimal"
    large_bound: int = 2048  # output tokens the large bucket reserves (the max_new_tokens cap)
    alpha: float = 0.0  # inflation: reserve for L̂·(1 + alpha·u)
    tau: float = math.inf  # u above this goes straight to the large bucket
    # admission never reserves a bucket above the one holding this many tokens (u > tau aside); a request
    # that outgrows it migrates. Calibrated, it keeps a weak L̂ from reserving more than one constant would.
    ceiling: float = math.inf
    # when set, admission reserves the first bucket >= table.lookup(L̂) instead of L̂·(1 + α·u) (u > tau aside)
    table: ReservationTable | None = None

    def __post_init__(self) -> None:
        if self.max_buckets < 1:
            raise ConfigError(f"max_buckets must be >= 1, got {self.max_buckets}")
        if self.align < 1:
            raise ConfigError(f"align must be >= 1, got {self.align}")
        if self.window < 1 or self.min_samples < 1:
            raise ConfigError("window and min_samples must be >= 1")
        if self.refresh_every_n < 1 or self.refresh_every_s <= 0:
            raise ConfigError("refresh_every_n must be >= 1 and refresh_every_s > 0")
        if self.method not in ("quantile", "optimal"):
            raise ConfigError(f"method must be 'quantile' or 'optimal', got {self.method!r}")
        if self.large_bound < 1:
            raise ConfigError(f"large_bound must be >= 1, got {self.large_bound}")
        if self.alpha < 0 or math.isnan(self.alpha):
            raise ConfigError(f"alpha must be >= 0, got {self.alpha}")
        if math.isnan(self.tau) or self.tau < 0:
            raise ConfigError(f"tau must be >= 0, got {self.tau}")
        if math.isnan(self.ceiling) or self.ceiling < 1:
            raise ConfigError(f"ceiling must be >= 1 token, got {self.ceiling}")
        if self.table is not None and (self.alpha != 0 or math.isfinite(self.ceiling)):
            raise ConfigError("a reservation table replaces alpha and the ceiling: set alpha=0 and no ceiling")


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """The KV pool of one device."""

    # share held back for uncertain and overflowing requests; 0 by default: it never helped in the replays
    large_share: float = 0.0
    align: int = 16  # block capacities and offsets are multiples of this many tokens
    # what a request that outgrows its block migrates to: next (bucket) | large | double | step (growth_step tokens
    # beyond what it needs: what packing uses, docs/results/gpu/replay_policy.md)
    growth: str = "next"
    growth_step: int = 64  # output tokens beyond the need that growth "step" reserves
    # reserve for reserve_scale·L̂ and grow by migration: 0.5 won the replays (docs/analyze.md)
    reserve_scale: float = 0.5
    # pred: a request's first growth goes straight to the bucket that holds its L̂ (before reserve_scale) instead of
    # the next bucket. Fewer migrations (-9 to -16 % replayed, -11 % real), but where memory binds the larger block is refused more
    # often: on the real engine +32 to +57 % preemptions and 0.96-0.98x throughput (docs/BENCHMARKS.md), so off
    growth_hint: str = "none"
    # a block that cannot grow although the pool's free units could hold its growth (fragmentation) gets a range
    # by relocating the blocks in the emptiest one (copies at the device's copy speed) instead of preempting a
    # request; off by default where copies are slow (a CPU pool), on in odma-bench gpu's engine
    compact_growth: bool = False
    # with compact_growth, when no range can be cleared that way (the blocks in it have nowhere else to go), blocks
    # slide over the gaps between them until the growth fits (a partial compaction: odma.kv.reclaim.slide_for_growth;
    # a move may overlap the block's old place)
    slide_growth: bool = False
    # a block that cannot grow in place grows over the free units before it too (gaps too small for anything else):
    # one overlapping copy instead of a migration elsewhere
    neighbour_growth: bool = False
    # a block that cannot grow where it lies goes on in a new block and its rows so far are read where they are (a
    # piece, as prefix reads are: the Triton attention reads tables of pieces) instead of being copied or slid for;
    # off until a GPU has timed the pieces (docs/results/gpu/replay_policy.md)
    continue_growth: bool = False
    # a request whose prompt exceeds this share of the pool's largest range reserves its worst case up front:
    # growing its block by migration would need a second range at least that large
    worst_case_prompt_share: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 < self.worst_case_prompt_share <= 1.0:
            raise ConfigError(f"worst_case_prompt_share must be in (0, 1], got {self.worst_case_prompt_share}")
        if not 0.0 <= self.large_share < 1.0:
            raise ConfigError(f"large_share must be in [0, 1), got {self.large_share}")
        if self.align < 1:
            raise ConfigError(f"align must be >= 1, got {self.align}")
        if not (0 < self.reserve_scale < math.inf):
            raise ConfigError(f"reserve_scale must be a positive number, got {self.reserve_scale}")
        if self.growth not in GROWTH_POLICIES:
            raise ConfigError(f"growth must be one of {GROWTH_POLICIES}, got {self.growth!r}")
        if type(self.growth_step) is not int or self.growth_step < 1:
            raise ConfigError(f"growth_step must be a whole number of tokens >= 1, got {self.growth_step!r}")
        if self.growth_hint not in GROWTH_HINTS:
            raise ConfigError(f"growth_hint must be one of {GROWTH_HINTS}, got {self.growth_hint!r}")


GROWTH_POLICIES = ("next", "large", "double", "step")
GROWTH_HINTS = ("pred", "none")
