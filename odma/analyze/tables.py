"""Plain-text tables of replay results (what the CLI prints; the JSON holds everything)."""

from __future__ import annotations

COLUMNS = (
    ("policy", "policy", "{}"),
    ("tps", "throughput_tps", "{:.1f}"),
    ("x oracle", "tps_vs_oracle", "{:.3f}"),
    ("x paged", "tps_vs_paged", "{:.3f}"),
    ("res.eff", "reservation_efficiency", "{:.3f}"),
    ("live.util", "live_utilization", "{:.3f}"),
    ("conc", "mean_concurrency", "{:.1f}"),
    ("overflow", "overflow_rate", "{:.3f}"),
    ("migr", "migrations", "{}"),
    ("stalls", "stall_steps", "{}"),
    ("preempt", "preemptions", "{}"),
    ("ttft50", "ttft_p50_s", "{:.2f}"),
    ("tpot50", "tpot_p50_s", "{:.4f}"),
    ("lost", "lost", "{}"),
)


def _cell(fmt: str, value) -> str:
    if value is None:
        return "-"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def format_table(rows: list[dict], columns=COLUMNS) -> str:
    cells = [[h for h, _, _ in columns]] + [[_cell(f, r.get(k)) for _, k, f in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_experiment(result: dict) -> str:
    w = result["workload"]
    pred = result.get("predictor") or {}
    head = (
        f"trace {w['name']}: {w['admissible']} requests replayed ({w['refused_too_large']} refused as too large, "
        f"{w['clipped_to_max_new_tokens']} clipped to max_new_tokens={w['max_new_tokens']}), "
        f"KV budget {result['kv_budget_tokens']} tokens, profile {result['profile']['name']}, "
        f"predictor {pred.get('source', '-')}"
    )
    return head + "\n" + format_table(list(result["policies"].values()))


MARKDOWN_COLUMNS = (
    ("policy", "policy", "{}"),
    ("tps", "throughput_tps", "{:.0f}"),
    ("× oracle", "tps_vs_oracle", "{:.3f}"),
    ("× paged", "tps_vs_paged", "{:.3f}"),
    ("res. eff.", "reservation_efficiency", "{:.3f}"),
    ("live util.", "live_utilization", "{:.3f}"),
    ("concurrency", "mean_concurrency", "{:.0f}"),
    ("overflow", "overflow_rate", "{:.3f}"),
    ("migrations", "migrations", "{}"),
    ("preempt.", "preemptions", "{}"),
    ("lost", "lost", "{}"),
)


def markdown_table(result: dict, policies: list[str] | None = None, columns=MARKDOWN_COLUMNS) -> str:
    """One experiment's rows as a Markdown table (policies in the given order, default: all)."""
    rows = result["policies"]
    names = policies or list(rows)
    missing = [n for n in names if n not in rows]
    if missing:
        raise KeyError(f"not in this result: {', '.join(missing)}")
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    for n in names:
        lines.append("| " + " | ".join(_cell(f, rows[n].get(k)) for _, k, f in columns) + " |")
    return "\n".join(lines)
