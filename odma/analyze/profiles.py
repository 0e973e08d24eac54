"""Device + model profiles and the step-time cost model of the replay (no torch).

A decode step streams the weights once and every running request's KV once; newly admitted requests
add their prefill compute; a migration adds a sequential copy (read + write). The step takes the longer
of its memory time and its compute time (a roofline). Formulas and sources: docs/analyze.md.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from odma.errors import ConfigError

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The few numbers of a decoder-only model that set its weight and KV bytes."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = True
    dtype_bytes: int = 2  # bf16 weights and KV

    @classmethod
    def from_hf_config(cls, cfg: dict, name: str = "model", dtype_bytes: int = 2) -> "ModelShape":
        """From a Hugging Face config.json dict (Llama / Qwen2 style keys)."""
        try:
            heads = int(cfg["num_attention_heads"])
            return cls(
                name=name,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=int(cfg["hidden_size"]),
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias", False)),
                dtype_bytes=dtype_bytes,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"model config {name!r} lacks a field the cost model needs: {exc}") from None

    @property
    def kv_bytes_per_token(self) -> int:
        # K and V, every layer, every KV head
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h  # + two RMSNorm weights
        head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.num_layers * per_layer + self.embedding_params + head + h

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes

    @property
    def streamed_weight_bytes(self) -> int:
        """Bytes a decode step reads: every weight except the embedding table (only B rows are looked up)."""
        embedding_only = 0 if self.tie_word_embeddings else self.embedding_params
        return (self.params - embedding_only) * self.dtype_bytes

    @property
    def flops_per_token(self) -> int:
        """Forward FLOPs per token, 2 per multiply-add of the non-embedding weights (attention's
        context-length term is left out: < 2 % of the total at the lengths replayed here)."""
        return 2 * (self.params - self.embedding_params)


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    name: str
    memory_bytes: int
    bandwidth_bytes_s: float  # sequential (streaming) bandwidth
    peak_flops: float  # dense bf16/fp16 peak
    compute_efficiency: float = 0.5  # achieved / peak for GEMMs (prefill, batched decode)
    memory_utilization: float = 0.9  # share of memory the engine may use (rest: activations, runtime)
    random_access_ratio: float = 0.5  # B_rand / B_seq for paged KV reads (ODMA §2.2: 0.3-0.7)


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    device: DeviceSpec
    model: ModelShape
    decode_compute_bound: bool = True  # roofline: a big batch can make decode compute-bound

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    @property
    def kv_budget_bytes(self) -> int:
        budget = int(self.device.memory_bytes * self.device.memory_utilization) - self.model.weight_bytes
        if budget < self.kv_bytes_per_token * 1024:
            raise ConfigError(
                f"profile {self.name}: {self.device.memory_bytes / GIB:.1f} GiB x {self.device.memory_utilization} "
                f"leaves {budget / GIB:.2f} GiB for KV after {self.model.weight_bytes / GIB:.2f} GiB of weights"
            )
        return budget

    @property
    def kv_budget_tokens(self) -> int:
        return self.kv_budget_bytes // self.kv_bytes_per_token

    def with_overrides(self, **device_fields) -> "Profile":
        fields = {k: v for k, v in device_fields.items() if v is not None}
        return replace(self, device=replace(self.device, **fields)) if fields else self

    def to_json(self) -> dict:
        d = asdict(self)
        d["derived"] = {
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "weight_bytes": self.model.weight_bytes,
            "params": self.model.params,
            "kv_budget_bytes": self.kv_budget_bytes,
            "kv_budget_tokens": self.kv_budget_tokens,
        }
        return d


@dataclass(frozen=True, slots=True)
class StepWork:
    """What one engine step does."""

    decode_tokens: int  # requests that generate a token this step
    kv_tokens_read: int  # Σ context tokens those requests attend over
    prefill_tokens: int  # prompt tokens prefilled this step
    copied_tokens: int = 0  # tokens moved by migrations this step
    # (tokens cached before, tokens fed) of each prefill chunk, for models that charge attention over long
    # prompts (the CPU table of `odma.analyze.simulate`); the roofline leaves that term out (docs/analyze.md)
    prefill_chunks: tuple[tuple[int, int], ...] = ()


class CostModel:
    """Seconds per engine step on a profile; `paged=True` reads KV at the random-access bandwidth."""

    def __init__(self, profile: Profile, paged: bool = False) -> None:
        d, m = profile.device, profile.model
        self.profile = profile
        self._weights_s = m.streamed_weight_bytes / d.bandwidth_bytes_s
        kv_bw = d.bandwidth_bytes_s * (d.random_access_ratio if paged else 1.0)
        self._kv_s_per_token = m.kv_bytes_per_token / kv_bw
        self._copy_s_per_token = 2 * m.kv_bytes_per_token / d.bandwidth_bytes_s  # read + write
        self._flop_s_per_token = m.flops_per_token / (d.peak_flops * d.compute_efficiency)
        self._decode_compute = profile.decode_compute_bound

    def step_seconds(self, work: StepWork) -> float:
        memory = self._weights_s + work.kv_tokens_read * self._kv_s_per_token
        compute_tokens = work.prefill_tokens + (work.decode_tokens if self._decode_compute else 0)
        compute = compute_tokens * self._flop_s_per_token
        return max(memory, compute) + work.copied_tokens * self._copy_s_per_token


# DeepSeek-R1-Distill-Qwen-7B config.json (Qwen2 architecture), the fields the cost model reads.
QWEN7B_CONFIG = {
    "model_type": "qwen2",
    "vocab_size": 152064,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
}
# SmolLM2-135M-Instruct (Llama architecture), odma's default served model.
SMOLLM2_CONFIG = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "tie_word_embeddings": True,
}

MLU370 = DeviceSpec(
    name="Cambricon MLU370 (24 GB LPDDR5)",
    memory_bytes=24 * GIB,
    bandwidth_bytes_s=307.2e9,
    peak_flops=96e12,  # MLU370 bf16 peak as published for the MLU370-X8 launch (see docs/analyze.md)
)
# A 2-socket-class CPU serving SmolLM2 from DRAM; figures are round and meant to be overridden.
CPU = DeviceSpec(
    name="CPU (DDR4/DDR5 server socket)",
    memory_bytes=16 * GIB,
    bandwidth_bytes_s=50e9,
    peak_flops=1.5e12,
    compute_efficiency=0.3,
    memory_utilization=0.25,  # the KV arena is a slice of host memory, not all of it
)

PROFILES: dict[str, Profile] = {
    "mlu370-qwen7b": Profile(
        "mlu370-qwen7b", MLU370, ModelShape.from_hf_config(QWEN7B_CONFIG, "DeepSeek-R1-Distill-Qwen-7B")
    ),
    "cpu-smollm2": Profile("cpu-smollm2", CPU, ModelShape.from_hf_config(SMOLLM2_CONFIG, "SmolLM2-135M-Instruct")),
}


def load_profile(spec: str) -> Profile:
    """A profile by name, or a JSON file: {"name", "device": {DeviceSpec fields, memory_gib for
    memory_bytes}, "model_config": path to an HF config.json (or "model": the config dict inline)}."""
    if spec in PROFILES:
        return PROFILES[spec]
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ConfigError(f"unknown profile {spec!r}: use one of {', '.join(PROFILES)} or a JSON file")
    try:
        data = json.loads(path.read_text())
        dev = dict(data["device"])
        if "memory_gib" in dev:
            dev["memory_bytes"] = int(float(dev.pop("memory_gib")) * GIB)
        device = DeviceSpec(**dev)
        if "model_config" in data:
            cfg_path = (path.parent / data["model_config"]).expanduser()
            if cfg_path.is_dir():
                cfg_path = cfg_path / "config.json"
            model_cfg = json.loads(cfg_path.read_text())
        else:
            model_cfg = data["model"]
        model = ModelShape.from_hf_config(model_cfg, data.get("model_name", "model"), int(data.get("dtype_bytes", 2)))
        profile = Profile(str(data.get("name", path.stem)), device, model, bool(data.get("decode_compute_bound", True)))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"bad profile file {path}: {exc}") from None
    _ = profile.kv_budget_bytes  # validates that a KV budget is left
    if not (0 < device.random_access_ratio <= 1 and 0 < device.compute_efficiency <= 1):
        raise ConfigError(f"profile {path}: random_access_ratio and compute_efficiency must be in (0, 1]")
    if not math.isfinite(device.bandwidth_bytes_s) or device.bandwidth_bytes_s <= 0:
        raise ConfigError(f"profile {path}: bandwidth_bytes_s must be > 0")
    return profile
