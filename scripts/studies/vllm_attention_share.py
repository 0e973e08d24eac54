"""How much of vLLM-CPU's serving time its attention takes: an offline run of N chats decoding together, each
layer's attention call timed from outside (its implementation's forward and its K/V write), against the run's wall
time; vLLM's own CPU attention or odma's backend.

    ODMA_VLLM=1 VLLM_CPU_OMP_THREADS_BIND=0 PYTHONPATH=. .peer-venv/bin/python scripts/studies/vllm_attention_share.py \\
        --model MODEL_DIR --attention off      # vLLM's own (its scheduler named), or: --attention runs

Bind vLLM's threads to one core (VLLM_CPU_OMP_THREADS_BIND=0) to match `odma-bench peer --threads 1`. Prints one
JSON object: wall seconds, output tokens per second, seconds in attention (decode-only steps apart, with their calls
and rows) and in the K/V writes, and the attention's share of the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--attention", default="off", choices=("off", "runs", "paged"))
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    if os.environ.get("ODMA_VLLM") != "1":
        raise SystemExit("run with ODMA_VLLM=1 (odma's plugin registered; 'off' then names vLLM's own scheduler)")
    from vllm import LLM, SamplingParams

    kw = dict(model=args.model, dtype="float32", max_model_len=2048, seed=0, kv_cache_memory_bytes=1 << 30,
              max_num_seqs=args.requests, additional_config={"odma": {"attention": args.attention, "order": "fcfs"}})
    if args.attention == "off":
        kw["scheduler_cls"] = "vllm.v1.core.sched.scheduler.Scheduler"
    llm = LLM(**kw)
    ctx = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    impl = type(next(m.impl for m in ctx.values() if hasattr(m, "impl")))
    spent = {"attention_s": 0.0, "decode_attention_s": 0.0, "kv_write_s": 0.0, "decode_calls": 0, "decode_rows": 0}
    forward, write = impl.forward, impl.do_kv_cache_update

    def timed_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *rest, **kw):
        t0 = time.perf_counter()
        out = forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *rest, **kw)
        took = time.perf_counter() - t0
        spent["attention_s"] += took
        if attn_metadata is not None and getattr(attn_metadata, "max_query_len", 1) == 1 and \
                not getattr(attn_metadata, "prefills", None):
            spent["decode_attention_s"] += took
            spent["decode_calls"] += 1
            spent["decode_rows"] += int(getattr(attn_metadata, "num_actual_tokens", 0))
        return out

    def timed_write(self, *a, **kw):
        t0 = time.perf_counter()
        write(self, *a, **kw)
        spent["kv_write_s"] += time.perf_counter() - t0

    impl.forward, impl.do_kv_cache_update = timed_forward, timed_write
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"Question {i}: why is the sky blue?"}],
                                             add_generation_prompt=True, tokenize=False) for i in range(args.requests)]
    llm.generate(prompts[:4], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
    spent.update(attention_s=0.0, decode_attention_s=0.0, kv_write_s=0.0, decode_calls=0, decode_rows=0)
    params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=args.max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    return {"attention": args.attention, "impl": impl.__name__, "wall_s": round(wall, 2),
            "out_tok_s": round(args.requests * args.max_tokens / wall, 1), **{k: round(v, 2) for k, v in spent.items()},
            "decode_us_per_row": round(1e6 * spent["decode_attention_s"] / max(spent["decode_rows"], 1), 2),
            "attention_share": round((spent["attention_s"] + spent["kv_write_s"]) / wall, 3)}


if __name__ == "__main__":
    json.dump(main(), sys.stdout)
    sys.stdout.write("\n")
