"""The peer of `odma-bench gpu`: Hugging Face transformers' continuous batching (`ContinuousBatchingManager`, what
`model.generate_batch` drives) on the same burst (`BurstWork`), the same model shape and the same KV bytes as odma's
engine, in the settings its documentation and its own defaults choose for a GPU without flash-attn:

- attention: sdpa; the manager turns it into its paged form ("paged|sdpa"). flash-attn (the documented first
  choice) is not installed on the GPU machine and the hub's kernels cannot be fetched there.
- KV cache: `num_blocks` sized so that the whole paged cache, the two blocks it keeps for padding included, holds
  the burst's KV budget in bytes and no more; 16-token blocks, as odma's paged policy uses (the documented default,
  256, only suits flash's decode kernel, which is not used here, and would waste up to 255 tokens per request).
- `max_batch_tokens` 8192 (the documented default; stated, since with `num_blocks` given the library would size it
  to fill the free memory), `max_requests_per_batch` = the engine's max_num_seqs, scheduler "fifo" (the default).
- CUDA graphs, async batching, compile: the library's own choice (None / level 0). With an attention mask (sdpa)
  it turns graphs and async batching off: padding costs more than the launches it saves. Compile at level 1-3
  would spend most of the part's time cap on warm-up.
- every request is submitted at once with its own `max_new_tokens` (its forced length) and eos disabled (-1), so
  it generates exactly its forced length; per-token timestamps give each request's first-token time.

Random weights of the model's shape, made on the device (meta, then filled in place): the same distribution as
odma.models.tiny.random_model (normal(0, 0.02) matrices, unit norms, zero biases), not the same values.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

from odma.bench.gpu_work import BurstWork

BLOCK_TOKENS = 16  # the paged cache's block, as odma's paged policy
MAX_BATCH_TOKENS = 8192  # the documented default of ContinuousBatchingConfig.max_batch_tokens
RESERVED_BLOCKS = 2  # the paged cache keeps two blocks beyond num_blocks (read and write padding)


def kv_blocks(budget_bytes: int, block_tokens: int, layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """The paged cache's num_blocks whose allocation (num_blocks + the 2 reserved blocks, K and V of every layer)
    fits `budget_bytes`. Raises ValueError when the budget cannot hold one usable block."""
    block_bytes = block_tokens * layers * 2 * kv_heads * head_dim * dtype_bytes
    blocks = budget_bytes // block_bytes - RESERVED_BLOCKS
    if blocks < 1:
        raise ValueError(f"a KV budget of {budget_bytes} bytes holds no block of {block_tokens} tokens "
                         f"({block_bytes} bytes each, {RESERVED_BLOCKS} reserved)")
    return blocks


def hf_config(shape: dict, dtype):
    """transformers' Qwen2Config for one of odma's model shapes (odma.models.tiny: PAPER_7B, TINY_QWEN2)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"], num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_heads"], num_key_value_heads=shape["num_kv_heads"],
        head_dim=shape["head_dim"], rms_norm_eps=shape["rms_norm_eps"], rope_theta=shape["rope_theta"],
        max_position_embeddings=shape["max_position_embeddings"], tie_word_embeddings=shape["tie_word_embeddings"],
        attn_implementation="sdpa", dtype=dtype, eos_token_id=None, bos_token_id=None, pad_token_id=None)


def random_hf_model(shape: dict, dtype, device: str, seed: int = 0):
    """A Qwen2ForCausalLM of `shape` with random weights made on `device` in `dtype` (never whole on the host)."""
    import torch
    from transformers import Qwen2ForCausalLM

    from odma.models.tiny import fill_random_

    config = hf_config(shape, dtype)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config).to(dtype)
    fill_random_(model, device, seed)  # the recipe odma's random models use
    # the rotary frequencies are a buffer that to_empty left unset: made again (a few floats, on the host) and moved
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config).to(device)
    return model.eval()


def cb_config(num_blocks: int, max_requests: int):
    """The ContinuousBatchingConfig of the module's settings, in the spelling of the installed version (5.24 names
    the block `page_size`; 5.17 `block_size`)."""
    import dataclasses

    from transformers.generation import ContinuousBatchingConfig

    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    block = "page_size" if "page_size" in fields else "block_size"
    return ContinuousBatchingConfig(**{block: BLOCK_TOKENS}, num_blocks=num_blocks, max_batch_tokens=MAX_BATCH_TOKENS,
                                    max_requests_per_batch=max_requests, scheduler_type="fifo")


def _settings(manager) -> dict:
    """What the manager resolved (the library fills what was left None)."""
    c = manager.continuous_batching_config
    keep = ("block_size", "page_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch", "use_cuda_graph",
            "use_async_batching", "default_compile_level", "scheduler_type", "safety_margin", "allow_block_sharing",
            "max_blocks_per_request", "max_memory_percent")
    out = {k: getattr(c, k) for k in keep if getattr(c, k, None) is not None}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


def _cache_bytes(manager) -> int | None:
    cache = getattr(manager.batch_processor, "cache", None)
    # 5.17: one K and one V tensor per layer; 5.24: one byte buffer for all
    tensors = [*getattr(cache, "key_cache", ()), *getattr(cache, "value_cache", ()),
               getattr(cache, "cache_tensor", None)]
    tensors = [t for t in tensors if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors) or None


def _collect(manager, ids: set[str], deadline: float) -> tuple[dict[str, Any], bool]:
    """Finished outputs of `ids` until all are in or `deadline` (perf_counter) passes (then: cut = True)."""
    done: dict[str, Any] = {}
    while len(done) < len(ids):
        if time.perf_counter() > deadline:
            return done, True
        result = manager.get_result(timeout=0.5)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' generation thread stopped with requests outstanding")
            continue
        if result.request_id in ids and result.is_finished():
            done[result.request_id] = result
    return done, False


def run_burst(model, work: BurstWork, num_blocks: int, max_requests: int, deadline: float) -> dict:
    """Warm up, then submit every request of `work` at once (each with max_new_tokens = its forced length, eos off)
    and time the burst until the last finishes or `deadline` passes. Returns the figures."""
    from transformers.generation import GenerationConfig

    gen = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=work.max_tokens)
    manager = model.init_continuous_batching(generation_config=gen,
                                             continuous_batching_config=cb_config(num_blocks, max_requests))
    out: dict = {"attn_implementation": None, "settings": {}}
    try:
        t0 = time.perf_counter()
        manager.warmup()  # graphs / compile when the library chose them (with sdpa it chooses neither)
        manager.start()
        out["attn_implementation"] = model.config._attn_implementation
        out["settings"] = _settings(manager)
        # the first passes of a fresh process (allocator, kernels of each size) before the clock: short and long
        # prompts, a few tokens each (the long ones no longer than the burst's, nor than half the cache)
        long = min(512, max(map(len, work.prompts)), num_blocks * BLOCK_TOKENS // 2)
        # ids shifted by one, so that no block of theirs is a cached prefix of a burst prompt
        vocab = model.config.vocab_size
        warm = [[(t + 1) % vocab for t in p[:8]] for p in work.prompts[:4]]
        warm += [[(t + 1) % vocab for t in (p * 512)[:long]] for p in work.prompts[:2]]
        ids = {manager.add_request(p, request_id=f"warm{i}", max_new_tokens=4, eos_token_id=-1)
               for i, p in enumerate(warm)}
        _, cut = _collect(manager, ids, deadline)
        out["warmup_seconds"] = round(time.perf_counter() - t0, 2)
        if cut:
            out["cut_at_cap"] = True
            return out
        out["kv_cache_bytes"] = _cache_bytes(manager)
        start = time.perf_counter()
        target = {}
        for i, (prompt, n) in enumerate(zip(work.prompts, work.lengths)):
            rid = manager.add_request(list(prompt), request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1,
                                      record_timestamps=True)
            target[rid] = n
        done, cut = _collect(manager, set(target), deadline)
        seconds = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=10, hard_stop=True)
    tokens = sum(len(r.generated_tokens) for r in done.values())
    ttft = sorted(r.timestamps[0] - start for r in done.values() if r.timestamps)
    exact = sum(1 for rid, r in done.items() if len(r.generated_tokens) == target[rid])
    out.update({
        "seconds": round(seconds, 2), "requests": work.requests, "completed": len(done), "cut_at_cap": cut,
        "output_tokens": tokens, "forced_output_tokens": work.output_tokens,
        "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None,
        "exact_length": exact, "errors": sum(1 for r in done.values() if r.error is not None),
        "all_forced": not cut and exact == work.requests and tokens == work.output_tokens,
    })
    if ttft:
        out["ttft_s_p50"] = round(statistics.median(ttft), 3)
        out["ttft_s_p99"] = round(ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], 3)
    return out


def unavailable() -> str | None:
    """Why transformers' continuous batching cannot run here, or None."""
    try:
        import transformers
        from transformers.generation import ContinuousBatchingConfig  # noqa: F401
    except ImportError as exc:
        return f"transformers' continuous batching is not importable: {exc}"
    if not hasattr(transformers.Qwen2ForCausalLM, "init_continuous_batching"):
        return f"transformers {transformers.__version__} has no init_continuous_batching"
    return None


def bench_peer(args, device, dtype_name: str, report, cap, make_work: Callable[[int], BurstWork]) -> dict:
    """The `peer` part of odma-bench gpu: transformers' continuous batching on the burst `make_work(vocab_size)`
    gives (the engine's first run's), within `cap`."""
    import torch

    from odma.engine.config import parse_bytes
    from odma.models import DTYPES
    from odma.models.tiny import PAPER_7B, TINY_QWEN2

    out: dict = {"system": "transformers continuous batching", "model": "tiny-qwen2" if args.tiny else "paper-7b",
                 "dtype": dtype_name, "weights": "random, made on the device (not odma's values)"}
    report.result["peer"] = out
    why = unavailable()
    if why is not None:
        out["skipped"] = why
        report.save()
        return out
    import transformers

    out["transformers"] = transformers.__version__
    shape = TINY_QWEN2 if args.tiny else PAPER_7B
    dtype = DTYPES[dtype_name]
    t0 = time.perf_counter()
    model = random_hf_model(shape, dtype, str(device))
    out["model_seconds"] = round(time.perf_counter() - t0, 1)
    work = make_work(shape["vocab_size"])
    budget = parse_bytes(work.kv_budget, "kv budget")
    num_blocks = kv_blocks(budget, BLOCK_TOKENS, shape["num_layers"], shape["num_kv_heads"], shape["head_dim"],
                           torch.empty((), dtype=dtype).element_size())
    out.update({"trace": work.name, "requests": work.requests, "prompt_tokens": work.prompt_tokens,
                "forced_output_tokens": work.output_tokens, "max_tokens": work.max_tokens,
                "kv_budget": work.kv_budget, "kv_budget_bytes": budget, "block_tokens": BLOCK_TOKENS,
                "num_blocks": num_blocks})
    report.save()
    try:
        out.update(run_burst(model, work, num_blocks, args.max_num_seqs, time.perf_counter() + cap.left()))
    finally:
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    report.save()
    return out
