"""One run of the ballooning step-time model, off and on, request by request (docs/BENCHMARKS.md, "Ballooning KV
and activations"): when each long request reached the head of the queue, was admitted and got its first token (in
steps), and what the pool held at each side's peak batch.

    .venv/bin/python scripts/studies/balloon_trace.py [odma-bench balloon flags ...]    # a few seconds
    e.g. --num-long 4 --max-num-seqs 128 --seed 4

`long` = prompts over --long-threshold tokens (the workload's long prompts start at 2,048).
"""

from __future__ import annotations

import argparse
import sys
from unittest import mock

from odma.bench import balloon_bench
from odma.engine.scheduler import Scheduler


def main(argv: list[str]) -> None:
    ours = argparse.ArgumentParser()
    ours.add_argument("--long-threshold", type=int, default=1500)
    own, extra = ours.parse_known_args(argv)
    bench = argparse.ArgumentParser()
    balloon_bench.add_arguments(bench)
    args = bench.parse_args(extra)

    side = {"name": "off", "step": 0}
    events: dict[tuple[str, str], dict] = {}
    peaks: dict[str, dict] = {}
    schedule = Scheduler.schedule

    def traced(self: Scheduler):
        work = schedule(self)
        side["step"] += 1
        step, name = side["step"], side["name"]
        for seq in [*self.waiting, *self.running]:
            if seq.prompt_tokens <= own.long_threshold:
                continue
            e = events.setdefault((name, seq.request_id), {"prompt": seq.prompt_tokens})
            if self.waiting and self.waiting[0] is seq:
                e.setdefault("head_step", step)
            if seq in self.running:
                e.setdefault("admitted_step", step)
                e.setdefault("block", seq.block.capacity)
                if seq.num_cached >= seq.prompt_tokens:
                    e.setdefault("first_token_step", step)
        if len(self.running) > peaks.get(name, {}).get("running", -1):
            held = [(q.prompt_tokens > own.long_threshold, q.block.capacity) for q in self.running]
            peaks[name] = {"step": step, "running": len(self.running), "waiting": len(self.waiting),
                           "free_tokens": self.kv.stats().free_tokens,
                           "lent_tokens": self.elastic.lent_bytes // args.bytes_per_token if self.elastic else 0,
                           "long_running": sum(long for long, _ in held),
                           "long_tokens": sum(c for long, c in held if long),
                           "short_tokens": sum(c for long, c in held if not long)}
        return work

    simulate = balloon_bench.simulate

    def one_side(jobs, predictions, a, *, balloon: bool):
        side.update(name="on" if balloon else "off", step=0)
        r = simulate(jobs, predictions, a, balloon=balloon)
        print(f"{side['name']}: {r['steps']} steps, makespan {r['makespan_s']:.0f} s, peak batch {r['peak_running']}, "
              f"long TTFT p50 {r['ttft_long_p50_s']:.0f} s, mean {r['ttft_long_mean_s']:.0f} s, stalls {r['stalls']}")
        return r

    with mock.patch.object(Scheduler, "schedule", traced), mock.patch.object(balloon_bench, "simulate", one_side):
        balloon_bench.run(args)
    for name in ("off", "on"):
        print(f"{name} at its peak: {peaks[name]}")
    for (name, rid), e in sorted(events.items(), key=lambda kv: (kv[0][1], kv[0][0] == "on")):
        print(f"{rid:>5} {name:>3}: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
