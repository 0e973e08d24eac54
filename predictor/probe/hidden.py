"""The served model's own hidden states, computed standalone (training, `odma-train --eval-only`, a predictor
used outside the engine). The engine gets the same rows from its own prefill (`ModelRunner.capture_layers`).

A prompt is chat-templated exactly as `odma-serve` templates a one-message chat, prefilled with odma's own
model code, and the residual stream after the chosen layer is read at the last prompt token: the position whose
output is the first generated token, i.e. what the engine's `HiddenCapture` returns when a prefill finishes.
Teacher forcing (`states_at`) reads the same stream at later positions of prompt + answer: what the engine would
capture at a decode step after that many generated tokens.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from odma.errors import ConfigError
from odma.kv import Block
from odma.models.llama import CausalLM, HiddenCapture, SeqSlot

MAX_BATCH_TOKENS = 4096  # prompt tokens per packed prefill (bounds the activations of one forward)
MAX_PROMPT_TOKENS = 4096  # longer prompts keep their last tokens (the tail decides what comes next)


class ServedModelStates:
    def __init__(self, model: CausalLM, tokenizer: Any, max_batch_tokens: int = MAX_BATCH_TOKENS,
                 max_prompt_tokens: int = MAX_PROMPT_TOKENS) -> None:
        from backends import KVLayout, get_backend

        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_tokens = max_batch_tokens
        self.max_prompt_tokens = max_prompt_tokens
        c = model.config
        self.backend = get_backend(str(model.device))
        self.layout = KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, model.dtype)
        self.num_layers = c.num_layers
        self.hidden_size = c.hidden_size

    @classmethod
    def load(cls, model_spec: str, dtype: str = "float32") -> "ServedModelStates":
        """The model odma-serve would load for `model_spec` ("smollm2", a folder, ...), with its tokenizer."""
        from transformers import AutoTokenizer

        from odma.models import DTYPES, load_model, resolve_model

        folder = resolve_model(model_spec)
        return cls(load_model(folder, dtype=DTYPES[dtype]), AutoTokenizer.from_pretrained(str(folder)))

    def prompt_ids(self, prompt: str) -> list[int]:
        """Token ids the engine prefills for a one-message chat (the server's template, no extra specials)."""
        if getattr(self.tokenizer, "chat_template", None):
            prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                        add_generation_prompt=True, tokenize=False)
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        return ids[-self.max_prompt_tokens:] if len(ids) > self.max_prompt_tokens else ids

    def last_states(self, sequences: Sequence[list[int]], layers: tuple[int, ...]) -> dict[int, np.ndarray]:
        """{layer: [len(sequences), hidden] float32}: the state at each sequence's last token."""
        out = {layer: np.zeros((len(sequences), self.hidden_size), np.float32) for layer in layers}
        for batch in self._batches([len(s) for s in sequences]):
            capture = HiddenCapture(tuple(layers))
            self._forward([sequences[i] for i in batch], capture)
            for layer in layers:
                out[layer][batch] = capture.last[layer].numpy()
        return out

    def states_at(self, ids: list[int], positions: Sequence[int], layers: tuple[int, ...]) -> dict[int, np.ndarray]:
        """{layer: [len(positions), hidden]}: the states at these positions of one sequence fed whole (teacher
        forcing), read by forward hooks on the decoder layers (layer 0: the embeddings)."""
        rows = torch.as_tensor(list(positions), dtype=torch.long)
        if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= len(ids)):
            raise ConfigError(f"positions must lie in [0, {len(ids)})")
        taken: dict[int, torch.Tensor] = {}
        hooks = []
        for layer in layers:
            module = self.model.model.embed_tokens if layer == 0 else self.model.model.layers[layer - 1]
            hooks.append(module.register_forward_hook(
                lambda _m, _inp, out, layer=layer: taken.__setitem__(layer, out[rows].float())))
        try:
            self._forward([ids], None)
        finally:
            for h in hooks:
                h.remove()
        return {layer: taken[layer].numpy() for layer in layers}

    def _batches(self, lengths: list[int]) -> list[list[int]]:
        """Indices grouped into packed prefills of at most max_batch_tokens (one long sequence alone)."""
        batches, current, tokens = [], [], 0
        for i in np.argsort(lengths, kind="stable"):
            n = lengths[i]
            if current and tokens + n > self.max_batch_tokens:
                batches.append(current)
                current, tokens = [], 0
            current.append(int(i))
            tokens += n
        if current:
            batches.append(current)
        return batches

    @torch.inference_mode()
    def _forward(self, sequences: list[list[int]], capture: HiddenCapture | None) -> None:
        if any(not s for s in sequences):
            raise ConfigError("cannot prefill an empty sequence")
        total = sum(len(s) for s in sequences)
        arena = self.backend.create_arena(total, self.layout)
        try:
            slots, offset = [], 0
            for s in sequences:
                slots.append(SeqSlot(arena.view(Block(offset, len(s), 0)), 0, len(s)))
                offset += len(s)
            device = self.model.device
            ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=device)
            positions = torch.tensor([p for s in sequences for p in range(len(s))], dtype=torch.long, device=device)
            self.model(ids, positions, slots, capture=capture)
        finally:
            self.backend.free_arena(arena)
