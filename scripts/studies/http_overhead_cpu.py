"""odma-serve's host cost per streamed token on CPU, where a tiny model's step is cheap enough that the server's
own work shows (as a fast GPU step lets it show): the http part of `odma-bench gpu` (odma.bench.gpu_http) on
random:tiny-qwen2 with longer outputs than its dry run (6 requests of 16 tokens is too little work to measure).

    nice -n 19 .venv/bin/python scripts/studies/http_overhead_cpu.py --requests 128 --max-tokens 256 --rounds 3

Each round runs the same burst through the engine in process, then through odma-serve over HTTP (64 streaming
clients); prints one JSON line per round and one with the medians: tokens/s of each, http ÷ engine, and CPU time
per output token of the engine's process during its burst and of the server's process during its burst (with
its warm-up requests): the host cost of serving over HTTP, which other work on the machine barely moves while it
moves the tokens/s a lot. The server imports this checkout's odma (gpu_http sets PYTHONPATH
from the odma this script imports): to compare two commits, run the script from a checkout of each, alternating.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's odma, not an installed one


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=256, help="the trace's output lengths are cut to this")
    p.add_argument("--max-prompt", type=int, default=64)
    p.add_argument("--trace", default="azure-conv")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--also-flags", default=None,
                   help="server flags of a second HTTP run in every round, after the first in odd rounds and before it in even "
                        "ones (e.g. '--gil-switch-ms 1'): "
                        "its tokens/s, ratio and CPU per token as http_b_*")
    p.add_argument("--decode-only", action="store_true",
                   help="only the streams' detokenisation: µs per token of a TextStream over SmolLM2's tokenizer at "
                        "256 and 1,024 tokens, windowed and decoding the whole output each time (as before)")
    args = p.parse_args()
    if args.decode_only:
        return decode_cost()

    from odma.bench import gpu_http
    from odma.bench.gpu_work import burst_from_trace
    from odma.models.random_served import RANDOM_TOKENIZER
    from odma.tokenizer import load_tokenizer

    work = burst_from_trace(args.trace, args.requests, max_prompt=args.max_prompt, max_tokens=args.max_tokens,
                            kv_budget="64MiB", vocab_size=len(load_tokenizer(RANDOM_TOKENIZER).hf))
    flags = gpu_http.server_flags(argparse.Namespace(tiny=True, odma_memory="swap"), work, "cpu", "float32")
    rounds = []
    for i in range(args.rounds):
        engine, engine_cpu = engine_burst(flags, work)
        servers = {"a": flags} | ({"b": flags + args.also_flags.split()} if args.also_flags else {})
        order = list(servers)[::-1] if i % 2 else list(servers)  # every other round the second server first
        runs = {name: http_burst(servers[name], work) for name in order}
        http, server_cpu = runs["a"]
        http_b, server_b_cpu = runs.get("b", (None, None))
        tokens = work.output_tokens
        row = {"round": i + 1, "output_tokens": tokens, "engine_tok_s": engine["tokens_per_s"],
               "http_tok_s": http["tokens_per_s"], "http_ok": http["requests_ok"], "requests": work.requests,
               "engine_cpu_us_per_token": round(engine_cpu / tokens * 1e6, 1),
               "server_cpu_us_per_token": round(server_cpu / tokens * 1e6, 1)}
        row["ratio"] = round(row["http_tok_s"] / row["engine_tok_s"], 3)
        if args.also_flags:
            row.update(http_b_tok_s=http_b["tokens_per_s"], http_b_ok=http_b["requests_ok"],
                       ratio_b=round(http_b["tokens_per_s"] / row["engine_tok_s"], 3),
                       server_b_cpu_us_per_token=round(server_b_cpu / tokens * 1e6, 1))
        rounds.append(row)
        print(json.dumps(row), flush=True)
    keys = ("engine_tok_s", "http_tok_s", "ratio", "engine_cpu_us_per_token", "server_cpu_us_per_token")
    if args.also_flags:
        keys += ("http_b_tok_s", "ratio_b", "server_b_cpu_us_per_token")
    print(json.dumps({"median": {k: statistics.median(r[k] for r in rounds) for k in keys}}))


def decode_cost() -> None:
    from types import SimpleNamespace

    from odma.engine.output_text import OutputDecoder
    from odma.server.streams import TextStream
    from odma.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2").hf
    engine = SimpleNamespace(tokenizer=tok, decode=OutputDecoder(tok, (tok.eos_token_id,)))
    text = (Path(__file__).resolve().parents[2] / "docs" / "ARCHITECTURE.md").read_text()
    ids = tok.encode(text, add_special_tokens=False)
    for n in (256, 1024):
        for whole in (True, False):
            best = float("inf")
            for _ in range(3):
                stream = TextStream(engine, stops=("</s>",))
                stream._text.full_decode = whole
                t0 = time.perf_counter()
                for t in ids[:n]:
                    stream.push(t)
                stream.flush()
                best = min(best, time.perf_counter() - t0)
            print(json.dumps({"tokens": n, "decode": "whole" if whole else "window",
                              "us_per_token": round(best / n * 1e6, 1)}))


def engine_burst(flags: list[str], work) -> tuple[dict, float]:
    """gpu_http's engine run (the same engine, warm-up and burst), with this process's CPU seconds in the burst."""
    from odma.bench import gpu_http
    from odma.engine import LLMEngine, SamplingParams
    from odma.server.cli import build_parser, config_from_args

    engine = LLMEngine(config_from_args(build_parser().parse_args(flags)))
    try:
        engine.generate(gpu_http.warm_prompts(work), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        cpu = time.process_time()
        result = gpu_http._engine_burst(engine, work, time.perf_counter() + 600)
        return result, time.process_time() - cpu
    finally:
        engine.close()


def http_burst(flags: list[str], work) -> tuple[dict, float]:
    """gpu_http's HTTP run against a server started as it starts it, with the server's CPU seconds in the burst."""
    import asyncio

    from odma.bench import gpu_http

    log = Path(tempfile.mkdtemp(prefix="odma-http-cpu-")) / "server.log"
    with gpu_http.running_server(flags, log, 120) as server:
        cpu = _process_cpu(server.pid)
        result = asyncio.run(gpu_http._drive(server.url, gpu_http.served_name(flags), work, time.perf_counter() + 600))
        return result, _process_cpu(server.pid) - cpu


def _process_cpu(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    main()
