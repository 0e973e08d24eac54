"""Which requests run this step: decode all running ones (growing or migrating their blocks), then admit
waiting ones whose memory can be reserved. Pure bookkeeping; memory is asked through `odma.kv.KVManager`
(admit / grow / release / evict / make_way), whose handles stay current when blocks move. No tensors."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Protocol

from odma.engine.admission import first_refusal
from odma.engine.ordering import make_order
from odma.engine.prefill_cost import PLAIN_TOKENS
from odma.engine.prefix_share import PrefixIndex
from odma.engine.scheduler_config import SchedulerConfig
from odma.engine.sequence import Sequence, Status, Work
from odma.errors import ConfigError
from odma.kv import KVHandle, KVManager

HOLD_STEP_TOKENS = 256  # a request waits for a shared prefix only behind a step that prefills at most this many tokens


class Swapper(Protocol):
    """Moves a preempted request's cached K/V to the host and back (the engine's `HostSwap`)."""

    def swap_out(self, seq: Sequence) -> bool:
        """Copy the first seq.num_cached tokens of seq.block to the host; False = no host room."""

    def swap_in(self, seq: Sequence) -> None:
        """Copy them back into seq.block (just reserved) and drop the host copy."""

    def drop(self, seq: Sequence) -> None:
        """Forget the host copy (the request ended while swapped out)."""


@dataclass(slots=True)
class SchedulerCounters:
    preemptions: int = 0  # requests whose block was released (their K/V swapped out, or recomputed later)
    swap_outs: int = 0  # preemptions whose K/V went to the host buffer
    swap_ins: int = 0
    stalls: int = 0  # request-steps spent waiting for room to grow (wait mode)
    migrations: int = 0  # blocks moved to a larger range mid-decode
    admission_refusals: int = 0  # reserve() said no room now; the request stays queued
    theta_refusals: int = 0  # admitting would have pushed reservations past θ of the pool (eLLM Algorithm 1)
    demand_refusals: int = 0  # admitting would have pushed the predicted final KV of the running set past the pool
    activation_refusals: int = 0  # ballooning: the prefill's activation room could not be freed yet
    bucket_matched_admissions: int = 0  # admitted ahead of FIFO order into a just-freed bucket
    prefill_chunks: int = 0  # prefill steps that fed part of a prompt (ballooning: the rest of its room was lent)
    window_clears: int = 0  # a held queue head got its range by relocating the blocks in it
    window_moves: int = 0  # blocks relocated for it
    prefix_copies: int = 0  # admissions that copied a shared prompt prefix's K/V instead of computing it
    prefix_maps: int = 0  # admissions that mapped a running request's pages of a shared prefix (paged)
    prefix_tokens: int = 0  # prompt tokens those copies saved
    prefix_holds: int = 0  # admissions put off one step to copy a prefix that a request prefilled in that step


class Scheduler:
    """Plans each step over `kv` by the policy in `config`; `swapper` holds preempted requests' K/V on the host
    (needed by preempt="swap")."""

    def __init__(self, kv: KVManager, config: SchedulerConfig, swapper: Swapper | None = None) -> None:
        if config.preempt == "swap" and swapper is None:
            raise ConfigError("preempt='swap' needs a swapper (the engine's host buffer)")
        self.kv = kv
        self.config = config
        # the order of service (odma.engine.ordering): fcfs, or shortest predicted remaining first with aging
        # (adaptive: only while more wait than can run)
        self.order = make_order(config.order, lookahead=config.lookahead, max_skips=config.max_skips,
                                aging_rounds=config.aging_rounds, depth=config.max_num_seqs)
        self.elastic = kv.elastic  # KV ↔ activation ballooning (None: the activation reserve is never lent)
        self.swapper = swapper
        # rules beyond memory, budget and the running cap (odma.engine.admission), all of which must agree
        self.admission = config.admission_rules()
        # Chunked prefill: a step prefills at most max_prefill_tokens of prompts beside its decodes, so a long
        # prompt takes several steps and never freezes the running streams; with ballooning a chunk is also
        # bounded by the free activation room (instead of waiting until the segments holding blocks drain).
        # Off: a prompt is fed whole in one step, and one longer than the budget passes alone.
        # Chunked, the budget counts a chunk's attention over the context before it too (odma.engine.prefill_cost):
        # a late chunk of a long prompt gets fewer tokens, so no step of it runs much longer than the first
        self.prefill_cost = config.prefill_cost if config.chunk_prefills else PLAIN_TOKENS
        # A head that holds the queue but finds no contiguous range gets one: the range with the fewest live
        # tokens is fenced and its blocks relocated (into lent segments, say), instead of waiting for them.
        # Not with ballooning that reclaims lent room for whole prefills: the reclaim would move the cleared
        # blocks straight back out of the segments (measured: segments lent and taken back every step).
        self.clear_window = config.clear_window and (self.elastic is None or config.chunk_prefills)
        # Shared prompt prefixes (odma.engine.prefix_share): copied from a running request that holds them; None: off
        self.prefixes = PrefixIndex(config.prefix_min_tokens) if config.prefix_min_tokens else None
        # pages are mapped into the request's table instead (PagedKV.admit_sharing): whole pages only, no copy
        self.maps_prefixes = getattr(kv, "shares_pages", False)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.counters = SchedulerCounters()
        self._freed_buckets: Counter[int] = Counter()  # buckets released since the last admission round

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ----------------------------------------------------------------------------------

    def schedule(self) -> list[Work]:
        refusals = self.counters.admission_refusals
        work, stalled = self._grow_running()
        if not stalled:  # requests waiting to grow come first: admitting others would starve them
            prefills = [w for w in work if w.q_len > 1]
            work += self._admit(sum(w.q_len for w in prefills), sum(self.prefill_cost(w.start, w.q_len) for w in prefills))
        elif not work:  # everyone is stuck and nobody finishes: free a block to make progress
            self._preempt(self.order.victim(self.running))
            work, _ = self._grow_running()
        if self.elastic is not None and (stalled or self.counters.admission_refusals > refusals):
            # short of KV: borrow idle activation room for the next step, never what this step's prefill or
            # the next waiting prefill needs (lending it would only be taken back at once)
            step_prefill = sum(w.q_len for w in work if w.q_len > 1)
            head = 0
            first = self.order.head(self.waiting)
            if first is not None and self.kv.can_admit(first):
                # a head that cannot get its KV block yet is not about to prefill: its room may be lent now
                # and is taken back (blocks migrate out) once its block fits
                head = first.num_tokens - first.num_cached
            self.elastic.lend(prefill_tokens=max(step_prefill, head))
        return work

    def _grow_running(self) -> tuple[list[Work], list[Sequence]]:
        work: list[Work] = []
        stalled: list[Sequence] = []
        prefill, spent = 0, 0.0  # prompt tokens fed in this step, and their cost of the step's budget
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            while True:
                growth = self.kv.grow(seq.request_id, seq.num_tokens)
                if growth is not None:
                    if growth.moved:  # a block grown in place keeps its offset
                        seq.migrations += 1
                        self.counters.migrations += 1
                    q_len = seq.num_tokens - seq.num_cached
                    if q_len > 1:  # the rest of a chunked prefill
                        q_len = self._prefill_chunk(prefill, seq.num_cached, q_len, self.config.max_prefill_tokens - spent)
                        prefill += q_len
                        spent += self.prefill_cost(seq.num_cached, q_len)
                        self.counters.prefill_chunks += q_len > 0
                    if q_len:
                        work.append(Work(seq, seq.num_cached, q_len))
                    break
                if self.config.preempt == "wait":
                    self.counters.stalls += 1
                    stalled.append(seq)
                    break
                victim = self.order.victim(self.running)  # fcfs: the newest, which loses least work
                self._preempt(victim)
                # sjf may pick a request planned earlier in this loop (fcfs's newest never is): it has no block now
                planned = next((i for i, w in enumerate(work) if w.seq is victim), None)
                if planned is not None:
                    dropped = work.pop(planned)
                    if dropped.q_len > 1:
                        prefill -= dropped.q_len
                        spent -= self.prefill_cost(dropped.start, dropped.q_len)
                if victim is seq:
                    break
        return work, stalled

    def _preempt(self, seq: Sequence) -> None:
        # swap mode: keep the cached K/V in the host buffer (a copy) instead of recomputing it; when the
        # buffer is full the request is recomputed as in recompute mode
        swapped = self.config.preempt == "swap" and seq.num_cached > 0 and self.swapper.swap_out(seq)
        kept = seq.num_cached if swapped else 0
        self.kv.evict(seq.request_id)
        self.running.remove(seq)
        if self.prefixes is not None:
            self.prefixes.remove(seq)
        seq.reset_for_recompute(kept)
        self.waiting.appendleft(seq)  # first in line when room appears
        self.counters.preemptions += 1
        self.counters.swap_outs += swapped

    def _admit(self, prefill: int = 0, spent: float = 0.0) -> list[Work]:
        """Admit waiting requests into this step, which already prefills `prefill` tokens of running ones at a
        cost of `spent` of its budget."""
        work: list[Work] = []
        budget = self.config.max_prefill_tokens - spent
        if self.clear_window:
            self._clear_way()
        candidates = self.order.candidates(self.waiting, self._freed_buckets)
        for rule in self.admission:
            rule.begin_round(self.running, self.kv)
        if self.elastic is not None:
            self.elastic.begin_round()
        for seq in candidates:
            if len(self.running) >= self.config.max_num_seqs:
                break
            source, shared = self._prefix_source(seq)
            need = seq.num_tokens - seq.num_cached - shared
            if need > 1 and (budget <= 0 if self.config.chunk_prefills else (work and need > budget)):
                continue  # no prefill budget left in this step (chunked: it starts with a later step's)
            if source is None and self._hold_for_prefix(seq, work, prefill):
                continue
            start = seq.num_cached + shared
            q_len = self._room_for(seq, start, need, prefill, budget)
            if 0 < q_len < need and prefill and self._scored_whole(seq, start, need):
                continue  # fed whole by a later step
            mapped = source is not None and self.maps_prefixes  # whole pages of the holder's, not a copy
            handle = None
            if q_len:
                handle = self.kv.admit_sharing(seq, source.request_id, shared) if mapped else self.kv.admit(seq)
            if handle is None:
                self.counters.admission_refusals += q_len > 0
                if self._head_holds(seq):
                    break  # the head has waited long enough: nobody overtakes it, memory is held for it
                continue
            self._start(seq, handle)
            for rule in self.admission:
                rule.admitted(seq)
            if mapped:
                seq.num_cached = shared  # its first pages are the holder's: nothing to copy or compute
            work.append(Work(seq, start, q_len, None if mapped else source))
            self.counters.prefix_copies += source is not None and not mapped
            self.counters.prefix_maps += mapped
            self.counters.prefix_tokens += shared
            self.counters.prefill_chunks += q_len < need
            budget -= self.prefill_cost(start, q_len) if q_len > 1 else q_len
            prefill += q_len
            if budget <= 0:
                break
        for seq in self.waiting:
            seq.waited_steps += 1
        self._freed_buckets.clear()
        return work

    def _may_copy_prefix(self, seq: Sequence) -> bool:
        """Not a request that has K/V already (swapped in), that scores its prompt (echo: every prompt position
        must be computed), or a sample of n > 1 that copies its sibling's whole prompt (odma.engine.fork)."""
        return (self.prefixes is not None and not seq.num_cached and seq.params.prompt_logprobs is None
                and not (seq.index and not seq.prompt_copied))

    def _prefix_source(self, seq: Sequence) -> tuple[Sequence | None, int]:
        """(holder, tokens): a running request whose cached K/V `seq` may copy (or map: whole pages) for its first
        tokens."""
        if not self._may_copy_prefix(seq):
            return None, 0
        holder, shared = self.prefixes.lookup(seq)
        if holder is not None and self.maps_prefixes:
            shared = self.kv.shareable_tokens(shared)
            if shared < self.prefixes.min_tokens:
                return None, 0
        return holder, shared

    def _hold_for_prefix(self, seq: Sequence, planned: list[Work], step_prefill: int) -> bool:
        """Put `seq` off one step when a request prefilled in this step shares at least a quarter of what it
        would compute: next step it copies that prefix instead (a burst of chat requests computes the system
        prompt once, not once per request). Only while this step prefills at most HOLD_STEP_TOKENS (the wait is
        one step: a short one, not a long prompt's), never a request that has waited max_skips rounds already."""
        if (not planned or not self._may_copy_prefix(seq) or seq.waited_steps >= self.config.max_skips
                or step_prefill > HOLD_STEP_TOKENS):
            return False
        shared = self.prefixes.shared_with(seq, [w.seq for w in planned if w.start + w.q_len >= self.prefixes.min_tokens])
        if shared and 4 * shared >= seq.num_tokens:
            self.counters.prefix_holds += 1
            return True
        return False

    def _scored_whole(self, seq: Sequence, start: int, need: int) -> bool:
        """Whether `seq` scores its prompt (echo with logprobs, as evaluation harnesses ask) and fits one step's
        budget: then it is not split behind other prompts but waits for a step that feeds it whole, as it would be
        fed alone. A split's second part attends to the cached rows by another path, whose last-bit differences int8
        activations magnify (up to 0.45 nats on ~21-token prompts), so its scores would depend on the batch."""
        return (seq.params.prompt_logprobs is not None and self.config.chunk_prefills
                and self.prefill_cost(start, need) <= self.config.max_prefill_tokens)

    def _room_for(self, seq: Sequence, start: int, need: int, prefill: int, budget: float) -> int:
        """How many of the `need` tokens from `start` that `seq` may feed in this step, which already prefills `prefill` tokens, before
        its memory is asked for; 0 = refused now (the refusal counted): no KV block for it yet while ballooning
        (no segment is deflated for a prefill that could not start anyway), no activation room, or an admission
        rule said no."""
        if self.elastic is not None and need > 1 and not self.kv.can_admit(seq):
            self.counters.admission_refusals += 1
            return 0
        q_len = need
        if self.config.chunk_prefills and need > 1:
            q_len = self._prefill_chunk(prefill, start, need, budget)
            if not q_len:  # no activation room left in this step (or no prefill budget)
                self.counters.activation_refusals += budget > 0 and self.elastic is not None
                return 0
        elif self.elastic is not None and not self._activation_room(prefill + need):
            return 0
        refusal = first_refusal(self.admission, seq, self.kv) if self.running and self.admission else None
        if refusal is not None:
            setattr(self.counters, refusal.counter, getattr(self.counters, refusal.counter) + 1)
            return 0
        return q_len

    def _start(self, seq: Sequence, handle: KVHandle) -> None:
        """`seq` got its memory: it runs from this step (its K/V comes back from the host if it was swapped out,
        so only the uncached tail is computed)."""
        if seq is not self.waiting[0]:
            self.counters.bucket_matched_admissions += seq.bucket in self._freed_buckets
        self.waiting.remove(seq)
        seq.kv = handle
        seq.status = Status.RUNNING
        self.running.append(seq)
        if self.prefixes is not None:
            self.prefixes.add(seq)
        if seq.swapped:
            self.swapper.swap_in(seq)
            seq.swapped = False
            self.counters.swap_ins += 1

    def _prefill_chunk(self, planned: int, start: int, want: int, budget: float) -> int:
        """Prompt tokens to feed now (0: none) of `want` left from position `start`, in a step already prefilling
        `planned` tokens: all of them without chunking, else what the step's budget (and, ballooning, the free
        activation room) allows; a step that prefills nothing else feeds at least one token, so a prompt deep in
        a long context still advances under a small budget."""
        if not self.config.chunk_prefills:
            return want
        chunk = self.prefill_cost.fit(start, want, budget)
        if not chunk and not planned and budget >= self.config.max_prefill_tokens:
            chunk = min(want, 1)
        return chunk if self.elastic is None else self.elastic.prefill_room(planned, chunk)

    def _clear_way(self) -> None:
        """A head that holds the queue without a range to fit in: relocate the blocks in the range it would need
        (into lent segments, say) when there is room for them elsewhere, so it is admitted in this round."""
        head = self.order.head(self.waiting)
        if head is None or not self._head_holds(head) or self.kv.can_admit(head):
            return
        moved, cleared = self.kv.make_way(head)
        self.counters.window_clears += cleared
        self.counters.window_moves += moved

    def _head_holds(self, seq: Sequence) -> bool:
        """The head of the queue has been bypassed `max_skips` rounds: nobody overtakes it any more."""
        return seq.waited_steps >= self.config.max_skips and seq is self.order.head(self.waiting)

    def _activation_room(self, prefill_tokens: int) -> bool:
        """Ballooning: free the activation room of this step's prefill (segments lent to the KV pool are
        taken back; their blocks migrate, and the requests' handles follow)."""
        ok, _ = self.elastic.make_room(prefill_tokens)
        if not ok:
            self.counters.activation_refusals += 1
        return ok

    # -- after the step ----------------------------------------------------------------------------

    def finish(self, seq: Sequence, reason: str, *, observe: bool = True) -> None:
        """Release the request's block (if any) and drop it from the queues. observe=False: the length is
        not a realized one (cancelled or failed), so the bucket manager does not learn from it."""
        if seq.kv is not None:
            # a recomputed request's block was reserved for the tail only: the bucket window learns the whole
            # length instead of the tail's
            if observe and not seq.preemptions:
                self.kv.release(seq.request_id, self._realized(seq))
            else:
                self.kv.evict(seq.request_id)
                if observe:
                    self.kv.observe(seq.num_generated)
            if seq.block is not None:
                self._freed_buckets[seq.block.bucket] += 1
            seq.kv = None
        if seq.swapped:
            self.swapper.drop(seq)
            seq.swapped = False
        if seq in self.running:
            self.running.remove(seq)
            if self.prefixes is not None:
                self.prefixes.remove(seq)
        elif seq.status is Status.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    @staticmethod
    def _realized(seq: Sequence) -> int:
        # tokens generated since this block was reserved (prompt_tokens counts recomputed outputs)
        return seq.num_tokens - seq.prompt_tokens
