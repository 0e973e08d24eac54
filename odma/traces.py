"""Request traces: one record type, loaders by name or path, deterministic splits by prompt."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Iterator, NamedTuple

from odma.errors import TraceError


@dataclass(slots=True)
class TraceRecord:
    """One request: what the predictor sees (prompt, metadata) and what happened (realized length)."""

    request_id: str
    prompt: str | None
    prompt_tokens: int
    output_tokens: int | None  # None only in prompt-only sets (no realized length known)
    arrival_s: float = 0.0
    output: str | None = None
    type: str | None = None
    temperature: float | None = None
    system_prompt_id: str | None = None
    depth: int | None = None  # assistant turns before this request in its conversation
    prior_output_tokens: float | None = None  # mean length of those earlier replies (None on a first turn)
    last_output_tokens: int | None = None  # length of the latest of them
    conversation_id: str | None = None  # turns of one conversation share it, and with it their split
    generator: str | None = None
    finished: bool = True  # False: the output hit a length cap, so the length is a lower bound
    source: str = ""

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


RECORD_FIELDS = {f.name for f in fields(TraceRecord)}


@dataclass
class Trace:
    name: str
    records: list[TraceRecord]
    tokenizer: str | None  # which tokenizer counted the tokens ("source": the trace's own counts)
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[TraceRecord]:
        return iter(self.records)

    def output_lengths(self) -> list[int]:
        self.require_lengths()
        return [r.output_tokens for r in self.records]  # type: ignore[misc]

    def require_lengths(self) -> "Trace":
        missing = sum(r.output_tokens is None for r in self.records)
        if missing:
            raise TraceError(
                f"trace {self.name!r} has no realized output length for {missing} of {len(self)} requests "
                "(a prompt-only set); use a trace with output lengths"
            )
        return self

    def subset(self, records: list[TraceRecord], suffix: str) -> "Trace":
        return Trace(f"{self.name}:{suffix}", records, self.tokenizer, dict(self.meta))


class Splits(NamedTuple):
    train: Trace
    val: Trace
    test: Trace


def normalized_prompt(text: str) -> str:
    """Whitespace- and case-insensitive form of a prompt: what counts as 'the same prompt'."""
    return " ".join(text.split()).lower()


def _split_key(record: TraceRecord) -> str:
    # Same prompt text → same split, whatever its id; text-free traces fall back to the id. A conversation's
    # turns stay together: a later turn in test must not have its history's answers in train.
    if record.conversation_id is not None:
        return "conversation:" + record.conversation_id
    if record.prompt is not None:
        return normalized_prompt(record.prompt)
    return record.request_id


def split_trace(trace: Trace, fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)) -> Splits:
    """Deterministic train/validation/test split by a hash of the prompt: no prompt is in two splits."""
    if len(fractions) != 3 or any(f < 0 for f in fractions) or not math.isclose(sum(fractions), 1.0):
        raise TraceError(f"split fractions must be three non-negative numbers summing to 1, got {fractions}")
    cut_train = fractions[0]
    cut_val = fractions[0] + fractions[1]
    parts: tuple[list, list, list] = ([], [], [])
    for record in trace.records:
        digest = hashlib.sha256(_split_key(record).encode()).digest()
        h = int.from_bytes(digest[:8], "big") / 2**64
        parts[0 if h < cut_train else 1 if h < cut_val else 2].append(record)
    return Splits(*(trace.subset(p, name) for p, name in zip(parts, ("train", "val", "test"))))


def _int_field(obj: dict, key: str, where: str) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TraceError(f"{where}: {key!r} must be a non-negative integer, got {value!r}")
    return value


def parse_jsonl_trace(path: Path, tokenizer_name: str | None, limit: int | None = None) -> Trace:
    """A generic JSONL trace, one request a line (see README for the fields)."""
    if not path.exists():
        raise TraceError(f"trace file not found: {path}")
    raw: list[tuple[str, dict]] = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{where}: each line must be a JSON object")
            _validate_generic(obj, where)
            raw.append((where, obj))
            if limit is not None and len(raw) >= limit:
                break
    needs_tokenizer = any(
        o.get("prompt_tokens") is None or o.get("output_tokens") is None for _, o in raw
    )
    tok = None
    if needs_tokenizer:
        from odma.tokenizer import load_tokenizer

        tok = load_tokenizer(tokenizer_name or "smollm2")
    records = []
    for i, (where, o) in enumerate(raw):
        prompt_tokens = o.get("prompt_tokens")
        if prompt_tokens is None:
            prompt_tokens = tok.count_chat(o["prompt"])
        output_tokens = o.get("output_tokens")
        if output_tokens is None:
            output_tokens = tok.count(o["output"])
        records.append(
            TraceRecord(
                request_id=str(o.get("id", o.get("request_id", f"{path.stem}-{i}"))),  # to_json writes request_id
                prompt=o.get("prompt"),
                prompt_tokens=prompt_tokens,
                output_tokens=output_tokens,
                arrival_s=float(o.get("arrival_s", 0.0)),
                output=o.get("output"),
                type=o.get("type"),
                temperature=o.get("temperature"),
                system_prompt_id=o.get("system_prompt_id"),
                depth=o.get("depth"),
                prior_output_tokens=o.get("prior_output_tokens"),
                last_output_tokens=o.get("last_output_tokens"),
                conversation_id=o.get("conversation_id"),
                generator=o.get("generator"),
                finished=bool(o.get("finished", True)),
                source=str(path),
            )
        )
    name = str(path)
    return Trace(name, records, tok.name if tok else "source")


def _validate_generic(obj: dict, where: str) -> None:
    for key in ("prompt", "output", "type", "system_prompt_id", "generator", "conversation_id"):
        if key in obj and obj[key] is not None and not isinstance(obj[key], str):
            raise TraceError(f"{where}: {key!r} must be a string")
    if obj.get("prompt") is None and obj.get("prompt_tokens") is None:
        raise TraceError(f"{where}: needs 'prompt' or 'prompt_tokens'")
    if obj.get("output") is None and obj.get("output_tokens") is None:
        raise TraceError(f"{where}: needs 'output' or 'output_tokens'")
    if "prompt" in obj and obj["prompt"] == "" and obj.get("prompt_tokens") is None:
        raise TraceError(f"{where}: empty 'prompt' and no 'prompt_tokens'")
    _int_field(obj, "prompt_tokens", where)
    _int_field(obj, "output_tokens", where)
    _int_field(obj, "depth", where)
    _int_field(obj, "last_output_tokens", where)
    for key in ("arrival_s", "temperature", "prior_output_tokens"):
        v = obj.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0):
            raise TraceError(f"{where}: {key!r} must be a finite non-negative number, got {v!r}")


def load_trace(
    spec: str,
    *,
    tokenizer: str = "smollm2",
    data_dir: str | Path | None = None,
    limit: int | None = None,
) -> Trace:
    """A trace by name (alpaca, alpaca-eval:<generator>, nq, nq-open, sharegpt, azure-code, azure-conv),
    by path to a JSONL file, or several of either joined with ','."""
    from odma import trace_sources

    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise TraceError("empty trace spec")
    traces = [trace_sources.load_one(p, tokenizer=tokenizer, data_dir=data_dir, limit=limit) for p in parts]
    if len(traces) == 1:
        return traces[0]
    records: list[TraceRecord] = []
    seen: set[str] = set()
    for t in traces:
        for r in t.records:
            if r.request_id in seen:  # ids must stay unique across the joined traces
                r.request_id = f"{t.name}/{r.request_id}"
            seen.add(r.request_id)
            records.append(r)
    tokenizers = {t.tokenizer for t in traces}
    # each part's own metadata stays under its name; a length cap holds for the whole only if every part has one
    meta: dict = {"parts": {t.name: dict(t.meta) for t in traces}}
    caps = [t.meta.get("length_cap") for t in traces]
    if all(caps):
        meta["length_cap"] = max(int(c) for c in caps)
    return Trace(",".join(t.name for t in traces), records, ",".join(sorted(str(x) for x in tokenizers)), meta)


def write_jsonl_trace(trace: Trace | list[TraceRecord], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for r in trace:
            obj = r.to_json()
            obj["id"] = obj.pop("request_id")
            fh.write(json.dumps(obj, ensure_ascii=False) + "\n")
