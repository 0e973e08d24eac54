"""The few architecture numbers the layers need, read from a HF `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from odma.errors import ConfigError

SUPPORTED_ARCHS = ("llama", "qwen2")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str  # "llama" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 has q/k/v biases, Llama does not (unless attention_bias)
    o_bias: bool  # Llama with attention_bias=True also biases o_proj; Qwen2 never does
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_ARCHS:
            raise ConfigError(f"model_type {self.model_type!r} is not supported; supported: {SUPPORTED_ARCHS}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "ModelConfig":
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_ARCHS:
            raise ConfigError(f"model_type {model_type!r} is not supported; supported: {SUPPORTED_ARCHS}")
        scaling = cfg.get("rope_scaling") or (cfg.get("rope_parameters") or {})
        if scaling.get("rope_type", scaling.get("type", "default")) not in ("default", None):
            raise ConfigError(f"rope scaling {scaling!r} is not supported yet")
        rope_theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_bias=model_type == "llama" and bool(cfg.get("attention_bias", False)),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        try:
            return cls.from_hf_dict(json.loads(path.read_text()))
        except FileNotFoundError as exc:
            raise ConfigError(f"no config.json in model folder {folder}") from exc
        except (json.JSONDecodeError, KeyError) as exc:
            raise ConfigError(f"bad config.json in {folder}: {exc}") from exc
