"""Pooled text embeddings of a frozen encoder, computed once per (encoder, text) and kept on disk.

With a frozen encoder, the heads train on these in seconds; the expensive part (the encoder pass) is paid once
per text and reused across runs, traces and the S3 baseline.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import uuid
from pathlib import Path

import numpy as np
import torch

from predictor.encoder import MeanPooledEncoder
from predictor.text import encode_texts


def encoder_key(backbone_dir: Path, layers: int | None, max_len: int) -> str:
    """Changes whenever the weights, the depth or the truncation change."""
    weights = sorted(backbone_dir.glob("*.safetensors")) or sorted(backbone_dir.glob("*.bin"))
    stamp = "|".join(f"{w.name}:{w.stat().st_size}:{w.stat().st_mtime_ns}" for w in weights)
    raw = f"{backbone_dir.resolve()}|{stamp}|layers={layers}|max_len={max_len}|text-v1"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _text_id(text: str | None) -> bytes:
    return hashlib.sha1((text or "").encode("utf-8")).digest()


class EmbeddingCache:
    """Shards of (text sha1 → embedding) under cache_dir/embeddings/<encoder key>/."""

    def __init__(self, cache_dir: Path, key: str) -> None:
        self.folder = Path(cache_dir) / "embeddings" / key
        self._known: dict[bytes, np.ndarray] = {}
        if self.folder.exists():
            for shard in sorted(self.folder.glob("*.npz")):
                try:
                    with np.load(shard) as data:
                        for k, v in zip(data["ids"], data["emb"]):
                            self._known[k.tobytes()] = v
                except (OSError, ValueError, KeyError):
                    continue  # a damaged shard is recomputed, never trusted

    def lookup(self, texts: list[str | None]) -> tuple[list[np.ndarray | None], list[int]]:
        found = [self._known.get(_text_id(t)) for t in texts]
        return found, [i for i, f in enumerate(found) if f is None]

    def add(self, texts: list[str | None], embeddings: np.ndarray) -> None:
        if not texts:
            return
        ids = np.frombuffer(b"".join(_text_id(t) for t in texts), dtype=np.uint8).reshape(len(texts), 20)
        for t, e in zip(texts, embeddings):
            self._known[_text_id(t)] = e
        self.folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
        os.close(fd)
        with open(tmp, "wb") as fh:
            np.savez(fh, ids=ids, emb=embeddings.astype(np.float32))
        os.replace(tmp, self.folder / f"{uuid.uuid4().hex}.npz")  # atomic: readers see whole shards only


@torch.inference_mode()
def embed_texts(encoder: MeanPooledEncoder, hf_tokenizer, texts: list[str | None], max_len: int,
                cache: EmbeddingCache | None = None, batch_size: int = 32, progress: bool = False) -> np.ndarray:
    """Pooled embeddings [n, hidden]; texts are batched by length so padding costs little."""
    found, missing = cache.lookup(texts) if cache else ([None] * len(texts), list(range(len(texts))))
    if missing:
        lengths = [len(texts[i] or "") for i in missing]
        order = [missing[j] for j in np.argsort(lengths, kind="stable")]
        batches = [order[s : s + batch_size] for s in range(0, len(order), batch_size)]
        if progress:
            from tqdm import tqdm

            batches = tqdm(batches, desc="embedding prompts", unit="batch")
        encoder.eval()
        fresh_texts, fresh = [], []
        for idx in batches:
            batch = encode_texts(hf_tokenizer, [texts[i] for i in idx], max_len)
            emb = encoder(torch.from_numpy(batch.input_ids), torch.from_numpy(batch.attention_mask)).numpy()
            for i, e in zip(idx, emb):
                found[i] = e
            fresh_texts += [texts[i] for i in idx]
            fresh.append(emb)
            if cache and len(fresh_texts) >= 2048:  # checkpoint: an interrupted run keeps its work
                cache.add(fresh_texts, np.concatenate(fresh))
                fresh_texts, fresh = [], []
        if cache and fresh_texts:
            cache.add(fresh_texts, np.concatenate(fresh))
    dim = encoder.hidden
    return np.stack(found).astype(np.float32) if texts else np.zeros((0, dim), np.float32)
