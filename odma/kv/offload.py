"""The CPU KV buffer of eLLM §4.3.2 as a pure controller (no torch): accounting and the buffer's size.

A preempted request's KV goes to a host buffer and comes back when it is admitted again (the engine's swap
preemption, `odma.engine.swap`). eLLM Algorithm 1's admission threshold θ is the scheduler's
`admission_theta` (a new request is admitted while reservations stay within θ of the pool; its
offload-to-admit branch is what swap preemption does on the growth path).
- Logical buffer scaling (eLLM Algorithm 2, SLO-aware): over a sliding window of the last `window`
  iterations, `violations` TPOT violations shrink the logical buffer by factor α (fetches slow decode),
  `violations` TTFT violations grow it by α (offloading lets prefills in sooner); the window restarts
  after every change. Both at once cancel (no change). A shrink below the bytes in use only stops new
  offloads; nothing is fetched early.
The engine does the copies (backends: `offload` / `fetch`) and reports them with `record_offload` /
`record_fetch`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from odma.errors import ConfigError, InvalidRequestError, UnknownRequestError


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    capacity_bytes: int  # physical host buffer: the logical size never exceeds it
    initial_bytes: int | None = None  # starting logical size (default: capacity)
    min_bytes: int = 0
    alpha: float = 0.2  # scale factor: shrink to size·(1-α), grow to size·(1+α)
    window: int = 5  # iterations watched
    violations: int = 3  # violations within the window that trigger a scaling step

    def __post_init__(self) -> None:
        if self.capacity_bytes < 0 or not 0 <= self.min_bytes <= self.capacity_bytes:
            raise ConfigError(f"need 0 <= min_bytes <= capacity_bytes, got {self.min_bytes}, {self.capacity_bytes}")
        if self.initial_bytes is not None and not self.min_bytes <= self.initial_bytes <= self.capacity_bytes:
            raise ConfigError(f"initial_bytes must lie in [min_bytes, capacity_bytes], got {self.initial_bytes}")
        if not 0 < self.alpha < 1:
            raise ConfigError(f"alpha must be in (0, 1), got {self.alpha}")
        if self.window < 1 or not 1 <= self.violations <= self.window:
            raise ConfigError(f"need 1 <= violations <= window, got {self.violations}, {self.window}")


@dataclass(slots=True)
class OffloadMetrics:
    offloads: int = 0
    fetches: int = 0
    offloaded_bytes: int = 0
    fetched_bytes: int = 0
    buffer_grows: int = 0
    buffer_shrinks: int = 0
    buffer_size: list[tuple[int, int]] = field(default_factory=list)  # (iteration, logical bytes) per change


class OffloadController:
    def __init__(self, config: OffloadConfig) -> None:
        self.config = config
        self.logical_bytes = config.capacity_bytes if config.initial_bytes is None else config.initial_bytes
        self.metrics = OffloadMetrics()
        self.metrics.buffer_size.append((0, self.logical_bytes))
        self.iteration = 0
        self._host: dict[str, int] = {}  # request → bytes held in the host buffer
        self._ttft: deque[bool] = deque(maxlen=config.window)
        self._tpot: deque[bool] = deque(maxlen=config.window)

    @property
    def used_bytes(self) -> int:
        return sum(self._host.values())

    @property
    def free_bytes(self) -> int:
        return max(0, self.logical_bytes - self.used_bytes)

    def offloaded(self) -> dict[str, int]:
        return dict(self._host)

    def record_offload(self, request_id: str, nbytes: int) -> None:
        if request_id in self._host:
            raise InvalidRequestError(f"request {request_id} is already offloaded")
        if nbytes < 0 or nbytes > self.free_bytes:
            raise InvalidRequestError(f"cannot offload {nbytes} bytes: the buffer has {self.free_bytes} free")
        self._host[request_id] = nbytes
        self.metrics.offloads += 1
        self.metrics.offloaded_bytes += nbytes

    def record_fetch(self, request_id: str) -> int:
        nbytes = self._lookup(request_id)
        del self._host[request_id]
        self.metrics.fetches += 1
        self.metrics.fetched_bytes += nbytes
        return nbytes

    def discard(self, request_id: str) -> int:
        """Forget a request's host KV without fetching it (the request ended while offloaded)."""
        self._lookup(request_id)
        return self._host.pop(request_id)

    def _lookup(self, request_id: str) -> int:
        if request_id not in self._host:
            raise UnknownRequestError(f"request {request_id!r} has no KV in the host buffer")
        return self._host[request_id]

    # -- Algorithm 2: SLO-aware logical buffer scaling -------------------------------------------------

    def end_iteration(self, ttft_violated: bool, tpot_violated: bool) -> int:
        """Record one engine iteration's SLO outcome; returns the (possibly rescaled) logical size."""
        self.iteration += 1
        self._ttft.append(bool(ttft_violated))
        self._tpot.append(bool(tpot_violated))
        c = self.config
        shrink = sum(self._tpot) >= c.violations
        grow = sum(self._ttft) >= c.violations
        if shrink != grow:
            if shrink:
                new = int(self.logical_bytes * (1 - c.alpha))
            else:  # from an empty buffer the first step is α·capacity (a product with 0 would stay 0)
                new = max(int(self.logical_bytes * (1 + c.alpha)), int(c.alpha * c.capacity_bytes))
            new = min(c.capacity_bytes, max(c.min_bytes, new))
            if new != self.logical_bytes:
                self.logical_bytes = new
                if shrink:
                    self.metrics.buffer_shrinks += 1
                else:
                    self.metrics.buffer_grows += 1
                self.metrics.buffer_size.append((self.iteration, new))
            self._ttft.clear()
            self._tpot.clear()
        return self.logical_bytes
