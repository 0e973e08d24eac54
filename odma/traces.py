"""Request traces: load one by name or JSONL path (or several joined with ','), write one as JSONL. The record type
and the splits live in `odma.trace_records`, the readers in `odma.trace_sources`; both are importable from here."""

from __future__ import annotations

import json
from pathlib import Path

from odma.errors import TraceError
from odma.trace_records import (RECORD_FIELDS, Splits, Trace, TraceRecord, normalized_prompt,  # noqa: F401 - the door
                                split_trace)
from odma.trace_sources import load_one, parse_jsonl_trace  # noqa: F401 - parse_jsonl_trace: the door too


def load_trace(
    spec: str,
    *,
    tokenizer: str = "smollm2",
    data_dir: str | Path | None = None,
    limit: int | None = None,
) -> Trace:
    """A trace by name (alpaca, alpaca-eval:<generator>, nq, nq-open, sharegpt, azure-code, azure-conv),
    by path to a JSONL file, or several of either joined with ','."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise TraceError("empty trace spec")
    traces = [load_one(p, tokenizer=tokenizer, data_dir=data_dir, limit=limit) for p in parts]
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
