"""`odma-bench batched`: odma's engine without its server, at `llama-batched-bench`'s shape.

B requests of PP prompt tokens arrive at once and each generates TG tokens (greedy, end of text ignored), through
the server's engine (its scheduler, chunked prefill, pool and sampler) in this process. Reported per batch, as
llama-batched-bench reports its own (is_pp_shared = 0):
- t_pp_s: until every request has its first token (odma prefills in chunks beside the decodes, so a few tokens of
  the first requests fall in this phase);
- t_tg_s, s_tg: the steps after it, every request decoding: generated tokens ÷ their time (llama's S_TG);
- t_s, output_tps: the whole run, B·TG generated tokens ÷ t_s: what a server's output rate (guidellm's, which
  counts from the request's arrival) approaches on this workload. llama-batched-bench's equivalent is B·TG ÷ its T.
- cpu_pp_s, s_pp_cpu: the prefill phase in this process's CPU time (every thread's): on a machine shared with other
  work, where wall time measures the share the process got, this measures the work.
Medians of --repeats runs (one warm-up request first).
"""

from __future__ import annotations

import argparse
import statistics
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="a model name or a GGUF file")
    p.add_argument("--weights", default="native", choices=("f32", "bf16", "native"))
    p.add_argument("--shape", default="128/128", help="prompt/generated tokens per request (PP/TG)")
    p.add_argument("--batch", default="1,16", help="requests at once, comma-separated")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-budget", default="1GiB")
    p.add_argument("--kv-dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="the KV cache's dtype (default: the engine's)")
    p.add_argument("--repeats", type=int, default=3)


def run(args: argparse.Namespace) -> dict:
    import torch

    from odma.engine.config import EngineConfig
    from odma.engine.llm_engine import LLMEngine
    from odma.models.weights import WEIGHT_DTYPES

    prompt, generated, batches = parse_shape(args.shape, args.batch)
    torch.set_num_threads(args.threads)
    cfg = EngineConfig(model=args.model, threads=args.threads, kv_budget=args.kv_budget, length_log=None,
                       max_num_seqs=max(batches), weights=args.weights, kv_dtype=args.kv_dtype,
                       dtype=WEIGHT_DTYPES.get(args.weights, "float32"))
    engine = LLMEngine(cfg)
    try:
        rows = measure(engine, batches, prompt, generated, args.repeats)
    finally:
        engine.close()
    return {"model": args.model, "weights": args.weights, "kv_dtype": cfg.resolved_kv_dtype, "threads": args.threads,
            "kv_budget": args.kv_budget, "max_prefill_tokens": cfg.max_prefill_tokens, "rows": rows}


def parse_shape(shape: str, batch: str) -> tuple[int, int, list[int]]:
    """--shape PP/TG and --batch B,B,...: positive integers, else a ConfigError that names the flag."""
    from odma.errors import ConfigError

    try:
        prompt, generated = (int(x) for x in shape.split("/"))
        batches = [int(b) for b in batch.split(",")]
    except ValueError:
        raise ConfigError(f"--shape {shape!r} / --batch {batch!r}: expected PP/TG and B,B,... in integers") from None
    if min(prompt, generated, *batches) < 1:
        raise ConfigError(f"--shape {shape!r} / --batch {batch!r}: every count must be at least 1")
    return prompt, generated, batches


def measure(engine, batches: list[int], prompt: int, generated: int, repeats: int) -> list[dict]:
    """One row per batch: its runs and their medians (a warm-up request first)."""
    _batch_run(engine, 1, prompt, min(generated, 8))
    rows = []
    for batch in batches:
        runs = [_batch_run(engine, batch, prompt, generated) for _ in range(repeats)]
        row = {"pp": prompt, "tg": generated, "batch": batch, "runs": runs}
        row.update({k: round(statistics.median(r[k] for r in runs), 3 if k.endswith("_s") else 1)
                    for k in ("t_pp_s", "s_pp", "cpu_pp_s", "s_pp_cpu", "t_tg_s", "s_tg", "t_s", "output_tps")})
        rows.append(row)
    return rows


def _batch_run(engine, batch: int, prompt: int, generated: int) -> dict:
    """One run of `batch` requests of `prompt` token ids each, `generated` greedy tokens each."""
    from odma.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=generated, temperature=0.0, ignore_eos=True)
    vocab = engine.model.config.vocab_size
    t0, cpu0 = time.perf_counter(), time.process_time()
    seqs = [engine.add_request([(1000 + 7919 * (i * prompt + j)) % vocab for j in range(prompt)], params)
            for i in range(batch)]
    t_pp = None
    made_in_pp = 0
    while any(not s.finished for s in seqs):
        engine.step()
        if t_pp is None and all(s.num_generated for s in seqs):
            t_pp, cpu_pp = time.perf_counter() - t0, time.process_time() - cpu0
            made_in_pp = sum(s.num_generated for s in seqs)
    t = time.perf_counter() - t0
    made = sum(s.num_generated for s in seqs)
    if made != batch * generated:
        raise RuntimeError(f"{made} tokens generated, expected {batch * generated}")
    t_tg = t - t_pp
    return {"t_pp_s": round(t_pp, 4), "s_pp": round(batch * prompt / t_pp, 1), "cpu_pp_s": round(cpu_pp, 4),
            "s_pp_cpu": round(batch * prompt / cpu_pp, 1), "t_tg_s": round(t_tg, 4),
            "s_tg": round((made - made_in_pp) / t_tg, 1) if t_tg > 0 else None, "t_s": round(t, 4),
            "output_tps": round(made / t, 1)}
