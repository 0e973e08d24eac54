"""n > 1: several samples of one prompt, each in its own block, the prompt computed once (its K/V copied into
the other samples' blocks), each sample drawing from its own seed (seed + i, as in vLLM)."""

from __future__ import annotations

import pytest
import torch

from odma.engine import SamplingParams
from odma.engine.testing import tiny_engine
from odma.models.tiny import make_tiny_model

torch.set_num_threads(1)
PROMPT = list(range(10, 50))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


def _run(engine, seqs):
    blocks = set()
    while not all(s.finished for s in seqs):
        engine.step()
        live = [s.block for s in seqs if s.block is not None]
        if len(live) == len(seqs):
            blocks = {(b.offset, b.capacity) for b in live}
    return blocks


def test_samples_copy_the_prompt_and_match_single_requests(folder):
    engine = tiny_engine(folder)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=11, ignore_eos=True, logprobs=0)
    seqs = engine.add_samples(PROMPT, params, 4)
    blocks = _run(engine, seqs)
    assert len(blocks) == 4  # every sample had its own block at the same time
    assert engine.prefill_tokens == len(PROMPT)  # the prompt was computed once...
    assert engine.forks.copied == 3 and engine.forks.recomputed == 0  # ...and copied into three blocks
    assert [s.request_id for s in seqs] == [seqs[0].request_id] + [f"{seqs[0].request_id}.{i}" for i in (1, 2, 3)]
    assert len({tuple(s.output_ids) for s in seqs}) > 1  # different seeds, different samples
    for i, seq in enumerate(seqs):  # sample i is what a single request seeded 11 + i generates
        alone = tiny_engine(folder).generate([PROMPT], SamplingParams(max_tokens=12, temperature=1.0, seed=11 + i,
                                                                      ignore_eos=True, logprobs=0))[0]
        assert seq.output_ids == alone.output_ids
        assert [e.logprob for e in seq.output_logprobs] == pytest.approx([e.logprob for e in alone.output_logprobs], abs=1e-4)
    assert engine.pool.stats().live_blocks == 0
    engine.pool.check_invariants()


def test_samples_whose_first_sample_ended_prefill_for_themselves(folder):
    engine = tiny_engine(folder)
    seqs = engine.add_samples(PROMPT, SamplingParams(max_tokens=1, temperature=0), 3)
    _run(engine, seqs)
    assert engine.forks.recomputed == 2 and engine.forks.copied == 0
    assert len({tuple(s.output_ids) for s in seqs}) == 1  # greedy: the same token three times
    assert engine.pool.stats().live_blocks == 0


def test_cancelling_samples_frees_every_block(folder):
    engine = tiny_engine(folder)
    seqs = engine.add_samples(PROMPT, SamplingParams(max_tokens=50, temperature=1.0, ignore_eos=True), 5)
    engine.step()  # sample 0 prefills; the others are still held
    engine.abort(seqs[3].request_id)
    engine.step()
    engine.step()
    for seq in seqs:
        engine.abort(seq.request_id)
    engine.step()
    assert all(s.finished for s in seqs) and not engine.has_work()
    assert engine.pool.stats().live_blocks == 0 and engine.num_waiting == 0
    engine.pool.check_invariants()


def test_n_is_validated(folder):
    from odma.errors import InvalidRequestError

    engine = tiny_engine(folder)
    for n in (0, -1, 1.5, True):
        with pytest.raises(InvalidRequestError):
            engine.add_samples([1, 2], SamplingParams(max_tokens=2), n)
    assert engine.num_waiting == 0
