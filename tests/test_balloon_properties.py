"""Random workloads with ballooning: reserve / extend (by migration or in place) / release interleaved with
inflate / deflate and clearing a window for a large request, on a real CPU segmented arena. After every
step: no overlap, every unit accounted for (bytes conserved), nobody lost, and every live request's KV bytes
intact, also across evacuations, rollbacks and in-place growth."""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from backends import CPUBackend, KVLayout
from odma.kv import BalloonPool, BucketManager, BucketPolicy, KVPool, KVRequest, StaticPolicy
from odma.kv.reclaim import clear_window
from odma.errors import RequestTooLargeError

EXAMPLES = int(os.environ.get("ODMA_BALLOON_EXAMPLES", "150"))
LAYOUT = KVLayout(layers=1, kv_heads=1, head_dim=1)
MAX_NEW = 64
SEEN: dict[str, int] = {}


class BalloonMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool: KVPool | None = None
        self.balloon: BalloonPool | None = None
        self.lengths: dict[str, int] = {}
        self.next_id = 0

    @precondition(lambda self: self.pool is None)
    @rule(total=st.integers(64, 512), bucketed=st.booleans(), segment=st.sampled_from([64, 128, 256]),
          large_share=st.sampled_from([0.0, 0.2]), worst_case_prompt_share=st.sampled_from([1.0, 0.5]))
    def setup(self, total, bucketed, segment, large_share, worst_case_prompt_share):
        policy = BucketPolicy(BucketManager.fixed((16, 32), MAX_NEW)) if bucketed else StaticPolicy()
        self.pool = KVPool(total, policy, large_share=large_share, align=8, free_list_limit=4,
                           bytes_per_token=LAYOUT.bytes_per_token, worst_case_prompt_share=worst_case_prompt_share)
        backend = CPUBackend()
        base = backend.create_arena(self.pool.total_tokens, LAYOUT)
        self.balloon = BalloonPool(self.pool, segment, backend=backend, base_arena=base, layout=LAYOUT)

    @staticmethod
    def _values(rid: str, start: int, end: int) -> torch.Tensor:
        return torch.arange(start, end, dtype=LAYOUT.dtype) + float(int(rid[1:]) * 1000) + 1.0

    def _write(self, rid, start, end):
        self.balloon.arena.view(self.pool.block_of(rid))[:, :, start:end] = self._values(rid, start, end).view(1, 1, -1, 1, 1)

    def _verify(self, rid):
        n = self.lengths[rid]
        got = self.balloon.arena.view(self.pool.block_of(rid))[:, :, :n]
        assert torch.equal(got, self._values(rid, 0, n).view(1, 1, n, 1, 1).expand_as(got)), f"{rid} corrupted"

    @precondition(lambda self: self.pool is not None)
    @rule(prompt=st.integers(1, 60), predicted=st.one_of(st.none(), st.floats(0, 80)))
    def reserve(self, prompt, predicted):
        rid = f"r{self.next_id}"
        self.next_id += 1
        try:
            block = self.pool.reserve(KVRequest(rid, prompt, MAX_NEW, predicted))
        except RequestTooLargeError:
            return
        if block is not None:
            self.lengths[rid] = prompt
            self._write(rid, 0, prompt)

    @precondition(lambda self: self.pool is not None and self.lengths)
    @rule(data=st.data(), grow=st.integers(1, 40))
    def extend(self, data, grow):
        rid = data.draw(st.sampled_from(sorted(self.lengths)))
        limit = self.pool._live[rid].request.prompt_tokens + MAX_NEW
        new_len = min(self.lengths[rid] + grow, limit)
        in_place = self.pool.stats().grown_in_place
        if self.pool.extend(rid, new_len) is not None:
            if self.pool.stats().grown_in_place > in_place:
                SEEN["grown_in_place"] = SEEN.get("grown_in_place", 0) + 1
            self._verify(rid)
            self._write(rid, self.lengths[rid], new_len)
            self.lengths[rid] = new_len

    @precondition(lambda self: self.pool is not None and self.lengths)
    @rule(data=st.data())
    def release(self, data):
        rid = data.draw(st.sampled_from(sorted(self.lengths)))
        self._verify(rid)
        self.pool.release(rid, 0)
        del self.lengths[rid]

    @precondition(lambda self: self.pool is not None and len(self.balloon.segments()) < 4)
    @rule()
    def inflate(self):
        self.balloon.inflate()
        SEEN["inflate"] = SEEN.get("inflate", 0) + 1

    @precondition(lambda self: self.pool is not None and self.balloon.segments())
    @rule(data=st.data())
    def deflate(self, data):
        seg = data.draw(st.sampled_from(self.balloon.segments()))
        result = self.balloon.deflate(seg)
        key = "deflate_ok_moved" if result.ok and result.moved_blocks else "deflate_ok" if result.ok else "rollback"
        SEEN[key] = SEEN.get(key, 0) + 1
        assert result.ok == (seg not in self.balloon.segments())
        for rid in self.lengths:
            self._verify(rid)

    @precondition(lambda self: self.pool is not None and self.lengths)
    @rule(prompt=st.integers(16, 400))
    def clear_window(self, prompt):
        req = KVRequest(f"r{self.next_id}", prompt, MAX_NEW)
        self.next_id += 1
        moved, cleared = clear_window(self.pool, req)
        for rid in self.lengths:
            self._verify(rid)
        if cleared:  # the range is free now: the reserve that follows gets it
            assert self.pool.reserve(req) is not None
            self.lengths[req.request_id] = prompt
            self._write(req.request_id, 0, prompt)
            SEEN["window_cleared" if moved else "window_free"] = SEEN.get("window_cleared" if moved else "window_free", 0) + 1
        elif moved:
            SEEN["window_partial"] = SEEN.get("window_partial", 0) + 1

    @invariant()
    def consistent(self):
        if self.pool is None:
            return
        self.pool.check_invariants()  # no overlap, every unit free / cached / live / withheld, exactly once
        assert set(self.pool.live_requests()) == set(self.lengths)  # nothing lost
        segs = self.balloon.segments()
        assert self.pool.capacity_tokens == self.pool.total_tokens + sum(s.tokens for s in segs)
        assert [b for b, _ in self.balloon.arena.segments()] == [0] + [s.offset for s in segs]
        m = self.balloon.metrics
        assert m.segment_bytes_now == sum(s.tokens for s in segs) * LAYOUT.bytes_per_token
        assert m.inflated_bytes - m.deflated_bytes == m.segment_bytes_now
        assert not self.balloon.draining  # every deflate finished or rolled back (check_invariants: nothing withheld outside a fence)

    def teardown(self):
        if self.pool is None:
            return
        for rid in list(self.lengths):
            self.pool.release(rid, 0)
        while self.balloon.segments():
            assert self.balloon.deflate().ok  # an empty pool always deflates
        self.pool.check_invariants()
        assert self.pool.stats().free_tokens == self.pool.total_tokens


BalloonMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=30, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestBalloonProperties = BalloonMachine.TestCase


def test_random_workloads_reached_every_path():
    if not SEEN:
        import pytest

        pytest.skip("run together with TestBalloonProperties")
    for key in ("inflate", "deflate_ok_moved", "rollback", "grown_in_place", "window_cleared"):
        assert SEEN.get(key, 0) > 0, f"no {key} in the random workloads: {SEEN}"
