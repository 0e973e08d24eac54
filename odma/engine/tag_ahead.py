"""Tagging ahead of the engine loop: a request's length prediction is made on a worker thread from the moment it
arrives, while the engine steps the requests already tagged; the request then enters the engine's queue with its
prediction as if made upstream. A slow text encoder (milliseconds of host time per prompt) so overlaps the model's
steps instead of stalling them.

Nothing waits on the worker without bound: a request whose tag has not come back `timeout_s` after it arrived is
handed over untagged (it reserves for the worst case, as a failed prediction does), and its late tag is dropped.
The worker is the only thread that calls the predictor (predict and observe), so a predictor that learns needs no
lock; what it learned from a finished request is applied before the next batch is predicted."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Generic, TypeVar

from predictor.base import Prediction
from predictor.serving import ServedPredictor

log = logging.getLogger(__name__)
G = TypeVar("G")  # what waits for a tag (the engine's group of samples)


class TagAhead(Generic[G]):
    """Predictions for requests as they arrive, on one worker thread, in batches of what arrived together (at most
    `max_batch`, so the first requests of a burst are tagged while the rest are still predicted).

    The caller's thread (the engine loop) collects what is ready with `ready()`; `ask`, `drop` and `learn` may be
    called from any thread."""

    def __init__(self, served: ServedPredictor, *, max_batch: int = 32, timeout_s: float = 5.0,
                 name: str = "odma-tagger") -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.served, self.max_batch, self.timeout_s = served, max_batch, timeout_s
        self._lock = threading.Condition()
        self._asked: deque[tuple[str, Any]] = deque()  # (key, predictor request) not predicted yet, in arrival order
        # (the predictor it was meant for, its request, the realized length) to observe
        self._lessons: deque[tuple[Any, Any, int]] = deque()
        self._waiting: dict[str, tuple[G, float]] = {}  # key → (what waits, deadline), in arrival order
        self._answers: dict[str, Prediction | None] = {}  # key → its tag, for keys still waiting
        self._answered = threading.Event()  # an answer came back (or the caller was poked): wake a waiting loop
        self._closed = False
        self._thread: threading.Thread | None = None
        self._name = name
        self.timeouts = 0  # requests handed over untagged because their tag came back too late
        self.batches = 0  # predictor calls made

    @property
    def waiting(self) -> int:
        """Requests whose tag has not been collected by `ready()` yet."""
        with self._lock:
            return len(self._waiting)

    def waiters(self) -> list[G]:
        """What waits for its tag now, in arrival order."""
        with self._lock:
            return [waiter for waiter, _ in self._waiting.values()]

    def ask(self, key: str, request: Any, waiter: G) -> None:
        """Predict `request` (the predictor's request type) for `waiter`, which `ready()` hands back with the tag.
        `key` must be unique among those waiting."""
        with self._lock:
            if key in self._waiting:
                raise ValueError(f"{key!r} already waits for its tag")
            self._waiting[key] = (waiter, time.monotonic() + self.timeout_s)
            if self._closed:  # nothing will predict it: it goes on untagged at once
                self._answers[key] = None
                self._answered.set()
                return
            self._asked.append((key, request))
            self._start()
            self._lock.notify()

    def drop(self, key: str) -> G | None:
        """Stop waiting for `key`'s tag (its request was cancelled): what waited, or None if nothing did."""
        with self._lock:
            self._answers.pop(key, None)
            entry = self._waiting.pop(key, None)
        return entry[0] if entry is not None else None

    def learn(self, request: Any, realized_length: int) -> None:
        """A request finished: the predictor observes it on the worker thread, before it predicts the next batch.
        A lesson for a predictor replaced meanwhile (`served.predictor` set) is dropped: it was that one's."""
        if not self.served.learns:
            return
        with self._lock:
            if self._closed:
                return
            self._lessons.append((self.served.predictor, request, realized_length))
            self._start()
            self._lock.notify()

    def ready(self, now: float | None = None) -> list[tuple[G, Prediction | None]]:
        """Everything whose tag came back, and everything whose deadline passed without one (tag None), in arrival
        order; each is handed out once."""
        now = time.monotonic() if now is None else now
        out = []
        with self._lock:
            self._answered.clear()
            for key, (waiter, deadline) in list(self._waiting.items()):
                if key in self._answers:
                    out.append((waiter, self._answers.pop(key)))
                elif deadline <= now:
                    self.timeouts += 1
                    log.warning("no length prediction for %s within %.1f s; it goes on untagged", key, self.timeout_s)
                    out.append((waiter, None))
                else:
                    continue
                del self._waiting[key]
        return out

    def wait(self, timeout: float) -> None:
        """Block until a tag comes back, `poke()` is called, the earliest deadline passes, or `timeout` seconds."""
        with self._lock:
            if not self._waiting:
                return
            earliest = min(deadline for _, deadline in self._waiting.values())
        self._answered.wait(max(0.0, min(timeout, earliest - time.monotonic())))

    def poke(self) -> None:
        """Wake a caller blocked in `wait` (a request was cancelled)."""
        self._answered.set()

    def close(self) -> None:
        """Stop the worker; whatever still waits is answered None (untagged)."""
        with self._lock:
            self._closed = True
            for key, _ in self._asked:
                self._answers.setdefault(key, None)
            self._asked.clear()
            self._lessons.clear()
            self._lock.notify_all()
            thread, self._thread = self._thread, None
        self._answered.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)

    def _start(self) -> None:  # under the lock
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._asked and not self._lessons and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                lessons = list(self._lessons)
                self._lessons.clear()
                batch = []
                while self._asked and len(batch) < self.max_batch:
                    key, request = self._asked.popleft()
                    if key in self._waiting:  # not cancelled nor handed over untagged meanwhile
                        batch.append((key, request))
            for predictor, request, realized in lessons:
                if predictor is self.served.predictor:
                    self.served.observe(request, realized)  # never raises: a refused lesson is logged and counted
            if batch:
                self._predict(batch)

    def _predict(self, batch: list[tuple[str, Any]]) -> None:
        keys = [key for key, _ in batch]
        try:
            answers = self.served.predict([request for _, request in batch], keys)
        except Exception:  # noqa: BLE001 - ServedPredictor does not raise; a bug here must not lose requests
            log.exception("length prediction failed; these %d requests go on untagged", len(batch))
            answers = [None] * len(batch)
        with self._lock:
            self.batches += 1
            for key, answer in zip(keys, answers):
                if key in self._waiting:  # not dropped (cancelled) nor handed over untagged meanwhile
                    self._answers[key] = answer
        self._answered.set()
