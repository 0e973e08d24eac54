"""Which served model a probe belongs to: a head fitted on one model's hidden states means nothing on another's."""

from __future__ import annotations

import hashlib
import json

import torch

from odma.models.llama import CausalLM


def model_identity(model: CausalLM) -> str:
    """A short fingerprint of the architecture and of a slice of the weights, stable across dtypes that round the
    same weights (bf16 weights from fp32 ones give the same identity as the fp32 model)."""
    c = model.config
    arch = json.dumps({"layers": c.num_layers, "hidden": c.hidden_size, "heads": c.num_heads,
                       "kv_heads": c.num_kv_heads, "vocab": c.vocab_size}, sort_keys=True)
    with torch.no_grad():
        # through the embedding's forward: the same rows whether they are a table or GGUF blocks (native weights)
        ids = torch.arange(64, device=model.device)
        rows = model.model.embed_tokens(ids).detach().to("cpu", torch.bfloat16).float().contiguous()
        norm = model.model.layers[0].input_layernorm.weight.detach().to("cpu", torch.bfloat16).float().contiguous()
    h = hashlib.sha256(arch.encode())
    h.update(rows.numpy().tobytes())
    h.update(norm.numpy().tobytes())
    return h.hexdigest()[:16]
