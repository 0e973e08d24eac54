"""`odma-bench soak`: a bounded, self-stopping load for a set time against a server it starts (odma-serve on its
defaults, `--server ray` for odma-serve --ray with two replicas, `--server vllm` for vLLM-CPU) or one given by
`--url`, checking that the server stays healthy: memory, fds and threads flat, gauges back to 0 whenever the load
pauses, nothing lost, no 5xx, latency not drifting.

The load (odma.bench.soak_load): `--concurrency` clients in a closed loop sending a mix of chat and completion
requests, streamed and not, with natural prompts and answer lengths from the traces (the realized length is the
request's max_tokens); ~10 % cut by the client mid-stream, some cancelled before their first token, a few long
prompts (`--long-prompt-tokens`), a few bad requests (expect 4xx); every `--burst-every-s` a burst of
`--burst-size` requests at once, above `--max-queue` (expect 429 with Retry-After); every `--pause-every-s` the
clients stop, the requests in flight end, and after `--pause-s` idle seconds the gauges are read (they must be 0).
With `--kill-replica-at MINUTES` (Ray) one engine replica's process is killed with SIGKILL; requests in flight at
that moment are counted apart. Every `--sample-every-s` it records the server's RSS, fds and threads (/proc), its
gauges (/metrics) and the machine's load average. Only 127.0.0.1.

Writes OUT/soak.json (series, per-minute percentiles, outcome counts, targets), OUT/requests.jsonl (one line per
request), OUT/soak.png and the started server's log; prints the targets at the end (soak_report says what each is).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

from odma.bench import soak_probe
from odma.bench.soak_load import BAD_REQUESTS, FAILURES, Planner, Prompts, send
from odma.bench.soak_report import evaluate, outcome_counts, per_minute, plot

SERVERS = ("odma", "ray", "vllm")
REPLICA_PROCESS = "ServeReplica:"  # Ray's process title of a Serve replica: ray::ServeReplica:<app>:<deployment>
ENGINE_DEPLOYMENT = "OdmaEngine"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="soak a running server at this base URL (127.0.0.1 only)")
    p.add_argument("--pid", type=int, default=None,
                   help="with --url: the server process to sample (default: the one listening on the URL's port)")
    p.add_argument("--server", default="odma", choices=SERVERS,
                   help="what to start without --url: odma-serve, odma-serve --ray (two replicas), or vLLM-CPU")
    p.add_argument("--server-args", default="", help="more flags for the started server (one string, shell-quoted)")
    p.add_argument("--peer-venv", default=os.environ.get("PEER_VENV", "/work/main/.peer-venv"),
                   help="--server vllm: the virtualenv with vllm-cpu")
    p.add_argument("--minutes", type=float, default=60.0, help="how long the load runs (fractions allowed)")
    p.add_argument("--concurrency", type=int, default=6, help="clients in the closed loop")
    p.add_argument("--think-s", type=float, default=0.2, help="mean pause of a client between its requests")
    p.add_argument("--max-queue", type=int, default=8,
                   help="the started server's --max-queue (with --url: the server's), which bursts exceed")
    p.add_argument("--burst-size", type=int, default=None, help="requests per burst (default: 3 x --max-queue)")
    p.add_argument("--burst-every-s", type=float, default=None, help="seconds between bursts (default: 2 min, or "
                   "a sixth of a shorter run)")
    p.add_argument("--pause-every-s", type=float, default=None,
                   help="seconds between load pauses (default: 3 min, or a fifth of a shorter run)")
    p.add_argument("--pause-s", type=float, default=10.0, help="idle seconds of a pause before the gauges are read")
    p.add_argument("--sample-every-s", type=float, default=10.0)
    p.add_argument("--trace", default="nq,alpaca", help="traces of natural prompts and lengths (odma.traces)")
    p.add_argument("--max-tokens-cap", type=int, default=512, help="the longest answer asked for")
    p.add_argument("--long-prompt-tokens", type=int, default=3000, help="tokens of a long-prompt request")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request before it counts as lost")
    p.add_argument("--kill-replica-at", type=float, default=None,
                   help="--server ray (or a Ray --url): SIGKILL one engine replica's process at this minute")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output folder (default: runs/soak-<time>)")


# -- the server --------------------------------------------------------------------------------------------------


def _odma_command(args, port: int, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "odma.server.cli", "--host", "127.0.0.1", "--port", str(port),
           "--max-queue", str(args.max_queue), "--length-log", str(out / "lengths.jsonl"), "--log-level", "warning"]
    if args.server == "ray":
        cmd += ["--ray", "--replicas", "2", "--threads", "1"]
    return cmd + shlex.split(args.server_args)


@contextlib.contextmanager
def _started(args, out: Path):
    """(url, pid, command) of a started server, stopped (its whole process group, then any descendant left) after."""
    import httpx

    from odma.bench import peer_servers
    from odma.server.threaded import free_port

    if args.server == "vllm":
        from odma.engine.config import parse_kv_budget
        from odma.models import resolve_model

        python = str(Path(args.peer_venv) / "bin" / "python")
        if not Path(python).exists():
            raise SystemExit(f"no {python}: --server vllm needs vllm-cpu there (scripts/peer_setup.sh)")
        # odma-serve's defaults where vLLM has the same knob: 1 GiB of KV, one compute thread, SmolLM2's context
        spec = peer_servers.ServerSpec("vllm", "vllm", resolve_model("smollm2"), parse_kv_budget("1GiB", 1 << 40),
                                       threads=1, max_model_len=8192, python=python,
                                       extra_args=tuple(shlex.split(args.server_args)))
        with peer_servers.serve(spec, out) as running:
            yield running.url, running.pid, running.command
        return
    port = free_port(below_ephemeral=True)
    cmd = _odma_command(args, port, out)
    url = f"http://127.0.0.1:{port}"
    log = open(out / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 900  # Ray starts its cluster and two replicas; a first start converts the model
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with code {proc.returncode} before it was ready: {out / 'server.log'}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"the server did not become ready within 900 s: {out / 'server.log'}")
            time.sleep(1.0)
        yield url, proc.pid, cmd
    finally:
        left = soak_probe.children(proc.pid)
        peer_servers.stop(proc)
        for pid in left:  # Ray's processes start sessions of their own: the group signal may not reach them
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        log.close()


# -- the soak ----------------------------------------------------------------------------------------------------


class Soak:
    """One run: the clients, the bursts, the pauses, the sampler and (Ray) the kill, over one event loop."""

    def __init__(self, args, url: str, pid: int | None, model: str, prompts: Prompts, gauge_names,
                 bad_requests: tuple = BAD_REQUESTS) -> None:
        self.args, self.url, self.pid, self.model = args, url, pid, model
        self.gauge_names = gauge_names
        self.duration_s = args.minutes * 60
        short = self.duration_s < 3600
        self.pause_every_s = args.pause_every_s or (min(180.0, self.duration_s / 5) if short else 180.0)
        self.burst_every_s = args.burst_every_s or (min(120.0, self.duration_s / 6) if short else 120.0)
        self.burst_size = args.burst_size or 3 * args.max_queue
        self.planner = Planner(prompts, model, args.seed, bad_requests)
        self.outcomes: list[dict] = []
        self.samples: list[dict] = []
        self.idle: list[dict] = []
        self.bursts: list[dict] = []
        self.kill: dict | None = None
        self.in_flight: dict[int, float] = {}  # request number -> start (s)
        self.killed_ids: set[int] = set()
        self._n = 0
        self.open = asyncio.Event()  # set while the clients may send
        self.open.set()
        self.t0 = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def _send(self, client, plan) -> None:
        n = self._n = self._n + 1
        self.in_flight[n] = self.now()
        try:
            o = await send(client, self.url, plan, self.t0, self.args.timeout)
        finally:
            del self.in_flight[n]
        d = o.to_json()
        if n in self.killed_ids and d["outcome"] in FAILURES:
            d["outcome_seen"], d["outcome"] = d["outcome"], "killed_in_flight"
        self.outcomes.append(d)

    async def _client(self, client, i: int) -> None:
        rng = random.Random(self.args.seed * 1000 + i)
        while self.now() < self.duration_s:
            if not self.open.is_set():
                await self.open.wait()
                continue
            await self._send(client, self.planner.next())
            await asyncio.sleep(rng.expovariate(1 / self.args.think_s) if self.args.think_s > 0 else 0)

    async def _bursts(self, client) -> None:
        at = self.burst_every_s / 2
        while at < self.duration_s:
            await asyncio.sleep(max(0.0, at - self.now()))
            await self.open.wait()
            plans = [self.planner.burst_member() for _ in range(self.burst_size)]
            self.bursts.append({"t_s": round(self.now(), 2), "size": len(plans)})
            asyncio.ensure_future(asyncio.gather(*(self._send(client, p) for p in plans)))
            at += self.burst_every_s

    async def _drain(self, limit_s: float) -> None:
        deadline = self.now() + limit_s
        while self.in_flight and self.now() < deadline:
            await asyncio.sleep(0.2)

    async def _pauses(self, client) -> None:
        at = self.pause_every_s
        while at < self.duration_s - self.args.pause_s:
            await asyncio.sleep(max(0.0, at - self.now()))
            self.open.clear()
            started = self.now()
            await self._drain(self.args.timeout)
            await asyncio.sleep(self.args.pause_s)
            self.idle.append({**await self._sample(client), "pause_started_s": round(started, 2)})
            self.open.set()
            at = max(at + self.pause_every_s, self.now() + 1)

    async def _sample(self, client) -> dict:
        s: dict = {"t_s": round(self.now(), 2), "load1": soak_probe.load_average(), "in_flight": len(self.in_flight)}
        if self.pid:
            s.update(soak_probe.process_tree(self.pid))
        try:
            r = await client.get(self.url + "/metrics", timeout=10)
            s.update(soak_probe.gauges(r.text, self.gauge_names))
        except Exception as exc:  # noqa: BLE001 - a missed scrape is recorded, the soak goes on
            s["metrics_error"] = f"{type(exc).__name__}: {exc}"[:200]
        if self.args.kill_replica_at is not None:
            s["replicas"] = len(_engine_replicas(self.pid))
        return s

    async def _sampler(self, client) -> None:
        while self.now() < self.duration_s:
            self.samples.append(await self._sample(client))
            await asyncio.sleep(self.args.sample_every_s)

    async def _killer(self, client) -> None:
        await asyncio.sleep(max(0.0, self.args.kill_replica_at * 60 - self.now()))
        # not in a pause: the kill must find requests running on the replicas, not only sent
        want = max(2, self.args.concurrency // 2)
        while self.now() < self.duration_s:
            if self.open.is_set():
                with contextlib.suppress(Exception):
                    r = await client.get(self.url + "/metrics", timeout=10)
                    if soak_probe.gauges(r.text, self.gauge_names).get("running", 0) >= want:
                        break
            await asyncio.sleep(0.25)
        replicas = _engine_replicas(self.pid)
        if not replicas:
            self.kill = {"t_s": round(self.now(), 2), "error": "no engine replica process found"}
            return
        victim = replicas[0]
        self.killed_ids = set(self.in_flight)
        os.kill(victim, signal.SIGKILL)
        self.kill = {"t_s": round(self.now(), 2), "pid": victim, "replicas_before": replicas,
                     "in_flight": len(self.killed_ids)}
        while self.now() < self.duration_s:  # until Ray has started a replacement
            now = [p for p in _engine_replicas(self.pid) if p != victim]
            if len(now) >= len(replicas):
                self.kill["replaced_after_s"] = round(self.now() - self.kill["t_s"], 2)
                self.kill["replicas_after"] = now
                return
            await asyncio.sleep(1.0)

    async def run(self) -> None:
        import httpx

        n = self.args.concurrency + self.burst_size + 8
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(limits=limits, timeout=self.args.timeout) as client:
            self.t0 = time.perf_counter()
            side = [asyncio.ensure_future(c) for c in (self._sampler(client), self._bursts(client),
                                                       self._pauses(client))]
            if self.args.kill_replica_at is not None:
                side.append(asyncio.ensure_future(self._killer(client)))
            await asyncio.gather(*(self._client(client, i) for i in range(self.args.concurrency)))
            for task in side:
                task.cancel()
            await asyncio.gather(*side, return_exceptions=True)
            self.open.set()
            await self._drain(self.args.timeout)  # bursts and clients' last requests
            await asyncio.sleep(self.args.pause_s)
            end = await self._sample(client)
            self.samples.append(end)
            self.idle.append({**end, "final": True})


def _engine_replicas(server_pid: int | None) -> list[int]:
    """The engine replicas' processes of this server (its descendants: other Ray clusters on the machine are not
    ours to kill)."""
    ours = set(soak_probe.children(server_pid)) if server_pid else set()
    return [p for p in soak_probe.matching(REPLICA_PROCESS) if p in ours and ENGINE_DEPLOYMENT in _cmdline(p)]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _served_model(url: str) -> str:
    import httpx

    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


def soak(args, url: str, pid: int | None, out: Path, server: dict) -> dict:
    """Run the load against `url`, write the outputs into `out`, return the summary (targets, outcome counts)."""
    from odma.bench.soak_probe import ODMA_GAUGES, VLLM_GAUGES

    prompts = Prompts.from_traces(args.trace, max_tokens_cap=args.max_tokens_cap,
                                  long_prompt_tokens=args.long_prompt_tokens, seed=args.seed)
    vllm = server["kind"] == "vllm"
    # vLLM has no cap on n: n=10000 would be a load of its own rather than a bad request
    bad = tuple(b for b in BAD_REQUESTS if not (vllm and b[0] == "n too large"))
    run = Soak(args, url, pid, _served_model(url), prompts, VLLM_GAUGES if vllm else ODMA_GAUGES, bad)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    asyncio.run(run.run())
    run.outcomes.sort(key=lambda o: o["start_s"])
    killed = sum(o["outcome"] == "killed_in_flight" for o in run.outcomes)
    result = {
        "started_utc": started, "duration_s": run.duration_s, "server": server, "url": url, "pid": pid,
        "command": "odma-bench soak " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if sys.argv[1:2] == ["soak"]
        else " ".join(sys.argv),
        "load": {"concurrency": args.concurrency, "think_s": args.think_s, "trace": args.trace,
                 "prompts": len(prompts.records), "max_tokens_cap": args.max_tokens_cap,
                 "long_prompt_tokens": args.long_prompt_tokens, "max_queue": args.max_queue,
                 "burst_size": run.burst_size, "burst_every_s": run.burst_every_s,
                 "pause_every_s": run.pause_every_s, "pause_s": args.pause_s, "timeout_s": args.timeout,
                 "sample_every_s": args.sample_every_s, "cores": len(os.sched_getaffinity(0))},
        "targets": evaluate(run.samples, run.idle, run.outcomes, run.duration_s, killed_in_flight=killed,
                            skip=("killed_in_flight",) if args.kill_replica_at is not None else ()),
        "outcomes": outcome_counts(run.outcomes),
        "per_minute": per_minute(run.outcomes),
        "samples": run.samples, "idle_samples": run.idle, "bursts": run.bursts, "kill": run.kill,
    }
    if run.kill:
        result["kill"]["outcomes_in_flight"] = dict(Counter(
            o.get("outcome_seen", o["outcome"]) for o in run.outcomes if o["start_s"] <= run.kill["t_s"] < o["end_s"]))
    (out / "requests.jsonl").write_text("".join(json.dumps(o) + "\n" for o in run.outcomes))
    (out / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out / "soak.png")
    return result


def _print_targets(result: dict) -> None:
    lines = [f"soak of {result['server']['kind']} for {result['duration_s'] / 60:.1f} min: "
             f"{result['outcomes']['total']} requests"]
    for name, t in result["targets"].items():
        lines.append(f"  {'PASS' if t['pass'] else 'FAIL'}  {name:24s} target {t['target']}; measured {t['measured']}")
    print("\n".join(lines), file=sys.stderr)


def run(args: argparse.Namespace) -> dict:
    out = Path(args.out or f"runs/soak-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    if args.minutes <= 0:
        raise SystemExit("odma-bench soak: --minutes must be > 0")
    if args.url:
        parsed = urlparse(args.url)
        if parsed.hostname not in ("127.0.0.1", "localhost"):
            raise SystemExit("odma-bench soak: --url must be on 127.0.0.1 (the soak samples the server's /proc)")
        url = args.url.rstrip("/")
        pid = args.pid or soak_probe.listening_pid(parsed.port or 80)
        result = soak(args, url, pid, out, {"kind": args.server, "started": False})
    else:
        with _started(args, out) as (url, pid, cmd):
            result = soak(args, url, pid, out, {"kind": args.server, "started": True, "command": cmd})
    _print_targets(result)
    return {"out": str(out), "targets": result["targets"], "outcomes": {k: v for k, v in result["outcomes"].items()
                                                                        if k not in ("reasons", "by_kind")},
            "kill": result["kill"]}
