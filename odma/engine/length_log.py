"""JSONL log of realized lengths: one line per finished request, readable as a trace by `odma-train`.

Each line is a `TraceRecord` (request_id, prompt, prompt_tokens, output_tokens, finished, source, and the
predictor's metadata: generator, temperature, depth, system_prompt_id) plus what
the engine knew when it reserved (predicted, uncertainty, bucket, policy) and what happened (migrations,
preemptions, finish_reason), so the log feeds both retraining and the bucket manager's bootstrap.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

from odma.engine.sequence import Sequence

log = logging.getLogger(__name__)


class LengthLog:
    def __init__(self, path: str | Path, policy: str, model: str, generator: str | None = None) -> None:
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.policy = policy
        self.model = model
        self.generator = generator or model
        self._lock = threading.Lock()
        _repair_torn_tail(self.path)
        self._fh = self.path.open("a", encoding="utf-8")

    def write(self, seq: Sequence) -> None:
        if seq.finish_reason not in ("stop", "length"):
            return  # cancelled or failed requests did not realize a length
        record = {
            "request_id": seq.request_id,
            **seq.predictor_fields(self.generator),  # prompt, its length and metadata as the predictor saw them
            "output_tokens": seq.num_generated,
            "finished": seq.finish_reason == "stop",  # False: hit max_tokens, so the length is a lower bound
            "source": "odma-serve",
            "max_tokens": seq.params.max_tokens,
            "predicted": seq.predicted_length,
            "uncertainty": seq.uncertainty,
            "bucket": seq.bucket,
            "policy": self.policy,
            "model": self.model,
            "migrations": seq.migrations,
            "preemptions": seq.preemptions,
            "finish_reason": seq.finish_reason,
            "ts": time.time(),
        }
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with self._lock:
            self._fh.write(line)
            self._fh.flush()

    def close(self) -> None:
        with self._lock:
            self._fh.close()


def _repair_torn_tail(path: Path) -> None:
    """A crash mid-append leaves a last line without its newline; the next record would be glued onto it and
    both lost. A tail that is a whole record gets its newline; a torn one is cut off (it cannot be read)."""
    if not path.exists():
        return
    with path.open("rb+") as fh:
        size = fh.seek(0, os.SEEK_END)
        if size == 0:
            return
        fh.seek(max(0, size - 1))
        if fh.read(1) == b"\n":
            return
        start = max(0, size - (1 << 20))  # a record is far smaller than 1 MiB
        fh.seek(start)
        chunk = fh.read()
        cut = chunk.rfind(b"\n") + 1
        tail = chunk[cut:]
        try:
            json.loads(tail.decode("utf-8"))
            fh.write(b"\n")
        except ValueError:
            fh.truncate(start + cut)
            log.warning("length log %s: dropped a torn last line (%d bytes, a crash mid-write)", path, len(tail))


def read_realized_lengths(path: str | Path, limit: int = 2000, model: str | None = None) -> list[int]:
    """The last `limit` realized output lengths in a log (to bootstrap bucket bounds on restart), only
    those of `model` when given (another model's lengths say nothing about this one's). Unreadable lines
    are skipped with a warning."""
    path = Path(path).expanduser()
    if not path.exists():
        return []
    lengths: list[int] = []
    bad = 0
    with path.open(encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                rec = json.loads(line)
                if model is None or rec.get("model") == model:
                    lengths.append(int(rec["output_tokens"]))
            except (ValueError, KeyError, TypeError, AttributeError):
                bad += 1
    if bad:
        log.warning("length log %s: skipped %d unreadable line(s)", path, bad)
    return lengths[-limit:]
