"""odma-serve with its engine in a process of its own (`--engine-process`): the HTTP side (uvicorn, chat templates,
tokenization, detokenization, SSE chunks) and the engine's step loop stop sharing one interpreter lock. In one
process, 64 streams cost the HTTP side ~5 ms of Python per engine step, taken from the loop that launches the
device's work; here each side has its own interpreter and its own core.

The engine process runs an `LLMEngine` and a loop that steps it and sends, once per step, every request's events
(`wire.EventEncoder`), the metrics hooks' records and, now and then, the engine's snapshot. Commands (submit,
abort, drain, stop) arrive on a pipe that a reader thread there applies at once (`add_samples` and `abort` are
thread-safe). A stop string is watched there too, so a request ends at the same token as in one process.

On the HTTP side `ProcessRuntime` is odma-serve's `ServedRuntime` and `ProcessEngine` its `ServedEngine`: limits,
checks and the tokenizer from what the engine process reported when it was ready. A dead engine process fails
every live request with an error that says so; nothing waits for it forever."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import queue
import signal
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, AsyncIterator

from odma.engine.config import EngineConfig
from odma.engine.llm_engine import check_request
from odma.engine.output_text import OutputDecoder
from odma.engine.sampling import SamplingParams
from odma.engine.sequence import RequestTags
from odma.engine.stats import EngineStats
from odma.errors import OdmaError
from odma.server.admission import Door, HandedOverDoor, Pass
from odma.server.runtime import SHUTTING_DOWN, Handle, drain_events, step_or_fail
from odma.server.served_engine import Event
from odma.server.streams import StopWatch  # imported before the engine is ready: ~0.8 s, once (not in a request)
from odma.server.wire import EventEncoder, RemoteJob, Views, sample_ids

log = logging.getLogger(__name__)

SNAPSHOT_PERIOD_S = 0.25  # how stale /metrics' engine snapshot may be while requests run
ENGINE_GONE = "the engine process exited"


class EngineProcessError(OdmaError):
    """The engine process could not start (its message is the engine's own error)."""


# -- the engine process ----------------------------------------------------------------------------------------


class _Hooks:
    """The engine's metrics hooks, recorded for the HTTP side's `Metrics` (deque: the tagging thread calls too)."""

    def __init__(self) -> None:
        self.records: deque = deque()

    def on_predict(self, seconds: float, n: int) -> None:
        self.records.append(("predict", seconds, n))

    def on_first_token(self, seq, seconds: float) -> None:
        self.records.append(("first", seconds))

    def on_finish(self, seq) -> None:
        self.records.append(("finish", seq.finish_reason, seq.num_generated, seq.first_token_at, seq.finished_at))

    def take(self) -> list:
        out = []
        while self.records:
            out.append(self.records.popleft())
        return out


@dataclass(slots=True)
class _Live:
    """One job in the engine process: its events' encoder, and its samples' stop strings."""

    encoder: EventEncoder
    stops: StopWatch
    left: int  # samples not finished yet


class EngineHost:
    """The engine process's side: owns the `LLMEngine`, steps it, and talks to the HTTP side over two pipes."""

    def __init__(self, engine, commands, events) -> None:
        self.engine, self.commands, self.events = engine, commands, events
        self.hooks: _Hooks = engine.metrics
        self.live: dict[str, _Live] = {}  # job id -> its state (its samples are job id, job id.1, ...)
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()  # the loop and the reader (a refused job's errors) both send
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.closing = threading.Event()
        self.added = 0  # samples taken in, all told (the HTTP side counts what it sent against it)
        self.last_snapshot = 0.0
        self.stale = False  # the engine changed since the last snapshot sent

    # commands, applied by the reader thread as they arrive
    def read_commands(self) -> None:
        """Apply the HTTP side's commands as they arrive, each message a list of them (what queued up together)."""
        try:
            while self._apply(self.commands.recv()):
                self.wake.set()
        except (EOFError, OSError):  # the HTTP side is gone: stop too
            pass
        self.stopping.set()
        self.wake.set()

    def _apply(self, commands: list) -> bool:
        """False once told to stop."""
        for kind, payload in commands:
            if kind == "submit":
                self._submit(payload)
            elif kind == "abort":
                for sid in payload:
                    self.engine.abort(sid)
            elif kind == "drain":
                self.closing.set()
            elif kind == "stop":
                return False
        return True

    def _submit(self, job: RemoteJob) -> None:
        with self.lock:
            self.live[job.request_id] = _Live(EventEncoder(), StopWatch(self.engine, job.params, job.n), job.n)
        try:
            self.engine.add_samples(job.prompt_ids, job.params, job.n, request_id=job.request_id,
                                    prompt_text=job.prompt_text, tags=job.tags)
        except Exception as exc:  # noqa: BLE001 - checked on the HTTP side first; whatever still fails, fails here
            with self.lock:
                self.live.pop(job.request_id, None)
            message = f"{type(exc).__name__}: {exc}"[:500]
            self._send_step([(job.request_id, (i, None, True, "error", message, 0, None, None)) for i in range(job.n)])
        finally:
            with self.lock:
                self.added += job.n

    # the step loop
    def run(self) -> None:
        while not self.stopping.is_set():
            if self.closing.is_set():
                outputs = self.engine.cancel_all(SHUTTING_DOWN) if self.engine.has_work() else []
            elif self.engine.has_work():
                outputs, _ = step_or_fail(self.engine)
            else:
                outputs = []
            idle = not self.engine.has_work()
            # the snapshot goes with the step that left the engine idle: a client that got its last token reads
            # /metrics of an engine that has freed its block
            if outputs or self.hooks.records:
                self._send_step(self._encode(outputs), snapshot=idle)
            elif self.stale and time.monotonic() - self.last_snapshot > SNAPSHOT_PERIOD_S:
                self._send_step([], snapshot=True)
            if not outputs and idle:
                self.wake.wait(0.05)
                self.wake.clear()

    def _encode(self, outputs) -> list:
        wire = []
        with self.lock:
            for out in outputs:
                seq = out.seq
                job_id = seq.request_id.split(".", 1)[0]
                live = self.live.get(job_id)
                if live is None:
                    continue
                if not out.finished and live.stops.stopped_by(seq.index, out.token):
                    self.engine.abort(seq.request_id, reason="stop")
                wire.append((job_id, live.encoder.encode(out.token, out.finished, seq)))
                if out.finished:
                    live.left -= 1
                    if live.left == 0:
                        del self.live[job_id]
        return wire

    def _send_step(self, wire: list, snapshot: bool = False) -> None:
        now = time.monotonic()
        stats = None
        if snapshot or now - self.last_snapshot > SNAPSHOT_PERIOD_S:
            stats = self.engine.stats().as_dict()
            self.last_snapshot = now
        self.stale = stats is None
        with self.lock:
            added = self.added
        try:
            with self.send_lock:
                self.events.send(("step", wire, self.hooks.take(), stats, added))
        except (BrokenPipeError, OSError):
            self.stopping.set()


def engine_main(config: EngineConfig, commands, events, log_level: str) -> None:
    """The engine process's entry: build the engine, report ready (or why not), then serve until told to stop."""
    from odma.engine import LLMEngine
    from odma.server.logs import configure_logging

    configure_logging(log_level)
    # a terminal's Ctrl-C reaches the whole process group: the HTTP side drains and then stops this process
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    hooks = _Hooks()
    try:
        engine = LLMEngine(config, metrics=hooks)
    except BaseException as exc:  # noqa: BLE001 - said to the HTTP side, which stops with this message
        events.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    if config.tagging == "auto" and config.served_tagging == "ahead":
        engine.tag_requests_ahead()
    host = EngineHost(engine, commands, events)
    events.send(("ready", {
        "tokenizer": engine.tokenizer, "vocab_size": engine.vocab_size, "eos_ids": tuple(engine.eos_ids),
        "max_model_len": engine.max_model_len, "max_request_tokens": engine.max_request_tokens,
        "model_folder": engine.model_folder, "config": engine.config, "stats": engine.stats().as_dict()}))
    reader = threading.Thread(target=host.read_commands, name="odma-engine-commands", daemon=True)
    reader.start()
    try:
        host.run()
    finally:
        engine.close()
        events.close()


# -- the HTTP side ---------------------------------------------------------------------------------------------


class ProcessEngine:
    """odma-serve's `ServedEngine` for the HTTP side: what the engine process reported, and its last snapshot."""

    def __init__(self, info: dict) -> None:
        self.config: EngineConfig = info["config"]
        self.tokenizer = info["tokenizer"]
        self.max_model_len: int = info["max_model_len"]
        self.model_folder: Path | None = info["model_folder"]
        self._vocab_size: int = info["vocab_size"]
        self._eos_ids: tuple[int, ...] = info["eos_ids"]
        self._max_request_tokens: int = info["max_request_tokens"]
        self._output_decoder = OutputDecoder(self.tokenizer, self._eos_ids)
        self.snapshot = EngineStats.from_dict(info["stats"])
        self.in_flight = 0  # samples sent and not yet taken in by the engine process

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self._eos_ids

    @property
    def max_request_tokens(self) -> int:
        return self._max_request_tokens

    @property
    def num_running(self) -> int:
        return self.snapshot.running

    @property
    def num_waiting(self) -> int:
        return self.snapshot.waiting + self.in_flight

    def validate(self, ids: list[int], params: SamplingParams) -> None:
        check_request(ids, params, vocab_size=self._vocab_size, max_tokens_cap=self.config.max_tokens_cap,
                      max_model_len=self.max_model_len, max_request_tokens=self._max_request_tokens,
                      align=self.config.pool.align)

    def decode(self, ids: list[int]) -> str:
        return self._output_decoder(ids)


@dataclass(slots=True)
class _Waiting:
    """A job on the HTTP side: its handle, the views its events update, and the event loop that reads them."""

    handle: Handle
    views: Views
    loop: asyncio.AbstractEventLoop
    left: int  # samples whose last event has not arrived (counted by the reader thread)


def _deliver(items: list[tuple[_Waiting, tuple]]) -> None:
    """On the event loop: apply each wire event to its sample's view, then queue it for the answer."""
    for waiting, event in items:
        view = waiting.views.views[event[0]]
        token, finished = view.apply(event)
        waiting.handle.queue.put_nowait(Event(token, finished, view))


class ProcessRuntime(HandedOverDoor):
    """odma-serve's `ServedRuntime` over an engine in its own process (started here; ready when this returns)."""

    def __init__(self, config: EngineConfig, metrics, max_queue: int = 256, log_level: str = "info",
                 start_timeout_s: float | None = None) -> None:
        self.metrics = metrics
        self.door = Door(max_queue)
        context = multiprocessing.get_context("spawn")  # CUDA and torch's threads do not survive a fork
        commands_out, commands_in = context.Pipe(duplex=False)
        events_out, events_in = context.Pipe(duplex=False)
        self._process = context.Process(target=engine_main, args=(config, commands_out, events_in, log_level),
                                        name="odma-engine", daemon=True)
        self._process.start()
        commands_out.close()
        events_in.close()
        self._commands, self._events = commands_in, events_out
        self.engine = ProcessEngine(self._hello(start_timeout_s))
        self._jobs: dict[str, _Waiting] = {}
        self._lock = threading.Lock()
        self._sent = 0  # samples sent to the engine process, all told
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # sends leave the event loop: a pipe can block
        self._closing = False
        self._gone = False
        self._reader = threading.Thread(target=self._read, name="odma-engine-events", daemon=True)
        self._writer = threading.Thread(target=self._write, name="odma-engine-commands", daemon=True)
        self._reader.start()
        self._writer.start()

    def _hello(self, timeout_s: float | None) -> dict:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._events.poll(0.5):
            if not self._process.is_alive():
                raise EngineProcessError(f"the engine process exited while starting (exit code "
                                         f"{self._process.exitcode})")
            if deadline is not None and time.monotonic() > deadline:
                self._process.kill()
                raise EngineProcessError(f"the engine process did not start within {timeout_s:.0f} s")
        try:
            kind, payload = self._events.recv()
        except EOFError:
            raise EngineProcessError("the engine process exited while starting") from None
        if kind == "failed":
            self._process.join(timeout=10)
            raise EngineProcessError(payload)
        return payload

    # -- the two threads that move messages ----------------------------------------------------------

    def _write(self) -> None:
        """Send what queued up together as one message: requests arriving in a burst reach the engine process in one
        hand-over of its interpreter lock, not one each (48 at once started ~0.5 s later, one by one, on a CPU)."""
        while True:
            batch = [self._outbox.get()]
            while not self._outbox.empty():
                batch.append(self._outbox.get())
            done = None in batch
            batch = [m for m in batch if m is not None]
            try:
                if batch:
                    self._commands.send(batch)
            except (BrokenPipeError, OSError):
                return  # the reader sees the process gone and fails what was live
            if done:
                return

    def _read(self) -> None:
        try:
            while True:
                kind, wire, hooks, stats, added = self._events.recv()
                if kind == "step":
                    self._apply_step(wire, hooks, stats, added)
        except (EOFError, OSError):
            pass
        self._engine_gone()

    def _apply_step(self, wire: list, hooks: list, stats: dict | None, added: int) -> None:
        for record in hooks:
            self._apply_hook(record)
        self.engine.in_flight = max(0, self._sent - added)
        if stats is not None:
            self.engine.snapshot = EngineStats.from_dict(stats)
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for job_id, event in wire:
                waiting = self._jobs.get(job_id)
                if waiting is None:
                    continue
                if event[2]:  # finished: the job ends with its last sample
                    waiting.left -= 1
                    if waiting.left == 0:
                        del self._jobs[job_id]
                by_loop.setdefault(waiting.loop, []).append((waiting, event))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that event loop is closed: its clients are gone
                pass

    def _apply_hook(self, record: tuple) -> None:
        kind = record[0]
        if kind == "predict":
            self.metrics.on_predict(record[1], record[2])
        elif kind == "first":
            self.metrics.on_first_token(None, record[1])
        elif kind == "finish":
            _, reason, generated, first_at, finished_at = record
            self.metrics.on_finish(SimpleNamespace(finish_reason=reason, num_generated=generated,
                                                   first_token_at=first_at, finished_at=finished_at))

    def _engine_gone(self) -> None:
        """Every live request fails with an error that says the engine process is gone."""
        self._gone = True
        code = self._process.exitcode
        message = ENGINE_GONE if self._closing else f"{ENGINE_GONE} (exit code {code})"
        with self._lock:
            jobs, self._jobs = list(self._jobs.values()), {}
        for waiting in jobs:
            items = [(waiting, (view.index, None, True, "error", message, view.num_generated, None, None))
                     for view in waiting.views.unfinished()]
            try:
                waiting.loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:
                pass
        if not self._closing:
            log.error("%s (exit code %s): live requests failed; new ones are refused", ENGINE_GONE, code)

    # -- lifecycle -----------------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def alive(self) -> bool:
        return not self._gone and self._process.is_alive()

    def start(self) -> None:
        """The engine process has been serving since the constructor returned."""

    def stop(self) -> None:
        """Tell the engine process to stop (it ends what is live: the stream's last event says so), then wait."""
        if self._process.is_alive():
            self._closing = True
            self._outbox.put(("drain", None))
            self._outbox.put(("stop", None))
            self._process.join(timeout=30)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(timeout=10)
        self._outbox.put(None)
        self._reader.join(timeout=10)

    def drain(self) -> None:
        """The server is stopping (thread-safe): every live request ends now with SHUTTING_DOWN, new ones are
        refused."""
        self._closing = True
        self._outbox.put(("drain", None))

    @property
    def closing(self) -> bool:
        return self._closing or self._gone

    def close(self) -> None:
        """After `stop`: the engine process closed its engine (its length log, the probe's state) as it stopped."""
        self.stop()

    # -- requests ------------------------------------------------------------------------------------

    def submit(self, prompt: str | list[int], params: SamplingParams, *, n: int = 1, prompt_text: str | None = None,
               tags: RequestTags | None = None, admitted: Pass | None = None) -> Handle:
        """Validate (InvalidRequestError... raise here, nothing sent) and send the job to the engine process. The
        door's places pass to the engine's own count of waiting samples (`engine.num_waiting`)."""
        if self.closing:
            if admitted is not None:
                admitted.release()
            raise EngineProcessError(SHUTTING_DOWN if not self._gone else ENGINE_GONE)
        ids, prompt_text = self.checked_prompt(prompt, params, prompt_text, admitted)
        rid = f"req-{uuid.uuid4().hex}"
        handle = Handle(sample_ids(rid, n), asyncio.Queue(), n)
        with self._lock:
            self._jobs[rid] = _Waiting(handle, Views(rid, n), asyncio.get_running_loop(), n)
            self._sent += n
            self.engine.in_flight += n
        self._outbox.put(("submit", RemoteJob(rid, ids, params, n, prompt_text, tags, created_at=time.time())))
        return handle

    def events(self, handle: Handle) -> AsyncIterator[Event]:
        return drain_events(handle, self.cancel)

    def cancel(self, handle: Handle) -> None:
        with self._lock:
            self._jobs.pop(handle.request_ids[0], None)
        self._outbox.put(("abort", list(handle.request_ids)))

    def finish_early(self, request_id: str) -> None:
        """Nothing to do: the engine process ends the request at the same token (it watches the stop strings)."""

    def stats(self) -> EngineStats:
        """The engine process's last snapshot (at most SNAPSHOT_PERIOD_S old while requests run; sent again as
        requests finish)."""
        return self.engine.snapshot


def build_process_server(config: EngineConfig, max_queue: int, served_name: str | None, *, generation_config: str,
                         override_generation_config: str | None, max_n: int, log_level: str) -> tuple[Any, Any]:
    """(app, runtime) as `cli.build_server` makes them, with the engine in its own process."""
    from odma.models.weights import model_name
    from odma.server.app import create_app
    from odma.server.generation_config import engine_sampling_defaults
    from odma.server.metrics import Metrics

    metrics = Metrics()
    runtime = ProcessRuntime(config, metrics, max_queue=max_queue, log_level=log_level)
    try:
        defaults = engine_sampling_defaults(runtime.engine, generation_config, override_generation_config)
    except BaseException:
        runtime.close()
        raise
    log.info("engine process %s ready; sampling defaults: %s", runtime.pid,
             defaults.describe(config.default_max_tokens))
    metrics.attach(runtime)
    name = served_name or model_name(config.model)
    app = create_app(runtime, metrics, name, aliases=(config.model, "default"), defaults=defaults, max_n=max_n)
    return app, runtime
