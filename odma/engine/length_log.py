"""JSONL log of realized lengths: one line per finished request, readable as a trace by `odma-train`.

Each line is a `TraceRecord` (request_id, prompt, prompt_tokens, output_tokens, finished, source, and the
predictor's metadata: generator, temperature, depth, system_prompt_id) plus what
the engine knew when it reserved (predicted, uncertainty, bucket, policy) and what happened (migrations,
preemptions, finish_reason), so the log feeds both retraining and the bucket manager's bootstrap.

What it keeps of each prompt is the operator's choice (`PROMPT_MODES`): the text (what retraining the text
predictor needs), its SHA-256 (repeats stay countable, the text is not kept), or nothing. It rotates at a size
bound: `lengths.jsonl` → `lengths.jsonl.1` → ... → `lengths.jsonl.<backups>`, the oldest dropped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path

from odma.engine.config import LOG_PROMPT_MODES as PROMPT_MODES
from odma.engine.sequence import Sequence
from odma.errors import ConfigError

log = logging.getLogger(__name__)

MAX_LENGTH = 1 << 24  # tokens: above any model's context; a length past it is damage, not a request
_CHUNK = 1 << 20  # bytes read at a time when looking for the start of a torn last line
_MAX_TAIL = 64 << 20  # a torn tail longer than this is cut without trying to parse it


class LengthLog:
    def __init__(self, path: str | Path, policy: str, model: str, generator: str | None = None, *,
                 prompts: str = "text", max_bytes: int = 0, backups: int = 3) -> None:
        """`prompts`: one of PROMPT_MODES; `max_bytes`: rotate once the file reaches it (0: never); `backups`:
        rotated files kept. An unusable path (a directory, no permission) is a ConfigError."""
        if prompts not in PROMPT_MODES:
            raise ConfigError(f"length log prompts must be one of {PROMPT_MODES}, got {prompts!r}")
        if max_bytes < 0 or backups < 0:
            raise ConfigError(f"length log size bound and backups must be >= 0, got {max_bytes} and {backups}")
        self.path = _usable(path)
        self.policy = policy
        self.model = model
        self.generator = generator or model
        self.prompts, self.max_bytes, self.backups = prompts, max_bytes, backups
        self._lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _repair_torn_tail(self.path)
            self._fh = self.path.open("a", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"length log {self.path}: {exc.strerror or exc}") from None

    def write(self, seq: Sequence) -> None:
        if seq.finish_reason not in ("stop", "length"):
            return  # cancelled or failed requests did not realize a length
        fields = seq.predictor_fields(self.generator)  # prompt, its length and metadata as the predictor saw them
        record = {
            "request_id": seq.request_id,
            **fields,
            **self._prompt(fields["prompt"]),
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
            if self.max_bytes and self._fh.tell() >= self.max_bytes:
                self._rotate()

    def _prompt(self, text: str | None) -> dict:
        if self.prompts == "text" or text is None:
            return {}
        if self.prompts == "hash":
            return {"prompt": None, "prompt_sha256": hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()}
        return {"prompt": None}

    def _rotate(self) -> None:
        self._fh.close()
        try:
            if self.backups == 0:
                self.path.unlink()
            for i in range(self.backups, 0, -1):
                older = rotated(self.path, i - 1)
                if older.exists():
                    os.replace(older, rotated(self.path, i))
        except OSError as exc:  # keep logging into the full file rather than lose records
            log.warning("length log %s: rotation failed (%s); appending to the full file", self.path, exc)
        self._fh = self.path.open("a", encoding="utf-8")

    def close(self) -> None:
        with self._lock:
            self._fh.close()


def rotated(path: Path, i: int) -> Path:
    """The i-th rotated file of a log (0: the log itself)."""
    return path if i == 0 else path.with_name(f"{path.name}.{i}")


def _usable(path: str | Path) -> Path:
    path = Path(path).expanduser()
    if path.is_dir():
        raise ConfigError(f"length log {path} is a directory: give a file path (or '' to turn the log off)")
    return path


def _repair_torn_tail(path: Path) -> None:
    """A crash mid-append leaves a last line without its newline; the next record would be glued onto it and
    both lost. A tail that is a whole record gets its newline; a torn one is cut off whole (it cannot be read),
    however long it is."""
    if not path.exists():
        return
    with path.open("rb+") as fh:
        size = fh.seek(0, os.SEEK_END)
        if size == 0:
            return
        fh.seek(size - 1)
        if fh.read(1) == b"\n":
            return
        start = _last_line_start(fh, size)
        if size - start <= _MAX_TAIL:
            fh.seek(start)
            try:
                json.loads(fh.read().decode("utf-8"))
                fh.write(b"\n")
                return
            except ValueError:
                pass
        fh.truncate(start)
        log.warning("length log %s: dropped a torn last line (%d bytes, a crash mid-write)", path, size - start)


def _last_line_start(fh, size: int) -> int:
    """Offset just after the last newline before `size` (0: the file is one line)."""
    end = size
    while end > 0:
        begin = max(0, end - _CHUNK)
        fh.seek(begin)
        cut = fh.read(end - begin).rfind(b"\n")
        if cut >= 0:
            return begin + cut + 1
        end = begin
    return 0


def read_realized_lengths(path: str | Path, limit: int = 2000, model: str | None = None,
                          max_length: int = MAX_LENGTH) -> list[int]:
    """The last `limit` realized output lengths in a log and its rotated files (to bootstrap bucket bounds on
    restart), only those of `model` when given (another model's lengths say nothing about this one's). A line
    that is not a record whose lengths are integers in [0, max_length] is skipped and counted, with one warning."""
    path = _usable(path)
    chain: list[list[int]] = []
    found = bad = 0
    while found < limit and rotated(path, len(chain)).exists():  # newest file first, until enough lengths
        lengths, skipped = _read_one(rotated(path, len(chain)), model, max_length)
        chain.append(lengths)
        found, bad = found + len(lengths), bad + skipped
    if bad:
        log.warning("length log %s: skipped %d line(s) that are not records with integer lengths in [0, %d] "
                    "(damaged or edited)", path, bad, max_length)
    return [n for lengths in reversed(chain) for n in lengths][-limit:]


def _read_one(path: Path, model: str | None, max_length: int) -> tuple[list[int], int]:
    lengths: list[int] = []
    bad = 0
    try:
        with path.open(encoding="utf-8", errors="replace") as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                    n = _length(rec, "output_tokens", max_length)
                    if rec.get("prompt_tokens") is not None:
                        _length(rec, "prompt_tokens", max_length)
                except (ValueError, KeyError, TypeError, AttributeError):
                    bad += 1
                    continue
                if model is None or rec.get("model") == model:
                    lengths.append(n)
    except OSError as exc:
        raise ConfigError(f"length log {path}: {exc.strerror or exc}") from None
    return lengths, bad


def _length(rec: dict, key: str, max_length: int) -> int:
    value = rec[key]
    if type(value) is not int or not 0 <= value <= max_length:  # not bool, float (Infinity, 1e300), or text
        raise ValueError(f"{key}={value!r}")
    return value
