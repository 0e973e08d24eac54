"""How much long prompts delay everyone else on a running odma-serve: a neighbour stream's gaps between chunks and
/health's latency while prompts are posted beside it.

    .venv/bin/python scripts/stall_probe.py --url http://127.0.0.1:8000 --prompt-tokens 4000,8000
    .venv/bin/python scripts/stall_probe.py --url http://127.0.0.1:8000 --prompt-mb 10

--prompt-tokens posts one completion per size, all at once (words of one token each for SmolLM2's tokenizer, 4
tokens out): what a long document or a long chat history does to the streams already running. --prompt-mb posts
one huge prompt (refused for its length: what tokenizing it costs the others). Prints one JSON object: the
neighbour's median gap before the posts, its largest gap and /health's largest latency while they were in flight,
each post's status and duration.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

WORD = " river"  # one token in SmolLM2's vocabulary, also after itself


async def neighbour(client: httpx.AsyncClient, model: str, arrivals: list[float], done: asyncio.Event) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a long story about a river."}],
            "max_tokens": 2000, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                arrivals.append(time.perf_counter())
            if done.is_set():
                return


async def health(client: httpx.AsyncClient, samples: list[tuple[float, float]], done: asyncio.Event) -> None:
    while not done.is_set():
        start = time.perf_counter()
        await client.get("/health")
        samples.append((start, time.perf_counter() - start))
        await asyncio.sleep(0.05)


async def probe(url: str, model: str, megabytes: float | None, prompt_tokens: list[int]) -> dict:
    arrivals: list[float] = []
    samples: list[tuple[float, float]] = []
    done = asyncio.Event()
    limits = httpx.Limits(max_connections=8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        tasks = [asyncio.create_task(neighbour(client, model, arrivals, done)),
                 asyncio.create_task(health(client, samples, done))]
        while len(arrivals) < 30:  # the neighbour streams steadily
            await asyncio.sleep(0.05)
        before = [b - a for a, b in zip(arrivals, arrivals[1:])]
        prompts = [WORD * n for n in prompt_tokens] if prompt_tokens else ["a " * int(megabytes * 1e6 / 2)]

        async def post(prompt: str) -> tuple[httpx.Response, float]:
            started = time.perf_counter()
            r = await client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 4})
            return r, time.perf_counter() - started

        start = time.perf_counter()
        posted = await asyncio.gather(*(post(p) for p in prompts))
        end = time.perf_counter()
        await asyncio.sleep(1.0)
        done.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if b >= start and a <= end + 1.0]
    health_during = [lat for at, lat in samples if start - 0.05 <= at <= end]
    posts = [{"status": r.status_code, "prompt_tokens": r.json().get("usage", {}).get("prompt_tokens"),
              "refusal": r.json().get("error", {}).get("message", "")[:120], "post_s": round(took, 3)}
             for r, took in posted]
    return {"prompt_mb": megabytes if not prompt_tokens else None, "prompt_tokens": prompt_tokens, "posts": posts,
            "neighbour_gap_median_before_s": round(statistics.median(before), 4),
            "neighbour_gap_max_during_s": round(max(during, default=0.0), 4),
            "health_max_during_s": round(max(health_during, default=0.0), 4), "health_samples_during": len(health_during)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="a running odma-serve (default: %(default)s)")
    p.add_argument("--model", default="default", help="a served model name (default: %(default)s)")
    p.add_argument("--prompt-mb", type=float, default=10.0, help="size of the huge prompt (default: %(default)s)")
    p.add_argument("--prompt-tokens", default="", help="prompt lengths in tokens, posted together (e.g. 4000,8000)")
    args = p.parse_args()
    sizes = [int(x) for x in args.prompt_tokens.split(",") if x.strip()]
    print(json.dumps(asyncio.run(probe(args.url, args.model, args.prompt_mb, sizes))))


if __name__ == "__main__":
    main()
