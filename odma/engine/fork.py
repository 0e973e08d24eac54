"""Several samples of one prompt (`n > 1`): each sample is its own request with its own block, but the prompt is
computed once.

Sample 0 is queued like any request. Samples 1..n-1 are held back until it has prefilled the prompt; then they
join its device's queue. When one is admitted (its own block reserved), the K/V of all prompt tokens but the
last are copied into its block from a sibling that holds them, and only the last prompt token is fed again (its
logits give the sample's own first token). A sample admitted when no sibling holds the prompt any more (they
all finished, or were preempted) prefills it itself: correct, only slower; `recomputed` counts those.
"""

from __future__ import annotations

from odma.engine.scheduler import Work
from odma.engine.sequence import Sequence, Status
from odma.engine.prefix_share import copy_first_rows


class Forks:
    def __init__(self) -> None:
        self._held: dict[str, list[Sequence]] = {}  # first sample's id → samples not yet queued
        self.copied = 0  # samples that got the prompt's K/V by copy
        self.recomputed = 0  # samples that had to prefill the prompt themselves

    @staticmethod
    def group(samples: list[Sequence]) -> None:
        """Make `samples` (sample 0 first) one group: each can find the others to copy the prompt from."""
        for seq in samples:
            seq.samples = samples

    def hold(self, first: Sequence, forks: list[Sequence]) -> None:
        if forks:
            self._held[first.request_id] = list(forks)

    @property
    def pending(self) -> int:
        return sum(len(f) for f in self._held.values())

    def drop(self, seq: Sequence) -> None:
        """A held sample finished early (cancelled): forget it."""
        if seq.samples and seq.index:
            held = self._held.get(seq.samples[0].request_id)
            if held and seq in held:
                held.remove(seq)

    def release(self) -> list[tuple[Sequence, list[Sequence]]]:
        """(first sample, its held samples) for every first sample whose prompt is cached now, or that ended
        (its samples then prefill for themselves); they leave the table."""
        out = []
        for rid, forks in list(self._held.items()):
            first = forks[0].samples[0] if forks else None
            if first is None:
                del self._held[rid]
            elif first.finished or first.num_cached >= len(first.prompt_ids):
                del self._held[rid]
                for seq in forks:  # same prompt, same parameters: the same prediction
                    seq.predicted_length = seq.predicted_tokens = first.predicted_length
                    seq.uncertainty, seq.bucket = first.uncertainty, first.bucket
                    seq.growth_hint = first.growth_hint
                out.append((first, forks))
        return out

    def prepare(self, work: list[Work], arena) -> list[Work]:
        """The step's work with each just-admitted sample's prompt copied in: it feeds its last prompt token only."""
        out = []
        for w in work:
            seq = w.seq
            if seq.samples is None or seq.index == 0 or seq.prompt_copied or w.start != 0:
                out.append(w)
                continue
            keep = len(seq.prompt_ids) - 1
            source = _holder(seq, keep)
            seq.prompt_copied = True  # one attempt: later prefills (after a preemption) are its own
            if source is None:
                self.recomputed += 1
                out.append(w)
                continue
            copy_first_rows(arena, source.kv, seq.block, keep)
            seq.num_cached = keep
            self.copied += 1
            out.append(Work(seq, keep, 1))
        return out


def _holder(seq: Sequence, tokens: int) -> Sequence | None:
    """A running sibling whose block holds the first `tokens` tokens of the prompt."""
    for other in seq.samples:
        if (other is not seq and other.status is Status.RUNNING and other.block is not None
                and other.num_cached >= tokens and other.device == seq.device):
            return other
    return None
