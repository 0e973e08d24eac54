"""Partial fine-tuning: train the top N encoder layers together with the heads (the rest stays frozen).

On 2 CPU cores a full fine-tune of even a 3-layer MiniLM costs minutes per epoch; training only the top layer
keeps the bottom of the graph identical to the installed backbone, so only that layer (~1.8M weights, stored
fp16) has to be shipped next to the heads.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from predictor.encoder import LengthHeads, LengthModel, MeanPooledEncoder, layer_list
from predictor.features import drop_metadata
from predictor.text import encode_texts
from training.heads import HeadTraining

TUNED_FILE = "encoder_tuned.safetensors"


@dataclass(frozen=True)
class FineTuning:
    layers: int = 1  # top encoder layers to train
    epochs: int = 3
    batch_size: int = 32
    lr_encoder: float = 5e-5
    lr_heads: float = 5e-4
    holdout: float = 0.1
    metadata_dropout: float = 0.25
    regression_weight: float = HeadTraining.regression_weight  # the same loss balance as the heads alone
    seed: int = 0


def tuned_parameter_names(encoder: MeanPooledEncoder, n_layers: int) -> list[str]:
    owner, attr = layer_list(encoder.backbone)
    blocks = getattr(owner, attr)
    keep = {id(p) for block in list(blocks)[-n_layers:] for p in block.parameters()}
    return [name for name, p in encoder.named_parameters() if id(p) in keep]


def fine_tune(encoder: MeanPooledEncoder, heads: LengthHeads, tokenizer, texts: list[str], meta: np.ndarray,
              lengths: np.ndarray, labels: np.ndarray, max_len: int, cfg: FineTuning,
              progress: bool = True) -> LengthModel:
    """Start from the frozen-encoder heads; keep the epoch with the lowest holdout loss."""
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    tuned = set(tuned_parameter_names(encoder, cfg.layers))
    for name, p in encoder.named_parameters():
        p.requires_grad_(name in tuned)
    model = LengthModel(encoder, heads)
    opt = torch.optim.AdamW([
        {"params": [p for n, p in encoder.named_parameters() if n in tuned], "lr": cfg.lr_encoder},
        {"params": list(heads.parameters()), "lr": cfg.lr_heads},
    ], weight_decay=0.01)
    n = len(texts)
    perm = rng.permutation(n)
    n_hold = int(round(n * cfg.holdout))
    hold, fit = perm[:n_hold], perm[n_hold:]
    y = torch.from_numpy(np.log1p(lengths.astype(np.float32)))
    t = torch.from_numpy(labels.astype(np.int64))
    text_len = np.array([len(x or "") for x in texts])

    def batches(idx: np.ndarray, shuffle: bool) -> list[np.ndarray]:
        # Similar lengths together (little padding), batch order shuffled.
        order = idx[np.argsort(text_len[idx] + (rng.random(len(idx)) * 40 if shuffle else 0), kind="stable")]
        out = [order[s : s + cfg.batch_size] for s in range(0, len(order), cfg.batch_size)]
        if shuffle:
            rng.shuffle(out)
        return out

    def loss_on(idx: np.ndarray, drop: bool) -> torch.Tensor:
        enc = encode_texts(tokenizer, [texts[i] for i in idx], max_len)
        m = drop_metadata(meta[idx], cfg.metadata_dropout, rng) if drop else meta[idx]
        emb = encoder(torch.from_numpy(enc.input_ids), torch.from_numpy(enc.attention_mask))
        reg, logits = heads(emb, torch.from_numpy(m.astype(np.float32)))
        return F.cross_entropy(logits, t[idx]) + cfg.regression_weight * F.smooth_l1_loss(reg, y[idx], beta=0.1)

    def held_loss() -> float:
        model.eval()
        with torch.no_grad():
            parts = [(float(loss_on(b, False)), len(b)) for b in batches(hold, False)]
        return sum(l * k for l, k in parts) / max(1, sum(k for _, k in parts))

    best_state, best = copy.deepcopy(model.state_dict()), held_loss()
    for epoch in range(cfg.epochs):
        model.train()
        plan = batches(fit, True)
        if progress:
            from tqdm import tqdm

            desc = f"fine-tuning top {cfg.layers} layer(s), epoch {epoch + 1}/{cfg.epochs}"
            plan = tqdm(plan, desc=desc, unit="batch")
        for b in plan:
            loss = loss_on(b, True)
            opt.zero_grad()
            loss.backward()
            opt.step()
        held = held_loss()
        if progress:
            print(f"[odma-train] epoch {epoch + 1}: holdout loss {held:.4f} (best {best:.4f})", flush=True)
        if held < best:
            best, best_state = held, copy.deepcopy(model.state_dict())
    model.load_state_dict(best_state)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def tuned_state(encoder: MeanPooledEncoder, n_layers: int) -> dict[str, torch.Tensor]:
    """The tuned layers' weights in fp16 (what is shipped); round the live model to them too, so the graph
    evaluated at training time is exactly the one rebuilt from the shipped files."""
    names = set(tuned_parameter_names(encoder, n_layers))
    state = {}
    with torch.no_grad():
        for name, p in encoder.named_parameters():
            if name in names:
                half = p.detach().to(torch.float16).contiguous()
                p.copy_(half.to(p.dtype))
                state[name] = half
    return state
