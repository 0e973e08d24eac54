"""What an `odma-bench gpu` result says, in a few lines: each engine burst's tok/s with its ratios to the paged pool
and static reservation on the same trace, preemptions against requests, blocks continued, TTFT; the decode kernels'
contiguous ÷ paged and ÷ pieces; HTTP ÷ the engine alone; the peer's tok/s. gpu_check prints it after the bench, so a
lease's stdout answers at once what the JSON holds.

    python3 -m odma.bench.gpu_summary OUT/gpu_check.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _num(value, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "–"


def _ratio(run: dict, policy: str, base: str) -> str:
    """`policy`'s tok/s ÷ `base`'s on one trace, both whole bursts (one cut at its cap gives no ratio)."""
    p, b = run["policies"].get(policy, {}), run["policies"].get(base, {})
    if not p.get("tokens_per_s") or not b.get("tokens_per_s") or p.get("cut_at_cap") or b.get("cut_at_cap"):
        return "–"
    return f"{p['tokens_per_s'] / b['tokens_per_s']:.3f}"


def engine_lines(engine: dict) -> list[str]:
    if not engine.get("runs"):
        return [f"engine: no runs ({engine.get('error') or engine.get('skipped') or 'none in this result'})"]
    out = []
    for trace, run in engine.get("runs", {}).items():
        out.append(f"engine {trace} ({run.get('work', {}).get('requests', '?')} requests):")
        out.append(f"  {'policy':<40} {'tok/s':>8} {'÷paged':>7} {'÷static':>8} {'preempted':>9} {'continued':>9} "
                   f"{'running':>7} {'ttft p50':>8}")
        for name, p in run["policies"].items():
            if "tokens_per_s" not in p:  # the policy failed: its error is in the JSON
                out.append(f"  {name:<40} {'error' if p.get('error') else 'not run':>8}")
                continue
            cut = " cut at its cap" if p.get("cut_at_cap") else ""
            out.append(f"  {name:<40} {_num(p['tokens_per_s'], '8.0f')} {_ratio(run, name, 'paged'):>7} "
                       f"{_ratio(run, name, 'static'):>8} {p.get('preemptions', 0):>4}/{p.get('requests', 0):<4} "
                       f"{p.get('continued', 0):>9} {_num(p.get('mean_running'), '7.1f')} "
                       f"{_num(p.get('ttft_p50_s'), '7.2f')}s{cut}")
        for skipped in run.get("skipped", []):
            out.append(f"  {skipped.get('policy', skipped)}: not run ({skipped.get('why', '?')})")
    return out


def kernel_lines(kernels: dict) -> list[str]:
    out = []
    for row in kernels.get("rows", []):
        r = row.get("result") or {}
        if "contiguous_us" not in r:  # the measurement failed: its error
            out.append(f"kernels {row['context']} x {row['batch']}: {r.get('error', 'no result')}")
            continue
        # the ratios are times: how much longer pages and pieces take than one contiguous block
        out.append(f"kernels {row['context']} x {row['batch']}: contiguous {r['contiguous_us']} us "
                   f"({_num(r.get('contiguous_share_of_copy'), '.2f')} of copy), time ÷ contiguous: paged "
                   f"{_num(r.get('contiguous_vs_paged'), '.3f')}, pieces {_num(r.get('contiguous_vs_pieces'), '.3f')}")
    return out


def http_lines(http: dict) -> list[str]:
    if "http_vs_engine" not in http:
        return [f"http: {http.get('skipped') or http.get('error') or 'no result'}"]
    line = f"http ÷ engine {http['http_vs_engine']}"
    if "http_b_vs_engine" in http:  # the second server: the same flags and these
        line += f", {http['http_b_vs_engine']} with {' '.join(http.get('server_b_flags', []))}"
    return [line + f"; tokens equal: {http.get('tokens_equal')}"]


def peer_lines(peer: dict, engine: dict) -> list[str]:
    if "tokens_per_s" not in peer:
        return [f"peer: {peer.get('skipped') or peer.get('error') or 'no result'}"]
    line = (f"peer ({peer.get('transformers', '?')}): {peer['tokens_per_s']:.0f} tok/s, "
            f"{peer.get('completed', '?')}/{peer.get('requests', '?')} done, TTFT p50 {_num(peer.get('ttft_s_p50'), '.2f')} s")
    run = engine.get("runs", {}).get(peer.get("trace"), {})
    odma = sorted(p["tokens_per_s"] for n, p in run.get("policies", {}).items()
                  if n.startswith("odma") and p.get("tokens_per_s") and not p.get("cut_at_cap"))
    if odma and peer["tokens_per_s"]:
        line += (f"; odma's policies on that burst {odma[0] / peer['tokens_per_s']:.1f}-"
                 f"{odma[-1] / peer['tokens_per_s']:.1f}x its tok/s")
    return [line]


def summary(result: dict) -> str:
    lines = [f"device {result.get('device', '?')}, torch {result.get('torch', '?')}, triton {result.get('triton', '?')}"]
    tests = result.get("tests")
    if isinstance(tests, dict) and tests.get("summary"):
        lines.append(f"tests: {tests['summary']}")
    if "kernels" in result:
        lines += kernel_lines(result["kernels"])
    if "engine" in result:
        lines += engine_lines(result["engine"])
    if "http" in result:
        lines += http_lines(result["http"])
    if "peer" in result:
        lines += peer_lines(result["peer"], result.get("engine", {}))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python3 -m odma.bench.gpu_summary RESULT.json", file=sys.stderr)
        return 2
    try:
        result = json.loads(Path(args[0]).read_text())
    except (OSError, ValueError) as exc:
        print(f"gpu_summary: cannot read {args[0]}: {exc}", file=sys.stderr)
        return 2
    if not isinstance(result, dict) or not result.keys() & {"device", "engine", "kernels", "http", "peer"}:
        print(f"gpu_summary: {args[0]} is not an `odma-bench gpu` result (no device, kernels, engine, http or peer "
              "part)", file=sys.stderr)
        return 2
    print(summary(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
