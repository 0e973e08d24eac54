"""How many requests keep their KV in one run of block ids, replayed on odma.vllm's run bookkeeping without vLLM or
a model: a burst of NQ chats with SmolLM2's realized lengths, vLLM's way of allocating (a block per 128 tokens as a
request grows, admission while a prompt's blocks are free and fewer than the running cap run, the newest request
preempted when a growth finds no free block), the real text predictor's L̂ for each prompt.

Compares the run placement (halving, best-fit), the claim (predicted: the smallest bucket >= L̂; calibrated:
the predictor's reservation table) and moves (a run that cannot grow in place copied whole to a place with room to
double, as odma.vllm.pool does; off: it appends), at the pool of 1 GiB of fp32 SmolLM2 KV (181 blocks) and twice
that, with the exact lengths as claims for the bound of a perfect predictor and the median length for every request
as the trivial guess.

    .venv/bin/python scripts/studies/vllm_runs_replay.py [--num 144] [--running 128] [--seed 0] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys

from odma.engine.length_predictor import load_engine_predictor
from odma.traces import load_trace
from odma.vllm.runs import PLACEMENTS, BlockRuns
from odma.vllm.tagging import LengthTags


def replay(recs, claims, blocks: int, block_tokens: int, running_cap: int, placement: str, moves: bool) -> dict:
    runs = BlockRuns(blocks + 1, reserved=(0,), placement=placement)  # id 0: vLLM's null block
    waiting, running, held = list(range(len(recs))), [], {}
    generated = [0] * len(recs)
    preempted = 0
    while waiting or running:
        while waiting and len(running) < running_cap:
            i = waiting[0]
            need = math.ceil((recs[i][0] + generated[i] + 1) / block_tokens)
            if need > runs.free:
                break
            waiting.pop(0)
            held[i] = runs.place(str(i), need, claims[i])
            running.append(i)
        for i in list(running):
            prompt, length = recs[i]
            generated[i] += 1
            if generated[i] >= length:
                runs.give_back(held.pop(i))
                runs.drop(str(i))
                running.remove(i)
                continue
            if math.ceil((prompt + generated[i] + 1) / block_tokens) > len(held[i]):
                while runs.free < 1 and i in held:
                    victim = running.pop()
                    runs.give_back(held.pop(victim))
                    runs.drop(str(victim))
                    waiting.insert(0, victim)
                    preempted += 1
                if i not in held:
                    continue
                moved = None
                if moves and not runs.fits_in_place(str(i), 1):
                    moved = runs.move(str(i), len(held[i]), 1)
                if moved is not None:  # the old blocks come back once the copy ran (the end of the step in vLLM)
                    runs.give_back(held[i])
                    held[i] = moved
                else:
                    held[i] += runs.grow(str(i), 1)
    s = runs.stats
    return {"one_run_share": round(s.finished_one_run / s.finished, 3),
            "split_with_room": round(s.finished_split_with_room / s.finished, 3), "appended": s.appended,
            "moved": s.moved, "moved_blocks": s.moved_blocks, "stolen": s.stolen, "preempted": preempted}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="nq")
    ap.add_argument("--num", type=int, default=144)
    ap.add_argument("--running", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--block-tokens", type=int, default=128)
    ap.add_argument("--blocks", default="181,362", help="pool sizes in blocks (181: 1 GiB of fp32 SmolLM2 KV)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    records = [r for r in load_trace(args.trace).records if r.prompt and r.output_tokens]
    sample = random.Random(args.seed).sample(records, args.num)
    recs = [(r.prompt_tokens, max(1, min(args.max_tokens, r.output_tokens))) for r in sample]
    loaded = load_engine_predictor("default")
    claims: dict[str, list[int]] = {}
    for mode in ("predicted", "calibrated"):
        tags = LengthTags(loaded, max_tokens_cap=2048, generator="SmolLM2-135M-Instruct",
                          calibrated=mode == "calibrated")
        out = tags.tag([r.prompt for r in sample], [p for p, _ in recs], [args.max_tokens] * len(recs),
                       [0.7] * len(recs))
        claims[mode] = [math.ceil((p + t.reserved_output) / args.block_tokens) for (p, _), t in zip(recs, out)]
    claims["exact lengths"] = [math.ceil((p + n) / args.block_tokens) for p, n in recs]
    median = sorted(n for _, n in recs)[len(recs) // 2]  # the trivial guess: every request the median length
    claims["constant (median)"] = [math.ceil((p + median) / args.block_tokens) for p, _ in recs]
    result = {"command": " ".join(["scripts/studies/vllm_runs_replay.py", *(argv or sys.argv[1:])]), "predictor": loaded.name,
              "rows": []}
    for blocks in (int(b) for b in args.blocks.split(",")):
        for moves in (False, True):
            for placement in PLACEMENTS:
                for mode, c in claims.items():
                    row = {"blocks": blocks, "moves": moves, "placement": placement, "claim": mode,
                           **replay(recs, c, blocks, args.block_tokens, args.running, placement, moves)}
                    result["rows"].append(row)
                    print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
