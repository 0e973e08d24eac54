"""Decode-time training data: the served model's states at generated positions of a realized answer, by teacher
forcing (prompt + answer fed as one sequence), i.e. what the engine would capture at the decode step that feeds
the j-th generated token; the label is the remaining length L − j. Cached on disk per (model, answer), every
layer, so choosing the refine layer needs no second pass."""

from __future__ import annotations

import hashlib
import os
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

# generated-token counts j at which states are kept for training (every 32 plus two early points); the head
# takes log(1 + j) as a feature, so it serves any refine period
TEACHER_POINTS = (8, 16, *range(32, 512, 32))


@dataclass(frozen=True)
class DecodeRows:
    record: np.ndarray  # index of the record each row belongs to
    generated: np.ndarray  # j: generated tokens fed so far
    remaining: np.ndarray  # L − j (≥ 1)
    states: np.ndarray  # [rows, layers + 1, hidden] float16


def answer_ids(tokenizer: Any, output: str, finished: bool, eos_id: int | None) -> list[int]:
    """The answer's token ids as generated: its text re-encoded, plus the end token when it finished."""
    ids = tokenizer.encode(output, add_special_tokens=False)
    return ids + [eos_id] if finished and eos_id is not None else ids


def teacher_points(length: int, points: Sequence[int] = TEACHER_POINTS) -> list[int]:
    """The j (1 ≤ j < L) at which a request of realized length L is still running."""
    return [j for j in points if 1 <= j < length]


def _key(prompt: str, output: str, finished: bool) -> bytes:
    return hashlib.sha1(f"{prompt}\x00{output}\x00{finished}".encode("utf-8")).digest()


class TeacherCache:
    """Shards under cache_dir/probe_teacher/<model identity>/: per answer, the points and their states."""

    def __init__(self, cache_dir: Path, identity: str) -> None:
        self.folder = Path(cache_dir) / "probe_teacher" / identity
        self._known: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}
        if self.folder.exists():
            for shard in sorted(self.folder.glob("*.npz")):
                try:
                    with np.load(shard) as d:
                        offsets = d["offsets"]
                        for i, k in enumerate(d["ids"]):
                            a, b = offsets[i], offsets[i + 1]
                            self._known[k.tobytes()] = (d["points"][a:b], d["states"][a:b])
                except (OSError, ValueError, KeyError):
                    continue

    def get(self, key: bytes):
        return self._known.get(key)

    def add(self, keys: list[bytes], entries: list[tuple[np.ndarray, np.ndarray]]) -> None:
        if not keys:
            return
        for k, e in zip(keys, entries):
            self._known[k] = e
        offsets = np.cumsum([0] + [len(p) for p, _ in entries])
        self.folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
        os.close(fd)
        with open(tmp, "wb") as fh:
            np.savez(fh, ids=np.frombuffer(b"".join(keys), np.uint8).reshape(len(keys), 20), offsets=offsets,
                     points=np.concatenate([p for p, _ in entries]).astype(np.int32),
                     states=np.concatenate([s for _, s in entries]).astype(np.float16))
        os.replace(tmp, self.folder / f"{uuid.uuid4().hex}.npz")


def decode_rows(states_model, records: Sequence[Any], cache: TeacherCache | None = None, chunk: int = 64,
                progress: bool = False) -> DecodeRows:
    """Rows for every record with an answer text (`output`) and a realized length; others are skipped."""
    layers = tuple(range(states_model.num_layers + 1))
    eos = (states_model.model.config.eos_token_ids or (None,))[0]
    rec_idx, gen, rem, states = [], [], [], []
    fresh_keys, fresh = [], []
    items = list(enumerate(records))
    if progress:
        from tqdm import tqdm

        items = tqdm(items, desc="teacher-forced answers", unit="answer")
    for i, r in items:
        if not getattr(r, "output", None) or not r.prompt or r.output_tokens is None:
            continue
        key = _key(r.prompt, r.output, bool(r.finished))
        entry = cache.get(key) if cache is not None else None
        if entry is None:
            prompt = states_model.prompt_ids(r.prompt)
            answer = answer_ids(states_model.tokenizer, r.output, bool(r.finished), eos)
            points = [j for j in teacher_points(len(answer) + 1)]  # positions the retokenized answer holds
            got = states_model.states_at(prompt + answer, [len(prompt) + j - 1 for j in points], layers) \
                if points else {k: np.zeros((0, states_model.hidden_size), np.float32) for k in layers}
            entry = (np.asarray(points, np.int32), np.stack([got[k] for k in layers], axis=1).astype(np.float16))
            if cache is not None:
                fresh_keys.append(key)
                fresh.append(entry)
                if len(fresh_keys) >= chunk:
                    cache.add(fresh_keys, fresh)
                    fresh_keys, fresh = [], []
        points, st = entry
        keep = points < int(r.output_tokens)  # the realized length decides which points were still running
        rec_idx += [i] * int(keep.sum())
        gen += points[keep].tolist()
        rem += (int(r.output_tokens) - points[keep]).tolist()
        states.append(st[keep])
    if cache is not None:
        cache.add(fresh_keys, fresh)
    hidden = states_model.hidden_size
    return DecodeRows(np.asarray(rec_idx, np.int64), np.asarray(gen, np.int64), np.asarray(rem, np.int64),
                      np.concatenate(states) if states else np.zeros((0, len(layers), hidden), np.float16))
