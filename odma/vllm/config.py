"""The plugin's one typed configuration (no vLLM), read from vLLM's `--additional-config '{"odma": {...}}'` and
overridable per field by ODMA_VLLM_<FIELD> environment variables (a deployment switch without editing a command).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

from odma.errors import ConfigError
from odma.vllm.order import ORDERS
from odma.vllm.runs import PLACEMENTS

ATTENTION_READS = ("runs", "paged", "off")


@dataclass(frozen=True, slots=True)
class PluginConfig:
    # contiguous block runs sized by the predicted length (off: vLLM's own block choice)
    runs: bool = True
    # the attention backend (odma/vllm/attention.py, with the plugin on): "runs" reads a run of consecutive block ids
    # as one range of rows, "paged" reads every block apart (the same kernel), "off" keeps vLLM's own CPU attention
    attention: str = "runs"
    # a run that cannot grow in place moves whole (its KV copied) to a place with room, instead of appending blocks
    # elsewhere; only with vLLM's plain scheduler (async scheduling appends)
    moves: bool = True
    # where a new run starts: "best-fit" (the smallest free extent that holds its claim), "halving" (in the largest
    # free extent, halfway into the slack after a live run), or "auto": best-fit where runs move, halving where they
    # cannot (its slack lets more runs outgrow their claims in place; with moves, best-fit kept more runs whole)
    placement: str = "auto"
    # the share of free blocks the youngest prefix-cache entries may hold back from runs (vLLM evicts the least
    # recently freed first; runs take the others): 0 lets runs evict any cached block
    cache_keep: float = 0.5
    # the waiting queue: fcfs (vLLM's own), sjf (shortest predicted remaining first, with aging), or adaptive (sjf
    # only while more requests wait than the running cap; arrival order below it)
    order: str = "adaptive"
    # a waiting request that arrived this many admission rounds before the newest waiting one goes before every
    # younger one (odma/vllm/order.py)
    aging_rounds: int = 256
    predictor: str = "default"  # odma's predictor spec ("default", "sklearn", "median", a folder)
    # a run's claim: "predicted" (the smallest bucket >= L̂) or "calibrated" (the predictor's reservation table, sized
    # for a 2 % miss rate): claims are soft, and the larger calibrated ones left fewer requests in one run
    claim: str = "predicted"
    generator: str | None = None  # whose lengths the predictor should assume (default: the served model's name)
    stats_file: str | None = None  # a JSON file the metrics are written to (every stats_every_s and at shutdown)
    stats_every_s: float = 30.0
    check_every_step: bool = False  # verify the runs against vLLM's pool after every step (tests; costs O(blocks))

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_READS:
            raise ConfigError(f"odma.vllm: attention must be one of {ATTENTION_READS}, got {self.attention!r}")
        if self.order not in ORDERS:
            raise ConfigError(f"odma.vllm: order must be one of {ORDERS}, got {self.order!r}")
        if self.placement not in ("auto", *PLACEMENTS):
            raise ConfigError(f"odma.vllm: placement must be one of {('auto', *PLACEMENTS)}, got {self.placement!r}")
        if self.claim not in ("predicted", "calibrated"):
            raise ConfigError(f"odma.vllm: claim must be 'predicted' or 'calibrated', got {self.claim!r}")
        if not isinstance(self.aging_rounds, int) or self.aging_rounds < 1:
            raise ConfigError(f"odma.vllm: aging_rounds must be an integer >= 1, got {self.aging_rounds!r}")
        if not (isinstance(self.cache_keep, (int, float)) and 0 <= self.cache_keep < 1):
            raise ConfigError(f"odma.vllm: cache_keep must be in [0, 1), got {self.cache_keep!r}")
        if not (self.stats_every_s > 0):
            raise ConfigError(f"odma.vllm: stats_every_s must be > 0, got {self.stats_every_s!r}")

    @classmethod
    def from_sources(cls, additional: Any, env: Mapping[str, str] | None = None) -> "PluginConfig":
        """`additional` is vLLM's additional_config (its "odma" entry is ours); env ODMA_VLLM_* override it."""
        env = os.environ if env is None else env
        given = additional.get("odma", {}) if isinstance(additional, Mapping) else {}
        if not isinstance(given, Mapping):
            raise ConfigError(f'odma.vllm: additional_config["odma"] must be an object, got {given!r}')
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise ConfigError(f"odma.vllm: unknown setting(s) {unknown}; known: {sorted(known)}")
        values = dict(given)
        for name in known:
            raw = env.get(f"ODMA_VLLM_{name.upper()}")
            if raw is not None:
                values[name] = _parse(name, raw, cls.__dataclass_fields__[name].default)
        return cls(**values)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _parse(name: str, raw: str, default: Any) -> Any:
    if isinstance(default, bool):
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"ODMA_VLLM_{name.upper()}={raw!r}: expected 1/0, true/false, on/off")
    if isinstance(default, int):
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"ODMA_VLLM_{name.upper()}={raw!r}: expected an integer") from None
    if isinstance(default, float):
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"ODMA_VLLM_{name.upper()}={raw!r}: expected a number") from None
    return (raw or None) if default is None else raw


def dumps(config: PluginConfig) -> str:
    return json.dumps(config.as_dict(), sort_keys=True)
