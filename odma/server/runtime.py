"""Runs the engine's step loop in one background thread and hands each request's tokens to its asyncio
consumer. HTTP handlers only admit, submit, read and cancel; all engine state changes happen in the loop thread. A
request's own CPU work (chat template, tokenization, long answers' rendering) runs in another thread
(`Offload`), so the event loop keeps every other request's chunks and /health flowing."""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, TypeVar

from odma.engine import LLMEngine, SamplingParams
from odma.engine.sequence import RequestTags, Sequence, Status
from odma.engine.stats import EngineStats
from odma.server.admission import BehindADoor, Door, Pass
from odma.server.served_engine import Event

log = logging.getLogger(__name__)
T = TypeVar("T")
# what a request cut short by the server stopping is told (503: it may be sent again)
SHUTTING_DOWN = "the server is shutting down: this request was not finished; send it again once the server is back"


class Offload:
    """Runs requests' CPU work in one worker thread, off the event loop (the tokenizer releases the interpreter
    lock while it works). One thread, so requests are tokenized one at a time: HF's fast tokenizers are not safe
    to call from several threads at once."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="odma-request-work")

    async def __call__(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass(slots=True)
class Handle:
    """One HTTP request's engine requests (n samples) and the queue their events arrive on."""

    request_ids: list[str]
    queue: asyncio.Queue
    remaining: int = 0  # samples not finished yet

    @property
    def finished(self) -> bool:
        return self.remaining == 0


async def drain_events(handle, cancel) -> AsyncIterator[Event]:
    """The events of all the handle's samples until each finished; leaving early (client gone) calls
    `cancel(handle)`, which stops the samples still running and frees their blocks. Any handle with `queue`,
    `remaining` and `finished` (this module's Handle, the Ray ingress's RemoteHandle)."""
    try:
        while not handle.finished:
            event = await handle.queue.get()
            if event.finished:
                handle.remaining -= 1
            yield event
    finally:
        if not handle.finished:
            cancel(handle)


def step_or_fail(engine: LLMEngine) -> tuple[list, bool]:
    """One engine step's outputs, and whether it raised: then every live request fails (their outputs), since a
    scheduler bug must not hang every client."""
    try:
        return engine.step(), False
    except Exception:  # noqa: BLE001 - whatever the step raised
        log.exception("engine loop failed; failing the live requests")
        return engine.fail_all("engine loop error"), True


def _deliver(items: list[tuple[asyncio.Queue, Event]]) -> None:
    for queue, event in items:
        queue.put_nowait(event)


class AsyncEngine(BehindADoor):
    """odma-serve's `ServedRuntime` in process: the engine loop in a thread, each request's events on its queue."""

    def __init__(self, engine: LLMEngine, max_queue: int = 256) -> None:
        self.engine = engine
        # a server on an accelerator overlaps the length predictor with the device's steps; on a CPU the
        # predictor would take the cores the steps run on, so it stays in the loop there unless asked
        if engine.config.tagging == "auto" and engine.config.served_tagging == "ahead":
            engine.tag_requests_ahead()
        self.door = Door(max_queue)
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # samples holding a place at the door, until they run or end (guarded by _lock, like _queues)
        self._counted: dict[str, tuple[Sequence, Pass]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self.loop_errors = 0

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="odma-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        with self._lock:  # nothing steps any more: whatever still waits has ended
            for _, admitted in self._counted.values():
                admitted.release(1)
            self._counted.clear()

    def drain(self) -> None:
        """The server is stopping (thread-safe, from a signal handler too): every live request ends now with
        SHUTTING_DOWN (a stream's last event says so) and new ones are refused, so the server can exit at once."""
        self._closing.set()
        self._wake.set()

    @property
    def closing(self) -> bool:
        return self._closing.is_set()

    @property
    def alive(self) -> bool:
        """The engine loop thread runs (a health check)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def waiting(self) -> int:
        """Samples admitted and not running yet (tokenizing, queued, or waiting for memory)."""
        return self.door.waiting

    def admit(self, samples: int = 1) -> Pass | None:
        """Places in the queue for a request of `samples` samples, taken now (None: no room; one request always fits
        an empty queue). Hand the pass to `submit`, or release it if the request ends before that."""
        return self.door.admit(samples)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._closing.is_set():
                outputs = self.engine.cancel_all(SHUTTING_DOWN) if self.engine.has_work() else []
                self._release_started()
                self._dispatch([Event(out.token, out.finished, out.seq) for out in outputs])
                if not outputs:
                    self._wake.wait(0.05)
                    self._wake.clear()
                continue
            if not self.engine.has_work():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            outputs, failed = step_or_fail(self.engine)
            self.loop_errors += failed
            # before the events go out: a client that got its answer finds its place already given back
            self._release_started()
            self._dispatch([Event(out.token, out.finished, out.seq) for out in outputs])

    def _release_started(self) -> None:
        """Give back the places of samples that left the waiting state (running now, or ended). A preempted sample
        that waits again is not counted again: the door bounds admissions, not the engine's queue."""
        with self._lock:
            started = [sid for sid, (seq, _) in self._counted.items() if seq.status is not Status.WAITING]
            for sid in started:
                self._counted.pop(sid)[1].release(1)

    def _dispatch(self, events: list[Event]) -> None:
        # one wake-up of each event loop per step, not one per token: the loop thread and the HTTP side
        # share one interpreter lock, and per-token callbacks cost the engine a visible share of it
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Event]]] = {}
        with self._lock:
            for event in events:
                entry = self._queues.get(event.seq.request_id)
                if entry is None:
                    continue
                if event.finished:
                    del self._queues[event.seq.request_id]
                by_loop.setdefault(entry[0], []).append((entry[1], event))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that event loop is closed: its clients are gone
                pass

    def submit(self, prompt: str | list[int], params: SamplingParams, *, n: int = 1, prompt_text: str | None = None,
               tags: RequestTags | None = None, admitted: Pass | None = None) -> "Handle":
        """Queue `n` samples of a prompt. Validation errors (InvalidRequestError...) raise here, with nothing queued
        and the pass released. `admitted`: the places `admit` took; without one the samples are counted anyway."""
        admitted = admitted if admitted is not None else self.door.count(n)
        if admitted.places > n:  # a pass for more samples than queued keeps only theirs
            admitted.release(admitted.places - n)
        rid = f"req-{uuid.uuid4().hex}"
        ids = [rid] + [f"{rid}.{i}" for i in range(1, n)]  # the engine's names for the samples
        handle = Handle(ids, asyncio.Queue(), n)
        with self._lock:
            for sid in ids:
                self._queues[sid] = (asyncio.get_running_loop(), handle.queue)
        try:
            seqs = self.engine.add_samples(prompt, params, n, request_id=rid, prompt_text=prompt_text, tags=tags)
        except BaseException:
            with self._lock:
                for sid in ids:
                    self._queues.pop(sid, None)
            admitted.release()
            raise
        with self._lock:
            for seq in seqs:
                self._counted[seq.request_id] = (seq, admitted)
        # a sample the loop started (or ended) before it was counted here would otherwise keep its place
        self._release_started()
        self._wake.set()
        return handle

    def events(self, handle: "Handle") -> AsyncIterator[Event]:
        return drain_events(handle, self.cancel)

    def cancel(self, handle: "Handle") -> None:
        with self._lock:
            for sid in handle.request_ids:
                self._queues.pop(sid, None)
                counted = self._counted.pop(sid, None)
                if counted is not None:
                    counted[1].release(1)
        for sid in handle.request_ids:
            self.engine.abort(sid)
        self._wake.set()

    def finish_early(self, request_id: str) -> None:
        """A stop string matched: end the request as a normal completion (its length is realized)."""
        self.engine.abort(request_id, reason="stop")
        self._wake.set()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def close(self) -> None:
        """Stop the loop if it still runs, then close the engine (its length log, the probe's state)."""
        self.stop()
        self.engine.close()
