"""`odma-serve`: the OpenAI-compatible server. With no arguments it serves SmolLM2-135M-Instruct on CPU."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

from odma.config import GROWTH_HINTS, GROWTH_POLICIES, BucketConfig, PoolConfig, default_cache_dir
from odma.engine.config import (ATTENTION_KINDS, DECODE_GRAPHS, KV_GROWTH, LOG_PROMPT_MODES, POLICIES, EngineConfig,
                                TAGGING, device_capabilities)
from odma.engine.ordering import ORDERS
from odma.errors import ConfigError, OdmaError
from odma.models.weights import WEIGHT_DTYPES, WEIGHTS
from odma.server.logs import configure_logging
from odma.server.ray_settings import INGRESS, PREDICT_AT, ROUTERS, RaySettings

log = logging.getLogger("odma.serve")


_SAYS_DEFAULT = re.compile(r"\(default\b|\bdefault:")


class _HelpWithDefaults(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says it in words."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.default in (None, argparse.SUPPRESS) or _SAYS_DEFAULT.search(text):
            return text
        value = {True: "on", False: "off"}[action.default] if isinstance(action.default, bool) else action.default
        return f"{text} (default: {str(value).replace('%', '%%')})"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="odma-serve", description=__doc__, formatter_class=_HelpWithDefaults)
    d = EngineConfig()
    p.add_argument("--model", default=d.model,
                   help="smollm2 (default), a HF folder, a .gguf file, a hub name, or random:paper-7b / "
                        "random:tiny-qwen2: RANDOM weights of that shape (the paper's 7B model; a 2-layer stand-in "
                        "for CPUs) made on the device, SmolLM2's tokenizer, no download; for benchmarks with forced "
                        "lengths (ignore_eos): its text means nothing and it never ends a request itself")
    p.add_argument("--served-model-name", default=None, help="the id /v1/models reports (default: from --model)")
    p.add_argument("--device", default=d.device, help="cpu | cuda[:N] | mlu[:N]")
    p.add_argument("--devices", default=None,
                   help="several devices, one KV pool each, e.g. mlu:0,mlu:1 or cuda:0,cuda:1 (cpu:0,cpu:1 tests placement); "
                        "--kv-budget is per device (default: --device alone)")
    p.add_argument("--weights", default=d.weights, choices=WEIGHTS,
                   help="native: a GGUF model's quantized blocks as they are, dequantized inside the CPU GEMM "
                        "(Q4_0, Q4_1, Q8_0, Q4_K, Q6_K); f32 / bf16: dense weights of that dtype; auto: native for a "
                        "quantized GGUF (the default model is Q4_1) on a CPU with the kernel, unless --dtype is given")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="dense weights of this dtype (default: float32 on cpu, bfloat16 elsewhere; bfloat16 is much "
                        "faster on CPUs with AVX512-BF16 or AMX, see docs/serving.md)")
    p.add_argument("--kv-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="KV cache dtype (default: float16 on cpu, read widened to fp32 by its kernels; --dtype elsewhere)")
    p.add_argument("--policy", default=d.policy, choices=POLICIES,
                   help="KV reservation policy (paged: 16-token pages, the baseline; needs the Triton attention)")
    p.add_argument("--attention", default=d.attention, choices=ATTENTION_KINDS,
                   help="attention kernel: auto (CPU: the C decode kernel; GPU/MLU: Triton over the KV arena), "
                        "triton, or sdpa (torch per request)")
    p.add_argument("--decode-graphs", default=d.decode_graphs, choices=DECODE_GRAPHS,
                   help="decode steps through the Triton kernels as batches captured once and replayed: auto (CUDA "
                        "graphs on CUDA, off elsewhere), capture, static (the same batches run eagerly), off")
    p.add_argument("--kv-budget", default=d.kv_budget, help="KV pool: bytes (268435456, 256MiB, 2GB) or a share of device memory (0.3, 30%%)")
    p.add_argument("--growth", default=d.pool.growth, choices=GROWTH_POLICIES,
                   help="what an outgrown block migrates to: the next bucket, the large one, twice its reservation, "
                        "or --growth-step tokens beyond its need")
    p.add_argument("--growth-step", type=int, default=d.pool.growth_step,
                   help="--growth step: output tokens reserved beyond what the block needs")
    p.add_argument("--kv-growth", default=d.kv_growth, choices=KV_GROWTH,
                   help="copy: an outgrown block migrates (one sequential copy); map: every block is address space for "
                        "its worst case and memory is mapped behind it as it grows (virtual memory: CUDA, Linux hosts); "
                        "auto: map where the device's granule wastes nothing (host pages), else copy")
    p.add_argument("--reserve-scale", type=float, default=d.pool.reserve_scale,
                   help="odma reserves for reserve_scale·L̂ and grows by migration past it (the replays chose this value)")
    p.add_argument("--growth-hint", default=d.pool.growth_hint, choices=GROWTH_HINTS,
                   help="pred: a request's first growth goes straight to the bucket holding its L̂; "
                        "none: bucket by bucket")
    p.add_argument("--large-share", type=float, default=d.pool.large_share, help="share of the pool held for the large bucket")
    p.add_argument("--compact-growth", action=argparse.BooleanOptionalAction, default=d.pool.compact_growth,
                   help="a block that cannot grow although enough KV is free (fragmentation) gets a range by relocating "
                        "the blocks in the emptiest one (copies) instead of a preemption; pays where copies are fast "
                        "(GPUs: docs/results/gpu/replay_fit.md)")
    p.add_argument("--slide-growth", action=argparse.BooleanOptionalAction, default=d.pool.slide_growth,
                   help="with --compact-growth: when no range can be cleared, blocks slide over the gaps between them "
                        "until the growth fits (a partial compaction)")
    p.add_argument("--neighbour-growth", action=argparse.BooleanOptionalAction, default=d.pool.neighbour_growth,
                   help="a block that cannot grow in place grows over the free units before it too (one overlapping "
                        "copy) before it migrates")
    p.add_argument("--continue-growth", action=argparse.BooleanOptionalAction, default=d.pool.continue_growth,
                   help="a block that cannot grow where it lies goes on in a new block, its rows so far read where "
                        "they are (no copy, no slide; the Triton attention reads the pieces, a CPU the model's own "
                        "attention)")
    p.add_argument("--packing", action=argparse.BooleanOptionalAction, default=d.packing,
                   help="keep odma's blocks packed under pressure: --compact-growth --slide-growth --neighbour-growth "
                        "--growth step, admission within θ 0.97, and a block that finds no room waits (--preempt swap "
                        "becomes wait) (docs/results/gpu/replay_policy.md; default: on "
                        "where block copies are cheap, accelerators, off on a CPU)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="decode batch cap")
    p.add_argument("--schedule", default=d.schedule, choices=ORDERS,
                   help="order of service: fcfs, or sjf (shortest predicted remaining output first, with aging)")
    p.add_argument("--sjf-aging-rounds", type=int, default=d.sjf_aging_rounds,
                   help="sjf: a request that has waited this many admission rounds longer than the newest waiting one goes first")
    p.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens,
                   help="prompt tokens prefilled per engine step beside its decodes (a longer prompt is chunked over "
                        "steps; with --no-chunked-prefill it passes whole, alone)")
    p.add_argument("--chunked-prefill", action=argparse.BooleanOptionalAction, default=d.chunked_prefill,
                   help="feed a prompt longer than --max-prefill-tokens over several steps beside the running decodes "
                        "(off: whole, and every stream waits for it)")
    p.add_argument("--max-tokens-cap", type=int, default=d.max_tokens_cap, help="largest max_tokens accepted (the large bucket's bound)")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len,
                   help="prompt + max_tokens limit (default: the model's max_position_embeddings)")
    p.add_argument("--parallel-devices", action=argparse.BooleanOptionalAction, default=d.parallel_devices,
                   help="run several devices' model steps concurrently (default: on for accelerators, off for CPU pools)")
    p.add_argument("--s3-buckets", type=int, default=d.s3_buckets, help="equal-width buckets of --policy s3")
    p.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens, help="max_tokens when a chat request sets none")
    p.add_argument("--preempt", default=d.preempt, choices=["wait", "recompute", "swap"],
                   help="under memory pressure: stall, free and recompute later, or swap the K/V to a host buffer")
    p.add_argument("--admission-theta", type=float, default=d.admission_theta,
                   help="admit new requests only while reservations stay within this share of the pool (eLLM Alg. 1; 1 = off)")
    p.add_argument("--admission-demand", type=float, default=d.admission_demand,
                   help="admit new requests only while the predicted final KV of the running ones (prompt + L̂) plus "
                        "theirs stays within this share of the pool (e.g. 1.0; default: off)")
    p.add_argument("--swap-space", default=d.swap_space, help="host KV buffer for --preempt swap (bytes: 1GiB, ...)")
    p.add_argument("--slo-ttft", type=float, default=None,
                   help="TTFT SLO (s): violations grow the swap buffer (eLLM Alg. 2; default: none, a fixed buffer)")
    p.add_argument("--slo-tpot", type=float, default=None,
                   help="TPOT SLO (s): violations shrink the swap buffer (eLLM Alg. 2; default: none, a fixed buffer)")
    p.add_argument("--balloon", action="store_true",
                   help="lend the activation reserve (a max-prefill-tokens prefill's peak) to the KV pool while requests wait")
    p.add_argument("--balloon-segment-tokens", type=int, default=d.balloon_segment_tokens, help="KV tokens per lent segment")
    p.add_argument("--balloon-keep-tokens", type=int, default=d.balloon_keep_tokens,
                   help="the activation room of a prefill this long is never lent")
    p.add_argument("--balloon-chunked-prefill", action=argparse.BooleanOptionalAction, default=d.balloon_chunked_prefill,
                   help="with --balloon: prefill a prompt whose activation room is lent in chunks of the free room")
    p.add_argument("--clear-window", action=argparse.BooleanOptionalAction, default=d.clear_window,
                   help="relocate the blocks in the way of a request that holds the queue instead of waiting for them")
    p.add_argument("--prefix-share-min-tokens", type=int, default=d.prefix_share_min_tokens,
                   help="copy the K/V of a prompt prefix at least this long from a running request that has it "
                        "cached instead of computing it (0: off)")
    p.add_argument("--prefix-reads", action=argparse.BooleanOptionalAction, default=d.prefix_reads,
                   help="read such a prefix where the running request keeps it instead of copying it (a smaller "
                        "block; the Triton attention reads the pieces, a CPU the model's own attention)")
    p.add_argument("--worst-case-prompt-share", type=float, default=d.pool.worst_case_prompt_share,
                   help="a request whose prompt exceeds this share of the pool reserves prompt + max_tokens up front")
    p.add_argument("--predictor", default=d.predictor, help="length predictor: the trained text encoder (default), sklearn, oracle, a folder, or median")
    p.add_argument("--tagging", default=d.tagging, choices=TAGGING,
                   help="where requests get their predicted length: ahead (a worker thread from arrival, overlapping "
                        "the model's steps), loop (inside the engine step), auto (ahead when served)")
    p.add_argument("--tag-batch", type=int, default=d.tag_batch,
                   help="tagging ahead: requests one predictor call tags at most")
    p.add_argument("--tag-timeout", type=float, default=d.tag_timeout_s,
                   help="tagging ahead: seconds a request waits for its tag before it goes on untagged")
    p.add_argument("--probe", default=d.probe,
                   help="the served model's own length probe: probe (the shipped SmolLM2 one), a probe folder, or none "
                        "(default: none)")
    p.add_argument("--probe-online", action=argparse.BooleanOptionalAction, default=d.probe_online,
                   help="the probe learns online from finished requests")
    p.add_argument("--length-log", default=str(d.length_log), help="JSONL of realized lengths ('' to disable)")
    p.add_argument("--length-log-prompts", default=d.length_log_prompts, choices=LOG_PROMPT_MODES,
                   help="what the length log keeps of each prompt: text (retraining the text predictor needs it), "
                        "hash (its SHA-256) or none; docs/serving.md says what each mode still serves")
    p.add_argument("--length-log-max-size", default=d.length_log_max_size,
                   help="rotate the length log at this size (bytes: 64MiB, 1GB; 0: never)")
    p.add_argument("--length-log-backups", type=int, default=d.length_log_backups,
                   help="rotated length logs kept (lengths.jsonl.1, .2, ...; the oldest is dropped)")
    p.add_argument("--bootstrap-from-log", action=argparse.BooleanOptionalAction, default=d.bootstrap_from_log,
                   help="seed the bucket bounds with the length log's last realized lengths")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests (samples) admitted and not running yet before 429")
    p.add_argument("--max-n", type=int, default=16, help="the largest n (samples per request) accepted")
    p.add_argument("--generation-config", default="auto",
                   help="sampling defaults for requests that leave them out: auto (the model's generation_config.json; "
                        "for the embedded SmolLM2, its model card's temperature 0.2, top_p 0.9), vllm (OpenAI's "
                        "defaults: temperature 1, top_p 1), or a folder holding a generation_config.json")
    p.add_argument("--override-generation-config", default=None,
                   help='JSON applied over those defaults, e.g. \'{"temperature": 0.6, "top_p": 0.9}\' '
                        "(temperature, top_p, top_k, max_new_tokens; default: none)")
    p.add_argument("--threads", type=int, default=d.threads,
                   help="torch CPU threads (default: all cores but one, which the HTTP side and the predictor need)")
    p.add_argument("--gil-switch-ms", type=float, default=None,
                   help="the interpreter's thread switch interval (sys.setswitchinterval) in this server's process, "
                        "where the engine loop and the HTTP side share one interpreter lock (default: Python's 5 ms)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run the engine in a process of its own, so the HTTP side (tokenizing, detokenizing, SSE) "
                        "and the engine's step loop do not share one interpreter lock (docs/serving.md; default: on "
                        "for accelerators, whose steps run off the host, off on a CPU)")
    ray = p.add_argument_group("Ray Serve (several replicas behind one endpoint; needs the ray extra: pip install 'odma[ray]')")
    r = RaySettings()
    ray.add_argument("--ray", action="store_true", help="serve on Ray Serve: --replicas engines behind one endpoint")
    ray.add_argument("--replicas", type=int, default=r.replicas, help="engine replicas (each: --kv-budget, --threads)")
    ray.add_argument("--router", default=r.router, choices=ROUTERS,
                     help="odma: memory-aware (predicted KV need vs each replica's largest free range and queue); "
                          "pow2: Ray Serve's default power-of-two-choices")
    ray.add_argument("--predict-at", default=r.predict_at, choices=PREDICT_AT,
                     help="where the length predictor runs: front (once, at the ingress, so the router sees it) or replica")
    ray.add_argument("--ray-ingress", default=r.ingress, choices=INGRESS,
                     help="front: an ingress replica predicts and routes each request by its predicted KV need; "
                          "engines: Ray's proxy routes straight to the engine replicas (one hop fewer; the router "
                          "then places by typical need and each engine predicts)")
    ray.add_argument("--ray-address", default=None, help="join a running Ray cluster (auto, ray://host:10001); default: start one")
    ray.add_argument("--replica-cpus", type=float, default=None, help="Ray CPUs per replica (default: --threads)")
    ray.add_argument("--router-max-hold-s", type=float, default=r.max_hold_s,
                     help="hold a request no replica has room for at the router up to this long (0: never; it "
                          "waits at the replica closest to room)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0: every interface, for clients on other machines)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="odma's and uvicorn's log level (other libraries log warnings only, unless debug)")
    return p


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    devices = tuple(d.strip() for d in (args.devices or "").split(",") if d.strip())
    device = devices[0] if devices else args.device
    weights = args.weights
    if weights == "auto" and args.dtype:  # a dtype asked for is dense weights of that dtype
        weights = {"float32": "f32", "bfloat16": "bf16"}.get(args.dtype, "auto")
    dtype = args.dtype or WEIGHT_DTYPES.get(weights) or device_capabilities(device).default_dtype
    return EngineConfig(
        model=args.model, device=device, devices=devices, dtype=dtype, weights=weights, kv_dtype=args.kv_dtype, policy=args.policy, attention=args.attention, kv_growth=args.kv_growth,
        decode_graphs=args.decode_graphs,
        kv_budget=args.kv_budget,
        max_num_seqs=args.max_num_seqs, schedule=args.schedule, sjf_aging_rounds=args.sjf_aging_rounds,
        max_prefill_tokens=args.max_prefill_tokens, chunked_prefill=args.chunked_prefill,
        max_tokens_cap=args.max_tokens_cap,
        max_model_len=args.max_model_len, parallel_devices=args.parallel_devices, s3_buckets=args.s3_buckets,
        balloon_keep_tokens=args.balloon_keep_tokens, bootstrap_from_log=args.bootstrap_from_log,
        default_max_tokens=min(args.default_max_tokens, args.max_tokens_cap), preempt=args.preempt, admission_theta=args.admission_theta,
        admission_demand=args.admission_demand, swap_space=args.swap_space, predictor=args.predictor,
        tagging=args.tagging, tag_batch=args.tag_batch, tag_timeout_s=args.tag_timeout,
        probe=None if args.probe in (None, "", "none") else args.probe, probe_online=args.probe_online,
        slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
        length_log=Path(args.length_log).expanduser() if args.length_log else None, threads=args.threads,
        length_log_prompts=args.length_log_prompts, length_log_max_size=args.length_log_max_size,
        length_log_backups=args.length_log_backups,
        balloon=args.balloon, balloon_segment_tokens=args.balloon_segment_tokens,
        balloon_chunked_prefill=args.balloon_chunked_prefill, clear_window=args.clear_window,
        prefix_share_min_tokens=args.prefix_share_min_tokens, prefix_reads=args.prefix_reads,
        pool=replace(PoolConfig(), growth=args.growth, large_share=args.large_share, reserve_scale=args.reserve_scale,
                     growth_hint=args.growth_hint, worst_case_prompt_share=args.worst_case_prompt_share,
                     compact_growth=args.compact_growth, slide_growth=args.slide_growth,
                     neighbour_growth=args.neighbour_growth, growth_step=args.growth_step,
                     continue_growth=args.continue_growth),
        packing=args.packing,
        buckets=replace(BucketConfig(), large_bound=args.max_tokens_cap),
    )


def ray_settings_from_args(args: argparse.Namespace) -> RaySettings:
    return RaySettings(replicas=args.replicas, router=args.router, predict_at=args.predict_at, ingress=args.ray_ingress,
                       address=args.ray_address,
                       replica_cpus=args.replica_cpus or float(args.threads), max_queue=args.max_queue,
                       max_hold_s=args.router_max_hold_s)


def engine_in_own_process(flag: bool | None, config: EngineConfig) -> bool:
    """--engine-process as given, else on where the engine's steps run off the host (an accelerator: there the
    HTTP side's Python per streamed token, under the lock the step loop needs, is what holds the device back; 0.81×
    of the engine alone in one process against 0.93× in two on an H200), off on a CPU."""
    return flag if flag is not None else config.capabilities.steps_off_host


def build_server(config: EngineConfig, max_queue: int = 256, served_name: str | None = None, *,
                 generation_config: str = "auto", override_generation_config: str | None = None, max_n: int = 16):
    """(app, runtime): the engine, its metrics and the FastAPI app, ready for uvicorn."""
    from odma.engine import LLMEngine
    from odma.models.weights import model_name
    from odma.server.app import create_app
    from odma.server.generation_config import engine_sampling_defaults
    from odma.server.metrics import Metrics
    from odma.server.runtime import AsyncEngine

    if max_n < 1:
        raise ConfigError(f"--max-n must be >= 1, got {max_n}")
    metrics = Metrics()
    engine = LLMEngine(config, metrics=metrics)
    defaults = engine_sampling_defaults(engine, generation_config, override_generation_config)
    log.info("sampling defaults for requests that leave them out: %s", defaults.describe(config.default_max_tokens))
    runtime = AsyncEngine(engine, max_queue=max_queue)
    metrics.attach(runtime)
    name = served_name or model_name(config.model)
    app = create_app(runtime, metrics, name, aliases=(config.model, "default"), defaults=defaults, max_n=max_n)
    return app, runtime


# `--ray` serves the same app on Ray Serve. odma.serve_ray is built on this package (its ingress runs create_app),
# so the CLI names its entry point and imports it only when asked: dependencies run one way, serve_ray → server.
RAY_ENTRY = "odma.serve_ray.app:serve_forever"


def _serve_on_ray(args: argparse.Namespace, config: EngineConfig) -> int:
    try:
        import ray.serve  # noqa: F401 - odma.serve_ray imports Ray only once it deploys: say what is missing now
    except ImportError as exc:
        raise ConfigError(f"--ray needs Ray Serve: pip install 'odma[ray]' ({exc})") from None
    module, _, function = RAY_ENTRY.partition(":")
    serve_forever = getattr(importlib.import_module(module), function)
    return serve_forever(config, ray_settings_from_args(args), host=args.host, port=args.port,
                         served_name=args.served_model_name, generation_config=args.generation_config,
                         override_generation_config=args.override_generation_config, max_n=args.max_n)


GRACE_S = 5.0  # how long uvicorn waits for connections after a stop signal (streams end at once: they are drained)


def serve(app, runtime, host: str, port: int, log_level: str) -> None:
    """uvicorn until SIGINT/SIGTERM. The signal drains the runtime first (every live request ends now, a stream with
    a last event saying why), so uvicorn's wait for open connections is short; then the engine closes (its length
    log, the probe's state)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            runtime.drain()
            super().handle_exit(sig, frame)
            # uvicorn raises the signal again once it has stopped (a KeyboardInterrupt, or death by SIGTERM before
            # the engine is closed): stopping is all the signal asked for
            getattr(self, "_captured_signals", []).clear()

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=GRACE_S)
    DrainingServer(config).run()
    runtime.close()


def run() -> None:
    """The `odma-serve` command: `main`, then, after a plain server stopped cleanly, an exit that skips the
    interpreter's teardown of torch, transformers and onnxruntime (0.7-0.8 s after "Finished server process" here,
    more on a loaded machine); everything odma writes is closed and flushed by then."""
    code = main(exit_fast=True)
    sys.exit(code)


def _exit_now(code: int) -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None, *, exit_fast: bool = False) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        config = config_from_args(args)
        extension = config.capabilities.torch_extension
        if extension:
            log.warning("--device %s: its backend needs the torch extension %s; without it start-up stops here",
                        config.device, extension)
        log.info("starting odma-serve: model=%s device=%s policy=%s kv-budget=%s (cache: %s)",
                 config.model, config.device, config.policy, config.kv_budget, default_cache_dir())
        if args.ray:
            return _serve_on_ray(args, config)
        if args.gil_switch_ms is not None:
            if not 0 < args.gil_switch_ms <= 1000:
                raise ConfigError(f"--gil-switch-ms must be in (0, 1000], got {args.gil_switch_ms}")
            sys.setswitchinterval(args.gil_switch_ms / 1000)
        build = build_server
        if engine_in_own_process(args.engine_process, config):
            from odma.server.engine_process import build_process_server

            build = partial(build_process_server, log_level=args.log_level)
        app, runtime = build(config, args.max_queue, args.served_model_name, generation_config=args.generation_config,
                             override_generation_config=args.override_generation_config, max_n=args.max_n)
    except OdmaError as exc:
        print(f"odma-serve: {exc}", file=sys.stderr)
        return 2
    serve(app, runtime, args.host, args.port, args.log_level.lower())
    if exit_fast:
        _exit_now(0)
    return 0


if __name__ == "__main__":
    run()
