"""KV ↔ activation ballooning for one engine (eLLM applied to a contiguous pool; pure bookkeeping, no torch).

An engine must keep room for the activation peak of its largest prefill step (A bytes, profiled per token
count). Without ballooning that room sits idle whenever no large prefill runs. Here it is lent to the KV
pool as segments (`BalloonPool.inflate`) while requests wait for KV memory, and taken back before a prefill
whose activation peak needs it (`BalloonPool.deflate`: live blocks in a segment are evacuated by contiguous
migration first). The invariant the engine relies on, checked by `check`:

    bytes lent to the KV pool + activation peak of the running prefill <= A

`keep_tokens` is the prefill size whose activation peak is never lent, so short prompts never wait for a
deflation. A prefill that cannot get its room now (segments still hold blocks that have nowhere to go)
is refused like a KV refusal; in that round nothing is lent out of the room it waits for.
"""

from __future__ import annotations

from dataclasses import dataclass

from odma.errors import ConfigError
from odma.kv.balloon import ActivationProfile, BalloonPool


@dataclass(slots=True)
class ElasticCounters:
    lends: int = 0  # segments inflated into the KV pool
    reclaims: int = 0  # segments deflated for a prefill
    reclaim_failures: int = 0  # a prefill refused because its room could not be freed yet
    peak_lent_bytes: int = 0


class ElasticKV:
    def __init__(self, balloon: BalloonPool, profile: ActivationProfile, reserve_bytes: int,
                 *, keep_tokens: int = 512) -> None:
        if reserve_bytes < 0:
            raise ConfigError(f"activation reserve must be >= 0 bytes, got {reserve_bytes}")
        if keep_tokens < 1:
            raise ConfigError(f"keep_tokens must be >= 1, got {keep_tokens}")
        self.balloon = balloon
        self.profile = profile
        self.reserve_bytes = reserve_bytes
        self.keep_bytes = min(reserve_bytes, profile.peak_bytes(keep_tokens))
        self.segment_bytes = balloon.segment_tokens * balloon.bytes_per_token
        self.counters = ElasticCounters()
        self._waiting_need = 0  # activation bytes a refused prefill is waiting for (0: none)

    @property
    def lent_bytes(self) -> int:
        return self.balloon.metrics.segment_bytes_now

    @property
    def room_bytes(self) -> int:
        """Activation bytes free now."""
        return self.reserve_bytes - self.lent_bytes

    def make_room(self, prefill_tokens: int) -> tuple[bool, int]:
        """Free the activation room a prefill step of `prefill_tokens` needs, deflating segments (their blocks
        migrate). Returns (ok, blocks moved): the caller refreshes the blocks of moved requests."""
        need = self._need(prefill_tokens)
        moved = 0
        if need > self.room_bytes:
            for result in self.balloon.deflate_bytes(need - self.room_bytes):
                moved += result.moved_blocks
                self.counters.reclaims += result.ok
        if need > self.room_bytes:
            self.counters.reclaim_failures += 1
            self._waiting_need = max(self._waiting_need, need)
            return False, moved
        return True, moved

    def prefill_room(self, planned: int, want: int) -> int:
        """Chunked prefill: how many of `want` prompt tokens a step already prefilling `planned` tokens can feed
        with the activation room free now, after giving back lent segments that hold no block (nothing
        moves; segments holding blocks stay lent). The room of `keep_tokens` is never lent, so a step with
        no other prefill always gets a chunk."""
        if want <= 0:
            return 0
        if self._need(planned + want) > self.room_bytes:
            for segment in self.balloon.segments():
                if self._need(planned + want) <= self.room_bytes:
                    break
                if not self.balloon.live_tokens_in(segment) and self.balloon.deflate(segment).ok:
                    self.counters.reclaims += 1
        lo, hi = 0, want  # the largest chunk whose activation peak fits (the peak grows with the tokens)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._need(planned + mid) <= self.room_bytes:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _need(self, prefill_tokens: int) -> int:
        # A prefill longer than the reserve was sized for (a recomputed request, or one prompt longer than
        # max_prefill_tokens) needs all of it: it runs with nothing lent, as it would without ballooning.
        return min(self.reserve_bytes, self.profile.peak_bytes(prefill_tokens)) if prefill_tokens > 0 else 0

    def begin_round(self) -> None:
        """An admission round starts: forget what the last round's refused prefills needed."""
        self._waiting_need = 0

    def lend(self, *, prefill_tokens: int = 0, max_segments: int = 4) -> int:
        """Inflate up to `max_segments` segments from idle activation room (call when requests wait for KV
        memory), keeping the room of a prefill of `prefill_tokens` (the step about to run). Returns the
        segments added."""
        added = 0
        floor = max(self.keep_bytes, self._waiting_need, self._need(prefill_tokens))
        while added < max_segments and self.room_bytes - self.segment_bytes >= floor:
            self.balloon.inflate()
            added += 1
        self.counters.lends += added
        self.counters.peak_lent_bytes = max(self.counters.peak_lent_bytes, self.lent_bytes)
        return added

    def check(self, prefill_tokens: int) -> None:
        """The invariant of a step that prefills `prefill_tokens` tokens (AssertionError if broken)."""
        peak = self._need(prefill_tokens)
        assert self.lent_bytes + peak <= self.reserve_bytes, (
            f"lent {self.lent_bytes} B + activation peak {peak} B > reserve {self.reserve_bytes} B")

    def snapshot(self) -> dict[str, int]:
        c = self.counters
        return {"reserve_bytes": self.reserve_bytes, "lent_bytes": self.lent_bytes, "lends": c.lends,
                "reclaims": c.reclaims, "reclaim_failures": c.reclaim_failures, "peak_lent_bytes": c.peak_lent_bytes,
                **{f"balloon_{k}": v for k, v in self.balloon.metrics.snapshot().items()}}
