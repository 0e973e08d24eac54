"""How long a packed pool takes to plan a slide, on the pool states a GPU burst replay meets.

`record` replays a burst (`odma-analyze gpu-burst`'s arguments) with every `cheapest_slides` call's arguments and
every `slide_for_growth` call's wall time kept, into a pickle; `time` times the planner on every recorded call
(and the quadratic planner it replaced, kept here as it was, to compare) and checks they choose the same plan.

    python scripts/studies/slide_planning.py record --trace azure-conv --kv-budget 4GiB --out azure.pkl
    python scripts/studies/slide_planning.py time azure.pkl
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import time
from typing import Sequence

from odma.kv import manager, reclaim


def record(args: argparse.Namespace) -> int:
    from odma.analyze import cli

    calls, plan_s, path_s, planned_s = [], [], [], []  # planned_s: the paths that planned (not refused early)
    clock = time.thread_time  # CPU time of this thread: not the time other processes on a shared machine take
    plan, grow = reclaim.cheapest_slides, manager.slide_for_growth

    def recording_plan(*call):
        calls.append(call)
        t = clock()
        try:
            return plan(*call)
        finally:
            plan_s.append(clock() - t)

    def timed_growth(*call):
        t, before = clock(), len(calls)
        try:
            return grow(*call)
        finally:
            path_s.append(clock() - t)
            if len(calls) > before:
                planned_s.append(path_s[-1])

    reclaim.cheapest_slides, manager.slide_for_growth = recording_plan, timed_growth
    try:
        cli.main(["gpu-burst", "--profile", args.profile, "--trace", args.trace, "--kv-budget", args.kv_budget,
                  "--policies", args.policies, *(["--json", args.json] if args.json else [])])
    finally:
        reclaim.cheapest_slides, manager.slide_for_growth = plan, grow
    with open(args.out, "wb") as f:
        pickle.dump({"calls": calls, "plan_s": plan_s, "path_s": path_s, "planned_s": planned_s}, f)
    print(f"{len(calls)} plans in {len(path_s)} slide_for_growth calls: plan {_stats(plan_s)}; whole path of the "
          f"{len(planned_s)} that planned {_stats(planned_s)}; all paths {sum(path_s):.3f} s")
    return 0


def _stats(seconds: Sequence[float]) -> str:
    if not seconds:
        return "none"
    ms = sorted(s * 1e3 for s in seconds)
    p90 = ms[min(len(ms) - 1, int(0.9 * len(ms)))]
    return f"median {statistics.median(ms):.3f} ms, p90 {p90:.3f} ms, mean {statistics.fmean(ms):.3f} ms"


def quadratic_slides(blocks, gaps, units, own, extra):
    """The planner as it was before the windowed one: every run from every gap, walked item by item."""
    items = sorted([*blocks, *((s, n, None, 0) for s, n in gaps)])
    gap_at = [i for i, item in enumerate(items) if item[2] is None]
    best = None
    for a_pos, a in enumerate(gap_at):
        room, cost, count, prev = 0, 0, 0, a
        for b in gap_at[a_pos:]:
            for i in range(prev + 1, b):
                cost += items[i][3]
                count += 1
            room += items[b][1]
            prev = b
            if best is not None and (cost, count) >= best[0]:
                break
            if room >= units:
                best = ((cost, count), a, b, "down")
                break
    k = None if own is None else next((i for i, item in enumerate(items) if item[2] == own), None)
    if k is not None:
        after = items[k + 1][1] if k + 1 < len(items) and items[k + 1][2] is None else 0
        room, cost, count = after, items[k][3], 1
        for i in range(k - 1, -1, -1):
            if best is not None and (cost, count) >= best[0]:
                break
            if items[i][2] is None:
                room += items[i][1]
                if room >= extra:
                    best = ((cost, count), i, k, "down")
                    break
            else:
                cost += items[i][3]
                count += 1
        room, cost, count = 0, 0, 0
        for b in range(k + 1, len(items)):
            if items[b][2] is not None:
                cost += items[b][3]
                count += 1
                if best is not None and (cost, count) > best[0]:
                    break
                continue
            room += items[b][1]
            if room >= extra:
                best = ((cost, count), k + 1, b, "up")
                break
    if best is None:
        return None
    cost, a, b, direction = best
    moves = []
    if direction == "down":
        cursor = items[a][0]
        for offset, size, rid, _ in items[a:b + 1]:
            if rid is not None:
                moves.append((rid, cursor))
                cursor += size
    else:
        cursor = items[b][0] + items[b][1]
        for offset, size, rid, _ in reversed(items[a:b + 1]):
            if rid is not None:
                cursor -= size
                moves.append((rid, cursor))
    return cost, [(rid, at) for rid, at in moves if at != next(o for o, _, r, _ in items if r == rid)]


def time_calls(args: argparse.Namespace) -> int:
    with open(args.pickle, "rb") as f:
        rec = pickle.load(f)
    calls = rec["calls"]
    sizes = sorted(len(c[0]) + len(c[1]) for c in calls)
    print(f"{len(calls)} recorded plans; items (blocks + gaps) a region: median {statistics.median(sizes)}, "
          f"max {sizes[-1]}")
    print(f"recorded in the replay: plan {_stats(rec['plan_s'])}; whole slide_for_growth of the calls that "
          f"planned {_stats(rec['planned_s'])}")
    planners = {"quadratic": quadratic_slides, "windowed": reclaim.cheapest_slides}
    seconds = {name: [] for name in planners}
    for call in calls:  # the planners take turns on each call, the best of `repeat` rounds: a shared machine's noise
        best = dict.fromkeys(planners, float("inf"))
        for _ in range(args.repeat):
            for name, planner in planners.items():
                t = time.thread_time()
                for _ in range(10):
                    planner(*call)
                best[name] = min(best[name], (time.thread_time() - t) / 10)
        for name in planners:
            seconds[name].append(best[name])
    for name in planners:
        print(f"{name}: {_stats(seconds[name])}, total {sum(seconds[name]):.3f} s")
    differ = sum(quadratic_slides(*c) != reclaim.cheapest_slides(*c) for c in calls)
    print(f"plans that differ: {differ} of {len(calls)}")
    return 1 if differ else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="replay a burst and keep every slide plan's arguments")
    r.add_argument("--profile", default="h200-7b")
    r.add_argument("--trace", default="azure-conv")
    r.add_argument("--kv-budget", default="4GiB")
    r.add_argument("--policies", default="odma")
    r.add_argument("--json", help="also write the replay's rows here")
    r.add_argument("--out", required=True)
    t = sub.add_parser("time", help="time the planners on every recorded call")
    t.add_argument("pickle")
    t.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    return record(args) if args.cmd == "record" else time_calls(args)


if __name__ == "__main__":
    sys.exit(main())
