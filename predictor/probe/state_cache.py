"""Prompt-end hidden states of the served model, every layer, computed once per (model, prompt) and kept on disk
(fp16) under cache_dir/probe_states/<model identity>/: training and evaluation read them instead of re-running
the prefill, and choosing a layer needs no second pass."""

from __future__ import annotations

import hashlib
import os
import tempfile
import uuid
from pathlib import Path
from typing import Sequence

import numpy as np


def _key(prompt: str) -> bytes:
    return hashlib.sha1(prompt.encode("utf-8")).digest()


class StateCache:
    def __init__(self, cache_dir: Path, identity: str) -> None:
        self.folder = Path(cache_dir) / "probe_states" / identity
        self._known: dict[bytes, np.ndarray] = {}
        if self.folder.exists():
            for shard in sorted(self.folder.glob("*.npz")):
                try:
                    with np.load(shard) as data:
                        for k, v in zip(data["ids"], data["states"]):
                            self._known[k.tobytes()] = v
                except (OSError, ValueError, KeyError):
                    continue  # a damaged shard is recomputed, never trusted

    def lookup(self, prompts: Sequence[str]) -> tuple[list[np.ndarray | None], list[int]]:
        found = [self._known.get(_key(p)) for p in prompts]
        return found, [i for i, f in enumerate(found) if f is None]

    def add(self, prompts: Sequence[str], states: np.ndarray) -> None:
        """states: [n, layers + 1, hidden]."""
        if not len(prompts):
            return
        ids = np.frombuffer(b"".join(_key(p) for p in prompts), dtype=np.uint8).reshape(len(prompts), 20)
        states = states.astype(np.float16)
        for p, s in zip(prompts, states):
            self._known[_key(p)] = s
        self.folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
        os.close(fd)
        with open(tmp, "wb") as fh:
            np.savez(fh, ids=ids, states=states)
        os.replace(tmp, self.folder / f"{uuid.uuid4().hex}.npz")  # atomic: readers see whole shards only


def prompt_states(states_model, prompts: Sequence[str], cache: StateCache | None = None, chunk: int = 256,
                  progress: bool = False) -> np.ndarray:
    """[n, layers + 1, hidden] float32: every layer's state at the last prompt token (`ServedModelStates`)."""
    layers = tuple(range(states_model.num_layers + 1))
    found, missing = cache.lookup(prompts) if cache else ([None] * len(prompts), list(range(len(prompts))))
    steps = range(0, len(missing), chunk)
    if progress and missing:
        from tqdm import tqdm

        steps = tqdm(steps, desc="served-model prefills", unit=f"x{chunk}")
    for s in steps:
        idx = missing[s : s + chunk]
        seqs = [states_model.prompt_ids(prompts[i]) for i in idx]
        got = states_model.last_states(seqs, layers)
        # rounded to the cache's fp16 whether cached or not, so a rerun reading the cache predicts the same
        block = np.stack([got[layer] for layer in layers], axis=1).astype(np.float16)
        for i, row in zip(idx, block):
            found[i] = row
        if cache is not None:  # checkpoint every chunk: an interrupted run keeps its work
            cache.add([prompts[i] for i in idx], block)
    if not prompts:
        return np.zeros((0, states_model.num_layers + 1, states_model.hidden_size), np.float32)
    return np.stack(found).astype(np.float32)
