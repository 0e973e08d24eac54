"""Does odma's plugin cost vLLM's prefix cache its hits? The prefix-cache hit rate of stock vLLM against vLLM with the
plugin, on a shared-prefix workload: multi-turn chats from ShareGPT behind one common system prompt, turn by turn,
every chat's next turn after every other chat's turn (so chats compete for the cache between their turns), each
turn's history the chat's recorded answers (not the model's: every system sees the same prompts).

vLLM's free block queue is its cache's eviction order (least recently freed first); the plugin's runs take block
ids by position, which can evict a block stock vLLM would have kept. Hit rate: prompt tokens served from the cache
÷ prompt tokens, over every request (vLLM's own count, `num_cached_tokens`).

Run in the peer venv with the plugin's switch on (stock vLLM is then its own scheduler named and attention "off"):
    ODMA_VLLM=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONPATH=. .peer-venv/bin/python scripts/vllm_prefix_cache.py \\
        --model MODEL_DIR --chats 48 --turns 4 --kv-blocks 160 --out result.json
Any model with SmolLM2's tokenizer serves (the cache sees token ids; answers are recorded ones), a tiny random one
too (tests/test_vllm_plugin.py's), so the run takes seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

SYSTEM = ("You are a helpful assistant. Answer the user's questions accurately and concisely, say when you are not "
          "sure, and keep the conversation friendly. Use plain language, give examples where they help, and never "
          "invent facts, names, numbers or sources.")
STOCK_SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler"


def conversations(chats: int, turns: int, max_chars: int) -> list[list[tuple[str, str]]]:
    """`chats` ShareGPT chats of at least `turns` human→gpt turns, each message cut to max_chars."""
    from odma.trace_sources import sharegpt_path, sharegpt_turns

    by_chat: dict[str, list[tuple[str, str]]] = {}
    for row in sharegpt_turns(sharegpt_path()):
        if row["opens_part"] or row["conversation_id"] in by_chat:
            by_chat.setdefault(row["conversation_id"], []).append((row["prompt"][:max_chars],
                                                                   row["output"][:max_chars]))
    chosen = [c[:turns] for c in by_chat.values() if len(c) >= turns]
    if len(chosen) < chats:
        raise SystemExit(f"only {len(chosen)} ShareGPT chats have {turns} turns")
    return chosen[:chats]


def turn_prompts(tokenizer, chats: list[list[tuple[str, str]]], turn: int) -> list[str]:
    """Every chat's turn `turn`: the system prompt, the earlier turns with their recorded answers, the new question."""
    prompts = []
    for chat in chats:
        messages = [{"role": "system", "content": SYSTEM}]
        for question, answer in chat[:turn]:
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        messages.append({"role": "user", "content": chat[turn][0]})
        prompts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    return prompts


def block_bytes(model: str, block_size: int) -> int:
    """One KV block of the model in float32: layers x K,V x kv heads x head_dim x block_size."""
    with open(os.path.join(model, "config.json")) as f:
        c = json.load(f)
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    return c["num_hidden_layers"] * 2 * c.get("num_key_value_heads", heads) * head_dim * 4 * block_size


def run_system(name: str, model: str, kv_blocks: int, block_size: int, chats, turns: int, max_tokens: int,
               odma: dict | None, max_model_len: int) -> dict:
    from vllm import LLM, SamplingParams

    kw = dict(model=model, dtype="float32", max_model_len=max_model_len, enforce_eager=True, seed=0,
              kv_cache_memory_bytes=0, max_num_seqs=16, block_size=block_size, enable_prefix_caching=True)
    if odma is None:  # stock vLLM in a process where the plugin is on: its scheduler named, its attention kept
        kw.update(scheduler_cls=STOCK_SCHEDULER, additional_config={"odma": {"attention": "off"}})
    else:
        kw.update(additional_config={"odma": odma})
    llm = LLM(**{**kw, "kv_cache_memory_bytes": kv_blocks * block_bytes(model, block_size)})
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompt_tokens = cached_tokens = 0
    by_turn = []
    started = time.perf_counter()
    for turn in range(turns):
        outs = llm.generate(turn_prompts(tokenizer, chats, turn), params, use_tqdm=False)
        p = sum(len(o.prompt_token_ids) for o in outs)
        c = sum(o.num_cached_tokens or 0 for o in outs)
        by_turn.append(round(c / p, 4))
        prompt_tokens, cached_tokens = prompt_tokens + p, cached_tokens + c
    result = {"hit_rate": round(cached_tokens / prompt_tokens, 4), "by_turn": by_turn, "prompt_tokens": prompt_tokens,
              "cached_tokens": cached_tokens, "seconds": round(time.perf_counter() - started, 1),
              "num_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks}
    if odma is not None:
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        result["runs"] = {k: sched.odma_stats()["runs"][k] for k in ("one_run_share", "placed", "moved", "appended")}
    del llm
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--chats", type=int, default=48)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-chars", type=int, default=600, help="each message cut to this many characters")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens generated per turn (not fed back)")
    ap.add_argument("--kv-blocks", type=int, default=160, help="KV blocks of every system (the cache's pressure)")
    ap.add_argument("--block-size", type=int, default=32, help="a multiple of 32 (vLLM's CPU attention)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--systems", default="stock,plugin,plugin-fcfs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if os.environ.get("ODMA_VLLM") != "1":
        raise SystemExit("run with ODMA_VLLM=1 (the plugin registered; stock vLLM is then named explicitly)")
    chats = conversations(args.chats, args.turns, args.max_chars)
    variants = {"stock": None, "plugin": {}, "plugin-fcfs": {"order": "fcfs"}, "plugin-off": {"runs": False},
                **{f"plugin-fcfs-keep{k}": {"order": "fcfs", "cache_keep": k} for k in (0.0, 0.25, 0.75)}}
    result: dict = {"workload": {k: getattr(args, k) for k in ("chats", "turns", "max_chars", "max_tokens",
                                                                "kv_blocks", "block_size")}, "systems": {}}
    for name in (s.strip() for s in args.systems.split(",") if s.strip()):
        result["systems"][name] = run_system(name, args.model, args.kv_blocks, args.block_size, chats, args.turns,
                                             args.max_tokens, variants[name], args.max_model_len)
    stock = result["systems"].get("stock")
    if stock:
        for name, r in result["systems"].items():
            r["vs_stock"] = round(r["hit_rate"] / stock["hit_rate"], 4) if stock["hit_rate"] else None
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    json.dump(main(), sys.stdout, indent=1)
    sys.stdout.write("\n")
