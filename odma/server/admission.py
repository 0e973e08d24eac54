"""The door: how many samples were admitted and do not run yet, bounded by `--max-queue`. The check and the count
are one step under a lock, so requests that arrive together cannot all see room for one: the place is taken when
the request is admitted, before its prompt is tokenized, and given back once per sample, when the sample starts
running or ends (finished, cancelled, refused by validation, the server stopping)."""

from __future__ import annotations

import threading
from typing import Any

# A place frees when a waiting request starts running: within a few engine steps while requests finish (tens of
# milliseconds to about a second). One second lets a client that honours the header come back soon without
# spinning; a real estimate would need the running requests' remaining lengths, which only the predictor guesses.
RETRY_AFTER_S = 1


def busy_message(max_queue: int) -> str:
    return (f"server busy: the queue holds at most {max_queue} waiting requests (samples; --max-queue) and has no "
            f"room for this one; retry after {RETRY_AFTER_S} s")


class Door:
    """Counts admitted samples that are not running yet. `admit` takes places, `Pass.release` gives them back."""

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self._waiting = 0
        self._lock = threading.Lock()

    @property
    def waiting(self) -> int:
        return self._waiting

    def admit(self, samples: int, *, also_waiting: int = 0) -> Pass | None:
        """A pass holding `samples` places, or None when the queue has no room for them. `also_waiting`: samples
        waiting that this door does not count (the Ray ingress's estimate of the replicas' queues). A request
        always fits an empty queue (unless max_queue is 0), however many samples it has."""
        with self._lock:
            waiting = self._waiting + also_waiting
            if not (waiting == 0 and self.max_queue > 0 or waiting + samples <= self.max_queue):
                return None
            self._waiting += samples
            return Pass(self, samples)

    def count(self, samples: int) -> Pass:
        """A pass for samples that did not ask (a replica's jobs, admitted by its ingress): counted, never refused."""
        with self._lock:
            self._waiting += samples
            return Pass(self, samples)

    def _split(self, held: Pass, places: int) -> Pass:
        with self._lock:
            k = max(0, min(places, held.places))
            held.places -= k
            return Pass(self, k)

    def _release(self, held: Pass, samples: int | None) -> None:
        with self._lock:
            k = held.places if samples is None else max(0, min(samples, held.places))
            held.places -= k
            self._waiting -= k


class Pass:
    """One request's places at the door. Releasing more than it holds releases what is left: each place once."""

    def __init__(self, door: Door, places: int) -> None:
        self._door, self.places = door, places

    def release(self, samples: int | None = None) -> None:
        """Give back `samples` places (None: all that are left)."""
        self._door._release(self, samples)

    def split(self, places: int) -> Pass:
        """A pass of its own for `places` of these (at most what is left), taken from this one: a request of several
        prompts hands each its share."""
        return self._door._split(self, places)


class BehindADoor:
    """A runtime's `max_queue`: its door's bound (settable, as the tests and operators do)."""

    door: Door

    @property
    def max_queue(self) -> int:
        return self.door.max_queue

    @max_queue.setter
    def max_queue(self, value: int) -> None:
        self.door.max_queue = value


class HandedOverDoor(BehindADoor):
    """The door of a runtime whose engine counts its waiting samples elsewhere (an engine process, Ray replicas):
    a request holds its places while it is tokenized here, and `checked_prompt` hands them over to the engine's
    count (`engine.num_waiting`) once the prompt passed the checks. Needs `door` and `engine` (a ServedEngine)."""

    engine: Any

    @property
    def waiting(self) -> int:
        """Samples admitted and not running yet: being tokenized here, and those the engine counts."""
        return self.engine.num_waiting + self.door.waiting

    def admit(self, samples: int = 1) -> Pass | None:
        """Places for a request of `samples` samples, taken now (None: no room)."""
        return self.door.admit(samples, also_waiting=self.engine.num_waiting)

    def checked_prompt(self, prompt, params, prompt_text: str | None,
                       admitted: Pass | None) -> tuple[list[int], str | None]:
        """(token ids, prompt text) of a prompt that passed the engine's checks (InvalidRequestError... raise here);
        either way the pass is given back, as the caller's count takes the samples over."""
        try:
            tokenizer = self.engine.tokenizer
            ids = tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else list(prompt)
            if isinstance(prompt, str) and prompt_text is None:
                prompt_text = prompt
            self.engine.validate(ids, params)
        finally:
            if admitted is not None:
                admitted.release()
        return ids, prompt_text
