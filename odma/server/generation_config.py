"""Sampling defaults for requests that leave a parameter out, as vLLM sets them: from the model's
`generation_config.json` (`--generation-config auto`, the default), from another folder's
(`--generation-config PATH`), or none (`--generation-config vllm`: OpenAI's defaults), then
`--override-generation-config '{"temperature": 0.6}'` on top. The server says at start-up which are in force.
Under `auto`, the embedded default model (SmolLM2-135M-Instruct, whose file sets none) gets what its model card
recommends (`odma.models.weights.SMOLLM2_SAMPLING`); a value its file sets would come first.

odma's sampler knows temperature, top_p and top_k; `max_new_tokens` becomes the default max_tokens of chat
requests. Other sampling keys in a model's file (repetition_penalty, min_p...) cannot be honoured: they are
named in a warning; asked for in the override, they stop the start-up.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from odma.engine.sampling import MAX_TEMPERATURE
from odma.errors import ConfigError
from odma.server.served_engine import ServedEngine

log = logging.getLogger(__name__)

SUPPORTED = ("temperature", "top_p", "top_k", "max_new_tokens")
# keys of a generation_config.json that change how tokens are drawn, which odma's sampler does not implement
UNSUPPORTED = ("repetition_penalty", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "no_repeat_ngram_size",
               "num_beams", "penalty_alpha", "diversity_penalty", "length_penalty", "encoder_repetition_penalty")


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    max_tokens: int | None = None  # chat requests without max_tokens; None: the server's --default-max-tokens
    source: str = "OpenAI's defaults"

    def describe(self, default_max_tokens: int) -> str:
        max_tokens = self.max_tokens or default_max_tokens
        return (f"temperature={self.temperature:g} top_p={self.top_p:g} top_k={self.top_k or 'off'} "
                f"max_tokens={max_tokens} (chat; completions: 16, as OpenAI) [{self.source}]")


def _checked(values: dict[str, Any], where: str) -> dict[str, Any]:
    out = {}
    for key in SUPPORTED:
        if key not in values or values[key] is None:
            continue
        v = values[key]
        ok = {
            "temperature": lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= MAX_TEMPERATURE,
            "top_p": lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x <= 1,
            "top_k": lambda x: type(x) is int and x >= -1,
            "max_new_tokens": lambda x: type(x) is int and x >= 1,
        }[key](v)
        if not ok:
            raise ConfigError(f"{where}: {key}={v!r} is out of range")
        out[key] = v
    return out


def _read(folder: Path) -> dict[str, Any]:
    path = folder / "generation_config.json"
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return data


def _auto(folder: Path | None) -> tuple[dict[str, Any], str]:
    """The sampling values a model folder's generation_config.json sets, and where they come from."""
    if folder is None or not folder.is_dir():
        return {}, "OpenAI's defaults (no model folder)"
    values = _read(folder)
    ignored = sorted(k for k in UNSUPPORTED if k in values)
    if ignored:
        log.warning("%s/generation_config.json sets %s, which odma's sampler does not implement: ignored",
                    folder, ", ".join(f"{k}={values[k]!r}" for k in ignored))
    values = _checked(values, f"{folder}/generation_config.json")
    return values, (f"{folder.name}/generation_config.json" if values
                    else f"OpenAI's defaults ({folder.name}/generation_config.json sets none)")


def engine_sampling_defaults(engine: ServedEngine, mode: str, override: str | dict | None = None) -> "SamplingDefaults":
    """The defaults of the model an engine serves: its converted folder, or the folder it was given."""
    from odma.models.weights import model_name, recommended_sampling

    config = engine.config
    folder = engine.model_folder or (Path(config.model) if Path(config.model).is_dir() else None)
    recommended = recommended_sampling(config.model)
    card = f"{model_name(config.model)}'s model card" if recommended else None
    return load_sampling_defaults(mode, folder, override, config.max_tokens_cap, recommended=recommended, card=card)


def load_sampling_defaults(mode: str, model_folder: Path | None, override: str | dict | None = None,
                           max_tokens_cap: int | None = None, *, recommended: dict | None = None,
                           card: str | None = None) -> SamplingDefaults:
    """`mode`: "auto" (the model folder's generation_config.json, over `recommended`: what the model's `card`
    recommends where its file is silent), "vllm" (none), or a folder holding one. `override`: a JSON object (or its
    text) applied on top; an unsupported key in it is a ConfigError."""
    if mode == "vllm":
        values, source = {}, "OpenAI's defaults (--generation-config vllm)"
    else:
        folder = model_folder if mode == "auto" else Path(mode).expanduser()
        if mode != "auto" and (folder is None or not folder.is_dir()):
            raise ConfigError(f"--generation-config {mode!r}: not a folder")
        values, source = _auto(folder)
        unset = {k: v for k, v in (recommended or {}).items() if k not in values} if mode == "auto" else {}
        if unset:  # what the model's file leaves out, its card recommends
            told = f"{card or 'the model card'} ({' '.join(f'{k}={v:g}' for k, v in unset.items())})"
            source = told if not values else f"{source} + {told}"
            values = {**unset, **values}
    if override:
        try:
            extra = json.loads(override) if isinstance(override, str) else dict(override)
        except ValueError as exc:
            raise ConfigError(f"--override-generation-config is not JSON: {exc}") from None
        if not isinstance(extra, dict):
            raise ConfigError("--override-generation-config must be a JSON object")
        unknown = sorted(set(extra) - set(SUPPORTED))
        if unknown:
            raise ConfigError(f"--override-generation-config: {', '.join(unknown)} not supported "
                              f"(odma's sampler knows {', '.join(SUPPORTED)})")
        values = {**values, **_checked(extra, "--override-generation-config")}
        source += " + --override-generation-config"
    defaults = SamplingDefaults(source=source)
    if "temperature" in values:
        defaults = replace(defaults, temperature=float(values["temperature"]))
    if "top_p" in values:
        defaults = replace(defaults, top_p=float(values["top_p"]))
    if "top_k" in values:
        defaults = replace(defaults, top_k=max(0, values["top_k"]))
    if "max_new_tokens" in values:
        cap = max_tokens_cap or values["max_new_tokens"]
        if values["max_new_tokens"] > cap:
            log.warning("max_new_tokens=%d is above --max-tokens-cap %d: the default is %d",
                        values["max_new_tokens"], cap, cap)
        defaults = replace(defaults, max_tokens=min(values["max_new_tokens"], cap))
    return defaults
