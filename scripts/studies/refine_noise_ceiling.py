"""The sampling-noise ceiling of the decode-time refinement (docs/predictor.md): how well can ANY
predictor know a request's remaining length after j generated tokens, against knowing only its prompt?

For test-split answers of SmolLM2 (datasets/smollm2_answers) longer than j tokens, the served model through odma's
engine samples, with the dataset's settings (temperature 0.7, top_p 0.95, 512 output tokens in all):
- K whole answers from the prompt alone: the remaining length of those that pass j tokens, L - j;
- K continuations of the recorded answer's first j tokens (prompt + those tokens prefilled, then sampled).
Leave-one-out: each draw is predicted by the median of its group's other draws (a predictor that knows the
distribution of the remaining length given what it conditions on, from K - 1 draws: slightly worse than the true
ceiling). The MAE of that prediction, with the prompt alone and with the first j tokens, is the best a
prompt-time estimate and a decode-time refinement can reach on these requests; their ratio bounds the refinement's
gain. The recorded answer's own remaining length is scored too, against the K draws of each group.

    .venv/bin/python scripts/studies/refine_noise_ceiling.py --prompts 150 --samples 5 --after 32 \
        --json docs/results/refine_noise_ceiling.json      # 9 min on 2 cores
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import sys
import time
from pathlib import Path


def seed_of(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") & 0x7FFFFFFF


def loo_mae(groups: list[list[int]]) -> tuple[float, int]:
    """Mean |draw - median of the group's other draws| over every draw of groups with at least 2 draws."""
    errors = [abs(x - statistics.median(g[:i] + g[i + 1:])) for g in groups if len(g) >= 2 for i, x in enumerate(g)]
    return (sum(errors) / len(errors) if errors else float("nan")), len(errors)


def own_mae(recorded: list[int], groups: list[list[int]]) -> float:
    """The recorded answer's remaining length against the median of the group's K draws."""
    pairs = [(r, statistics.median(g)) for r, g in zip(recorded, groups) if g]
    return sum(abs(r - m) for r, m in pairs) / len(pairs) if pairs else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=120, help="test-split answers longer than --after, drawn at random")
    p.add_argument("--samples", type=int, default=5, help="draws per group (K)")
    p.add_argument("--after", type=int, default=32, help="generated tokens the refinement has seen (j)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=19)
    p.add_argument("--json", type=Path, default=Path("runs/refine_noise_ceiling.json"))
    args = p.parse_args(argv)

    import torch

    from odma.engine import LLMEngine
    from odma.engine.config import EngineConfig
    from odma.engine.sampling import SamplingParams
    from odma.traces import load_trace, split_trace

    j = args.after
    test = [r for r in split_trace(load_trace("smollm2-answers")).test.records
            if r.output and r.output_tokens > j]
    rows = random.Random(args.seed).sample(test, min(args.prompts, len(test)))
    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(threads=args.threads, predictor="median", length_log=None,
                                    max_num_seqs=args.concurrency))
    tok = engine.tokenizer
    cap = 512
    jobs = []  # (row index, kind, prompt ids, max_tokens, seed)
    for i, r in enumerate(rows):
        prompt = tok.apply_chat_template([{"role": "user", "content": r.prompt}], add_generation_prompt=True,
                                         tokenize=False)
        prompt_ids = tok.encode(prompt, add_special_tokens=False)
        answer_ids = tok.encode(r.output, add_special_tokens=False)[:j]
        if len(answer_ids) < j:  # the text re-encodes shorter than the recorded count: skip the prefix group
            answer_ids = None
        for k in range(args.samples):
            jobs.append((i, "prompt", prompt_ids, cap, seed_of(f"{r.request_id}#prompt#{k}")))
            if answer_ids is not None:
                jobs.append((i, "prefix", prompt_ids + answer_ids, cap - j, seed_of(f"{r.request_id}#prefix#{k}")))
    print(f"{len(rows)} answers, {len(jobs)} generations", flush=True)
    lengths: dict[tuple[int, str], list[int]] = {}
    pending, live, started, tokens = list(reversed(jobs)), {}, time.time(), 0
    n = 0
    while pending or live:
        while pending and len(live) < args.concurrency:
            i, kind, ids, max_tokens, seed = pending.pop()
            params = SamplingParams(max_tokens=max_tokens, temperature=0.7, top_p=0.95, seed=seed)
            n += 1
            seq = engine.add_request(list(ids), params, request_id=f"g{n}")
            live[seq.request_id] = (i, kind)
        for out in engine.step():
            if not out.finished or out.seq.request_id not in live:
                continue
            i, kind = live.pop(out.seq.request_id)
            if out.seq.finish_reason not in ("stop", "length"):
                print(f"{out.seq.request_id}: {out.seq.finish_reason}", file=sys.stderr, flush=True)
                continue
            lengths.setdefault((i, kind), []).append(out.seq.num_generated)
            tokens += out.seq.num_generated
    seconds = time.time() - started
    prompt_groups, prefix_groups, recorded, recorded_prefix = [], [], [], []
    for i, r in enumerate(rows):
        # remaining after j for whole answers that pass j tokens (what a prompt-time estimate knows at step j)
        prompt_groups.append([x - j for x in lengths.get((i, "prompt"), []) if x > j])
        recorded.append(min(r.output_tokens, cap) - j)
        if (i, "prefix") in lengths:
            prefix_groups.append(lengths[(i, "prefix")])
            recorded_prefix.append(min(r.output_tokens, cap) - j)
    both = [(a, b) for a, b in zip(prompt_groups, [lengths.get((i, "prefix"), []) for i in range(len(rows))]) if b]
    prompt_mae, prompt_n = loo_mae(prompt_groups)
    prefix_mae, prefix_n = loo_mae(prefix_groups)
    paired_prompt, _ = loo_mae([a for a, _ in both])
    paired_prefix, _ = loo_mae([b for _, b in both])
    all_remaining = [x for g in prompt_groups for x in g]
    median_all = statistics.median(all_remaining) if all_remaining else float("nan")
    result = {
        "after_tokens": j, "answers": len(rows), "samples": args.samples, "generations": len(jobs),
        "output_tokens": tokens, "seconds": round(seconds, 1),
        "loo_mae_prompt_only": prompt_mae, "loo_mae_prompt_only_draws": prompt_n,
        "loo_mae_after_prefix": prefix_mae, "loo_mae_after_prefix_draws": prefix_n,
        "paired_groups": len(both), "paired_loo_mae_prompt_only": paired_prompt,
        "paired_loo_mae_after_prefix": paired_prefix,
        "paired_ratio_prefix_to_prompt": paired_prefix / paired_prompt if paired_prompt else None,
        "recorded_vs_prompt_median_mae": own_mae(recorded, prompt_groups),
        "recorded_vs_prefix_median_mae": own_mae(recorded_prefix, prefix_groups),
        "median_remaining_mae": sum(abs(x - median_all) for x in all_remaining) / max(1, len(all_remaining)),
        "sources": sorted({r.request_id.split("-")[0] for r in rows}),
    }
    print(json.dumps(result, indent=1))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
