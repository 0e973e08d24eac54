"""Replay policies by name: each builds the real core policy + `KVPool` (or the paged model) it names.

A name is a preset, optionally refined with `/key=value` overrides, e.g. `odma/growth=double/alpha=0.5`.
Keys: bounds (quantile | optimal | equal-width), growth (next | large | double), large (share of the pool
held back for the large bucket), alpha (a number, or `cal`: the predictor's calibrated α and, unless given,
its ceiling and reservation table), tau, ceiling (tokens above which admission reserves no larger bucket;
default: the predictor's calibration, except in s3 and odma), table (on | off: the predictor's per-L̂-group
reservation table in place of α and the ceiling; default: on where both are the predictor's), scale (L̂ is
multiplied by this before the bucket choice: < 1 reserves tighter and relies on migration), predict
(predictor | oracle | none | a constant), k, batch (running requests at most, e.g. vLLM's max_num_seqs:
`paged/batch=256`), full (stall | preempt: what a request does when it cannot grow; default: --on-full).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from odma.config import GROWTH_POLICIES, BucketConfig, ReservationTable
from odma.errors import ConfigError
from odma.kv import (
    BucketManager,
    BucketPolicy,
    ContiguousKV,
    ExactPolicy,
    KVManager,
    KVPool,
    PagedKV,
    StaticPolicy,
    equal_width_bounds,
)

KINDS = ("static", "bucket", "exact", "paged")
BOUNDS = ("quantile", "optimal", "equal-width")
HINTS = ("none", "pred", "cal", "oracle")


@dataclass(frozen=True, slots=True)
class PolicySpec:
    name: str
    kind: str  # static | bucket | exact | paged
    predict: str = "predictor"  # predictor | oracle | none | a constant number of tokens
    bounds: str = "quantile"
    dynamic: bool = True  # bounds follow realized lengths (odma) or stay fixed (s3)
    growth: str = "next"
    large_share: float = 0.0
    alpha: float | None = None  # None: the predictor's calibration (`alpha=cal`), else 0
    tau: float | None = None  # None: the predictor's calibration, else inf
    ceiling: float | None = None  # None: the predictor's calibration, else inf
    table: bool | None = None  # the predictor's reservation table; None: where α and ceiling are the predictor's
    scale: float = 1.0
    k: int | None = None  # bucket count; None: the replay's --buckets
    max_batch: int | None = None  # running requests at most for this policy; None: the engine's setting
    on_full: str | None = None  # stall | preempt when growth finds no room; None: the engine's setting
    # engine scheduler only: admit while the running requests' predicted final KV stays within this share of
    # the pool (the engine's admission_demand); None: off
    demand: float | None = None
    # growth hint (output tokens the first growth goes straight to): none (bucket by bucket), pred (the L̂ this
    # policy uses, before its scale), cal (the predictor's calibrated reservation for that L̂) or oracle (the
    # realized length)
    hint: str = "none"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"policy kind must be one of {KINDS}, got {self.kind!r}")
        if self.bounds not in BOUNDS:
            raise ConfigError(f"{self.name}: bounds must be one of {BOUNDS}, got {self.bounds!r}")
        if self.growth not in GROWTH_POLICIES:
            raise ConfigError(f"{self.name}: growth must be one of {GROWTH_POLICIES}, got {self.growth!r}")
        if self.kind == "exact" and self.growth == "next":
            raise ConfigError(f"{self.name}: exact reservation grows by 'double' or 'large'")
        if not 0.0 <= self.large_share < 1.0:
            raise ConfigError(f"{self.name}: large must be in [0, 1), got {self.large_share}")
        if self.ceiling is not None and not self.ceiling >= 1:
            raise ConfigError(f"{self.name}: ceiling must be >= 1 token, got {self.ceiling}")
        if not (self.scale > 0 and math.isfinite(self.scale)):
            raise ConfigError(f"{self.name}: scale must be a positive number, got {self.scale}")
        if self.hint not in HINTS:
            raise ConfigError(f"{self.name}: hint must be one of {HINTS}, got {self.hint!r}")
        if self.demand is not None and not (0 < self.demand < math.inf):
            raise ConfigError(f"{self.name}: demand must be a positive share of the pool, got {self.demand}")
        if self.on_full not in (None, "stall", "preempt"):
            raise ConfigError(f"{self.name}: full must be stall or preempt, got {self.on_full!r}")
        if self.predict not in ("predictor", "oracle", "none"):
            try:
                float(self.predict)
            except ValueError:
                raise ConfigError(f"{self.name}: predict must be predictor, oracle, none or a number") from None


# The default odma configuration is the variant that won the replays in docs/analyze.md (optimal bounds
# beat equal-occupancy quantiles; reserving half of L̂ and growing into the next bucket beat reserving L̂);
# the others stay as named rows (odma/scale=1, odma-published, ...) so the trade-offs remain visible.
PRESETS: dict[str, PolicySpec] = {
    "static": PolicySpec("static", "static", predict="none"),
    "s3": PolicySpec("s3", "bucket", bounds="equal-width", dynamic=False, growth="next", alpha=0.0,
                     ceiling=math.inf),
    "odma-published": PolicySpec("odma-published", "bucket", bounds="quantile", growth="large", large_share=0.1),
    # reserves half of the raw L̂ by design: the calibrated α and ceiling belong to the 2 % target, not to it
    "odma": PolicySpec("odma", "bucket", bounds="optimal", growth="next", large_share=0.0, scale=0.5, alpha=0.0,
                       ceiling=math.inf),
    "oracle": PolicySpec("oracle", "exact", predict="oracle", growth="double"),
    "oracle-bucketed": PolicySpec("oracle-bucketed", "bucket", predict="oracle", bounds="optimal", growth="next"),
    "paged": PolicySpec("paged", "paged", predict="none"),
    "grow32": PolicySpec("grow32", "exact", predict="32", growth="double"),
    "grow-buckets": PolicySpec("grow-buckets", "bucket", predict="0", bounds="optimal", growth="next"),
}
DEFAULT_POLICIES = ("static", "s3", "odma-published", "odma", "oracle", "oracle-bucketed", "paged")

_KEYS = {
    "bounds": ("bounds", str),
    "growth": ("growth", str),
    "large": ("large_share", float),
    "alpha": ("alpha", lambda v: None if v == "cal" else float(v)),
    "tau": ("tau", float),
    "ceiling": ("ceiling", float),
    "table": ("table", lambda v: {"on": True, "off": False}[v.lower()]),
    "scale": ("scale", float),
    "predict": ("predict", str),
    "k": ("k", int),
    "batch": ("max_batch", int),
    "full": ("on_full", str),
    "dynamic": ("dynamic", lambda v: v.lower() in ("1", "true", "yes")),
    "hint": ("hint", str),
    "demand": ("demand", float),
}


def parse_policy(name: str) -> PolicySpec:
    base, *overrides = name.strip().split("/")
    if base not in PRESETS:
        raise ConfigError(f"unknown policy {base!r}: use one of {', '.join(PRESETS)} (optionally /key=value)")
    changes: dict = {"name": name.strip()}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in _KEYS:
            raise ConfigError(f"policy {name!r}: override {item!r} must be key=value with key in {', '.join(_KEYS)}")
        field, conv = _KEYS[key]
        try:
            changes[field] = conv(value)
        except (ValueError, KeyError):
            raise ConfigError(f"policy {name!r}: bad value in {item!r}") from None
    if "alpha" in changes and changes["alpha"] is None and "ceiling" not in changes:
        changes["ceiling"] = None  # the calibrated α was chosen together with its ceiling
    return dataclasses.replace(PRESETS[base], **changes)


def parse_policies(text: str) -> list[PolicySpec]:
    names = [n for n in (p.strip() for p in text.split(",")) if n]
    if names == ["all"]:
        names = list(PRESETS)
    if len(set(names)) != len(names):
        raise ConfigError(f"policy list has duplicates: {text!r}")
    return [parse_policy(n) for n in names]


@dataclass(frozen=True, slots=True)
class BuildContext:
    total_tokens: int  # KV budget in tokens
    max_new_tokens: int
    buckets: int = 8
    window: int = 2000
    refresh_every_n: int = 256
    align: int = 16
    page_tokens: int = 16
    bootstrap: tuple[int, ...] = ()  # realized lengths the dynamic buckets start from
    predictor_alpha: float | None = None
    predictor_tau: float | None = None
    predictor_ceiling: float | None = None
    predictor_table: ReservationTable | None = None


def build_manager(spec: PolicySpec, ctx: BuildContext) -> KVManager:
    """The KV manager a policy runs on: the real KVPool with the real core policy, or the paged model."""
    if spec.kind == "paged":
        return PagedKV(ctx.total_tokens, ctx.page_tokens, name=spec.name)
    buckets = None
    if spec.kind == "static":
        policy = StaticPolicy()
    elif spec.kind == "exact":
        policy = ExactPolicy(growth=spec.growth)
    else:
        buckets = bucket_manager(spec, ctx)
        policy = BucketPolicy(buckets, growth=spec.growth, name=spec.name)
    # the replays reserve the policy's size for every prompt (no worst case up front for long prompts)
    pool = KVPool(ctx.total_tokens, policy, large_share=spec.large_share, align=ctx.align, worst_case_prompt_share=1.0)
    return ContiguousKV(pool, name=spec.name, buckets=buckets)


def bucket_manager(spec: PolicySpec, ctx: BuildContext) -> BucketManager:
    k = spec.k or ctx.buckets
    alpha = spec.alpha if spec.alpha is not None else (ctx.predictor_alpha or 0.0)
    tau = spec.tau if spec.tau is not None else (ctx.predictor_tau if ctx.predictor_tau is not None else math.inf)
    ceiling = spec.ceiling if spec.ceiling is not None else (ctx.predictor_ceiling or math.inf)
    table = None  # a table maps the predictor's L̂ only: not an oracle's or a constant's
    calibrated = spec.alpha is None and spec.ceiling is None  # both the predictor's: so is its table
    if spec.predict == "predictor" and (spec.table if spec.table is not None else calibrated):
        if spec.table and ctx.predictor_table is None:
            raise ConfigError(f"{spec.name}: table=on, but the predictor's calibration has no reservation table")
        table = ctx.predictor_table
    if table is not None:  # the table replaces α and the ceiling
        alpha, ceiling = 0.0, math.inf
    if spec.predict == "oracle":  # exact lengths: inflation would only waste memory
        alpha, tau, ceiling = 0.0, math.inf, math.inf
    if spec.bounds == "equal-width" or not spec.dynamic:
        bounds = (
            equal_width_bounds(ctx.max_new_tokens, k)
            if spec.bounds == "equal-width"
            else BucketManager(_config(spec, ctx, k, alpha, tau, ceiling, table), ctx.bootstrap or None).bounds
        )
        return BucketManager.fixed(bounds, ctx.max_new_tokens, alpha=alpha, tau=tau, ceiling=ceiling, table=table)
    return BucketManager(_config(spec, ctx, k, alpha, tau, ceiling, table), ctx.bootstrap or None)


def _config(spec: PolicySpec, ctx: BuildContext, k: int, alpha: float, tau: float, ceiling: float,
            table: ReservationTable | None) -> BucketConfig:
    return BucketConfig(
        max_buckets=k,
        align=ctx.align,
        window=ctx.window,
        refresh_every_n=ctx.refresh_every_n,
        refresh_every_s=math.inf,  # count-based refresh only: wall-clock time would make replays differ
        method=spec.bounds,
        large_bound=ctx.max_new_tokens,
        alpha=alpha,
        tau=tau,
        ceiling=ceiling,
        table=table,
    )


def hint_for(spec: PolicySpec, predictor: float, uncertainty: float, oracle: int, calibrated) -> float | None:
    """The growth hint a policy hands the pool for one request (output tokens its first growth should hold)."""
    if spec.hint == "oracle":
        return float(oracle)
    if spec.hint == "none" or spec.predict == "none":
        return None
    raw = {"oracle": float(oracle), "predictor": predictor}.get(spec.predict)
    if raw is None:  # a constant guess: the same hint for every request
        raw, uncertainty = float(spec.predict), 0.0
    if spec.hint == "pred":
        return raw
    if calibrated is None:
        raise ConfigError(f"{spec.name}: hint=cal needs a predictor with a calibration")
    return float(calibrated.select(raw, uncertainty).bound)


def predicted_for(spec: PolicySpec, predictor: float, oracle: int) -> float | None:
    """The L̂ a policy hands the pool for one request."""
    if spec.predict == "none":
        return None
    if spec.predict == "oracle":
        value = float(oracle)
    elif spec.predict == "predictor":
        value = predictor
    else:
        value = float(spec.predict)
    return value * spec.scale
