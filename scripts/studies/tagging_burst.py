"""A burst of ShareGPT requests through odma's engine on this CPU (SmolLM2-135M, or a tiny random model whose
steps are short beside the predictor's, as a GPU's are; the learned length predictor),
its requests tagged inside the engine step (loop) or by the tagging worker as they arrive (ahead), the modes
alternated round by round on one loaded model; prints each round's steps, tok/s, TTFT and host seconds spent
predicting, then the medians per mode. The GPU bench's engine part measures the same burst (`gpu_bench.engine_burst`)
on the paper model's shape; this is its CPU counterpart.

    .venv/bin/python scripts/studies/tagging_burst.py --requests 48 --rounds 3 [--model tiny]
"""

from __future__ import annotations

import argparse
import json
import statistics


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"],
                   help="tiny: TINY_QWEN2's random layers with SmolLM2's vocabulary (steps of about a millisecond)")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--step-sleep-ms", type=float, default=0.0,
                   help="each model step also sleeps this long: a stand-in for a GPU's device time, which the host "
                        "waits out without a core or the interpreter lock (0: the CPU's own steps only)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per mode, alternated (loop, ahead, loop, ...)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--predictor", default="default")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the predictor's worker needs a core)")
    p.add_argument("--kv-budget", default="24MiB")
    args = p.parse_args()

    from odma.bench.gpu_bench import engine_burst
    from odma.bench.gpu_work import burst_from_trace
    from odma.config import PoolConfig
    from odma.engine import EngineConfig, LLMEngine, SamplingParams
    from odma.engine.length_predictor import load_engine_predictor
    from odma.models.weights import load_served_model
    from transformers import AutoTokenizer

    if args.model == "tiny":
        import torch

        from odma.models.tiny import TINY_QWEN2, random_model

        model, tokenizer, weights = random_model(dict(TINY_QWEN2, vocab_size=49152), torch.float32), None, "auto"
    else:
        model, folder, weights = load_served_model("smollm2", "auto", "float32", device="cpu")
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    work = burst_from_trace("sharegpt", args.requests, max_prompt=args.max_prompt, max_tokens=args.max_tokens,
                            kv_budget=args.kv_budget, vocab_size=model.config.vocab_size)
    params = SamplingParams(max_tokens=work.max_tokens, temperature=0, ignore_eos=True)
    rounds: dict[str, list[dict]] = {"loop": [], "ahead": []}
    for i in range(args.rounds * 2):
        mode = ("loop", "ahead")[i % 2]
        config = EngineConfig(model="smollm2" if args.model == "smollm2" else "tiny-qwen2", device="cpu",
                              weights=weights, dtype="float32", policy="odma",
                              kv_budget=args.kv_budget, length_log=None, predictor=args.predictor, tagging=mode,
                              max_tokens_cap=work.max_tokens, default_max_tokens=work.max_tokens,
                              max_model_len=args.max_prompt + work.max_tokens, threads=args.threads,
                              pool=PoolConfig(align=16))
        engine = LLMEngine(config, model=model, tokenizer=tokenizer, predictor=load_engine_predictor(args.predictor))
        engine.generate([list(work.prompts[0][:8])], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        if args.step_sleep_ms > 0:
            _sleep_in_steps(engine.workers[0].runner, args.step_sleep_ms / 1000)
        r = engine_burst(engine, [list(q) for q in work.prompts], work.lengths, params, float("inf"), texts=work.texts)
        row = {"mode": mode, "predictor": engine.predictor.name, **{k: r[k] for k in (
            "steps", "seconds", "tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tagging_s", "tag_timeouts",
            "completed", "requests")}, "tagged": r["prediction"]["tagged"]}
        engine.close()
        rounds[mode].append(row)
        print(json.dumps(row), flush=True)
    medians = {mode: {k: statistics.median(row[k] for row in rows) for k in (
        "steps", "seconds", "tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tagging_s")} for mode, rows in rounds.items()}
    print(json.dumps({"medians": medians, "model": args.model, "step_sleep_ms": args.step_sleep_ms,
                      "requests": args.requests, "output_tokens": sum(work.lengths)}, indent=1))


def _sleep_in_steps(runner, seconds: float) -> None:
    import time

    run = runner.run

    def run_then_wait(work):
        out = run(work)
        time.sleep(seconds)
        return out

    runner.run = run_then_wait


if __name__ == "__main__":
    main()
