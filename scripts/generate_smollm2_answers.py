"""Generate SmolLM2's own answers through odma's engine: the training data of the `probe` length predictor.

Prompts come from three sources (Alpaca: AlpacaEval instructions + the Alpaca-format demo set; ShareGPT first
turns; NQ-open dev questions), are chat-templated exactly as `odma-serve` templates a one-message chat, and are
answered with temperature 0.7, top_p 0.95, max_tokens 512 and a recorded per-request seed. A few hundred prompts
(drawn from the validation and test splits of `odma.traces.split_trace`, so they never train a predictor) are
answered several times to measure the sampling-noise spread of the served model's own lengths.

Each finished answer is appended to the output JSONL at once, so a restarted run skips what is done and resumes.
Run it in the background with one torch thread (the machine is shared):

    nohup .venv/bin/python scripts/generate_smollm2_answers.py --out datasets/smollm2_answers/answers.jsonl \
        > runs/gen.log 2>&1 &
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

GENERATOR = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class Job:
    request_id: str  # <prompt_id>#s<sample>
    prompt_id: str
    source: str  # alpaca-eval | alpaca-demo | sharegpt | nq
    type: str | None
    prompt: str
    sample: int
    seed: int


def seed_of(prompt_id: str, sample: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{prompt_id}#{sample}".encode()).digest()[:4], "big") & 0x7FFFFFFF


def source_of(record) -> str:
    if record.source == "alpaca":
        return "alpaca-demo" if record.type == "alpaca-demo" else "alpaca-eval"
    return record.source


def plan(args) -> list[Job]:
    """The whole work list, a pure function of the arguments (so a restart resumes the same plan)."""
    from odma.traces import Trace, load_trace, split_trace

    pools = {
        "alpaca": [r for r in load_trace("alpaca").records],
        "sharegpt": [r for r in load_trace("sharegpt").records if r.prompt_tokens <= args.max_prompt_tokens],
        "nq": [r for r in load_trace("nq").records],
    }
    singles = {"alpaca": args.alpaca, "sharegpt": args.sharegpt, "nq": args.nq}
    rng = random.Random(args.seed)
    jobs_multi: list[Job] = []
    jobs_single: list[Job] = []
    for name, records in pools.items():
        # prompts that the hash split puts in validation or test: the multi-sample set never trains a predictor
        held = set()
        for part in split_trace(Trace(name, records, "smollm2"))[1:]:  # the split hashes prompt text only
            held.update(r.request_id for r in part.records)
        order = list(records)
        rng.shuffle(order)
        multi = [r for r in order if r.request_id in held][: args.multi_prompts]
        taken = {r.request_id for r in multi}
        single = [r for r in order if r.request_id not in taken][: singles[name]]
        for r in multi:
            jobs_multi += [_job(r, s) for s in range(args.samples)]
        jobs_single += [_job(r, 0) for r in single]
    # the repeated samples first (the noise ceiling needs them all), then the single answers
    return jobs_multi + jobs_single


def _job(record, sample: int) -> Job:
    return Job(f"{record.request_id}#s{sample}", record.request_id, source_of(record), record.type, record.prompt,
               sample, seed_of(record.request_id, sample))


def done_ids(path: Path) -> set[str]:
    if not path.exists():
        return set()
    ids = set()
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            try:
                ids.add(json.loads(line)["id"])
            except (ValueError, KeyError):
                continue  # a torn last line from a killed run: that request is generated again
    return ids


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--alpaca", type=int, default=600, help="prompts answered once, from the alpaca trace")
    p.add_argument("--sharegpt", type=int, default=250, help="prompts answered once, ShareGPT first turns")
    p.add_argument("--nq", type=int, default=150, help="NQ questions answered once (for decode-time features)")
    p.add_argument("--multi-prompts", type=int, default=75, help="prompts per source answered --samples times")
    p.add_argument("--samples", type=int, default=5)
    p.add_argument("--max-prompt-tokens", type=int, default=1024, help="skip longer ShareGPT prompts (cost)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=48, help="requests in flight in the engine")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=20)
    p.add_argument("--limit", type=int, help="stop after this many jobs of the plan (smoke runs)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    import torch

    from odma.engine import LLMEngine
    from odma.engine.config import EngineConfig
    from odma.engine.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    jobs = plan(args)
    if args.limit:
        jobs = jobs[: args.limit]
    done = done_ids(args.out)
    todo = [j for j in jobs if j.request_id not in done]
    print(f"plan: {len(jobs)} jobs, {len(jobs) - len(todo)} done, {len(todo)} to go", flush=True)
    if not todo:
        return 0
    engine = LLMEngine(EngineConfig(threads=args.threads, dtype=args.dtype, predictor="median", length_log=None,
                                    max_num_seqs=args.concurrency))
    tok = engine.tokenizer
    args.out.parent.mkdir(parents=True, exist_ok=True)
    pending = list(reversed(todo))
    live: dict[str, tuple[Job, object]] = {}
    started, tokens, written = time.time(), 0, 0
    with args.out.open("a", encoding="utf-8") as fh:
        while pending or live:
            while pending and len(live) < args.concurrency:
                job = pending.pop()
                text = tok.apply_chat_template([{"role": "user", "content": job.prompt}],
                                               add_generation_prompt=True, tokenize=False)  # as odma-serve does
                params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                        seed=job.seed)
                seq = engine.add_request(text, params, request_id=job.request_id, prompt_text=job.prompt)
                live[job.request_id] = (job, seq)
            for out in engine.step():
                if not out.finished or out.seq.request_id not in live:
                    continue
                job, seq = live.pop(out.seq.request_id)
                if seq.finish_reason not in ("stop", "length"):
                    print(f"{job.request_id}: {seq.finish_reason} {seq.error}", file=sys.stderr, flush=True)
                    continue
                record = {
                    "id": job.request_id, "prompt_id": job.prompt_id, "source": job.source, "type": job.type,
                    "prompt": job.prompt, "prompt_tokens": len(seq.prompt_ids), "output": engine.decode(seq.output_ids),
                    "output_tokens": seq.num_generated, "finished": seq.finish_reason == "stop",
                    "sample": job.sample, "seed": job.seed, "temperature": args.temperature, "top_p": args.top_p,
                    "max_tokens": args.max_tokens, "generator": GENERATOR,
                }
                fh.write(json.dumps(record, ensure_ascii=False) + "\n")
                fh.flush()
                tokens += seq.num_generated
                written += 1
                if written % 25 == 0:
                    rate = tokens / (time.time() - started)
                    print(f"{written + len(jobs) - len(todo)}/{len(jobs)} done, {rate:.1f} output tok/s", flush=True)
    print(f"finished: {written} answers, {tokens} tokens in {time.time() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
