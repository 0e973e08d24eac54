"""Log-probabilities the engine reports are the model's: each prompt token's (for echo / scoring) and each
generated token's with its top-k alternatives, equal to transformers' log-softmax at the same positions."""

from __future__ import annotations

import pytest
import torch

from odma.engine import SamplingParams
from odma.engine.testing import tiny_engine
from odma.models.tiny import make_tiny_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


def _hf_logprobs(folder, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_prompt_and_output_logprobs_match_transformers(folder):
    engine = tiny_engine(folder)
    prompts = [list(range(10, 40)), [5, 6, 7], [100] * 9]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    seqs = engine.generate(prompts, params)  # prefilled together in one packed step
    for seq in seqs:
        ref = _hf_logprobs(folder, seq.prompt_ids + seq.output_ids)
        prompt = seq.prompt_ids
        assert len(seq.prompt_logprobs) == len(prompt) and seq.prompt_logprobs[0] is None
        for p in range(1, len(prompt)):
            entry = seq.prompt_logprobs[p]
            assert entry.token == prompt[p]
            assert entry.logprob == pytest.approx(ref[p - 1, prompt[p]].item(), abs=1e-4)
            assert [t for t, _ in entry.top] == ref[p - 1].topk(2).indices.tolist()
        assert [e.token for e in seq.output_logprobs] == seq.output_ids
        for j, entry in enumerate(seq.output_logprobs):
            row = ref[len(prompt) - 1 + j]
            assert entry.logprob == pytest.approx(row[entry.token].item(), abs=1e-4)
            assert entry.top[0][0] == entry.token  # greedy: the chosen token is the most likely
            assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)
            assert len(entry.top) == 3


def test_logprobs_are_only_computed_when_asked(folder):
    engine = tiny_engine(folder)
    plain, scored = engine.generate([[1, 2, 3], [1, 2, 3]], [SamplingParams(max_tokens=3, temperature=0),
                                                             SamplingParams(max_tokens=3, temperature=0, logprobs=0)])
    assert plain.output_logprobs is None and plain.prompt_logprobs is None
    assert [e.top for e in scored.output_logprobs] == [()] * scored.num_generated
    assert plain.output_ids == scored.output_ids


def test_a_recomputed_request_scores_its_prompt_once(folder):
    engine = tiny_engine(folder, kv_budget="256KiB", preempt="recompute", max_tokens_cap=96)
    params = SamplingParams(max_tokens=90, temperature=0, ignore_eos=True, prompt_logprobs=0)
    seqs = engine.generate([list(range(3, 3 + n)) for n in (20, 25, 30, 35)], params)
    assert sum(s.preemptions for s in seqs) > 0  # the pool is too small for all of them at once
    for seq in seqs:
        assert len(seq.prompt_logprobs) == len(seq.prompt_ids)
        assert [e.token for e in seq.prompt_logprobs[1:]] == seq.prompt_ids[1:]


def test_a_scored_prompt_is_fed_whole_so_its_scores_do_not_depend_on_the_batch(folder):
    """A prompt that asks for its scores and fits a step's prefill budget is never split over two steps: the second
    part would attend to the cached rows by another path, whose last-bit differences int8 activations magnify (up
    to 0.45 nats on ~21-token prompts). Its scores are then the same, to the bit, alone or behind other prompts."""
    scored = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    prompt = [(7 * i) % 200 + 3 for i in range(40)]
    alone = tiny_engine(folder, max_prefill_tokens=64).generate([prompt], scored)[0]
    engine = tiny_engine(folder, max_prefill_tokens=64)
    other, behind = engine.generate([list(range(50, 100)), prompt],  # 50 tokens first: 14 of the budget left
                                    [SamplingParams(max_tokens=4, temperature=0), scored])
    assert [e and e.logprob for e in behind.prompt_logprobs] == [e and e.logprob for e in alone.prompt_logprobs]
    assert engine.stats().scheduler_counter("prefill_chunks") == 0  # nothing else was split either
