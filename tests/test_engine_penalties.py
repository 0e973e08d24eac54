"""OpenAI's frequency and presence penalties and logit bias: the engine's greedy tokens equal transformers' generate
with the same rule written as a logits processor, a batch mixing penalized and plain rows gives each row its own
tokens, logprobs report the model's own logits, and values out of range are refused before anything is queued."""

from __future__ import annotations

import pytest
import torch

from odma.engine import SamplingParams
from odma.engine.sampling import Sampler
from odma.engine.testing import tiny_engine
from odma.errors import InvalidRequestError
from odma.models.tiny import make_tiny_model

torch.set_num_threads(1)

PROMPTS = [[5, 6, 7, 8, 9], list(range(40, 72)), [100] * 9]
N = 24


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.fixture(scope="module")
def engine(folder):
    return tiny_engine(folder)


class OpenAIRule:
    """A transformers logits processor: OpenAI's documented rule, counted over the tokens generated so far."""

    def __init__(self, prompt_len: int, frequency: float, presence: float, bias: dict[int, float]):
        self.prompt_len, self.frequency, self.presence, self.bias = prompt_len, frequency, presence, bias

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        for row, ids in enumerate(input_ids):
            generated = ids[self.prompt_len:].tolist()
            for t in set(generated):
                scores[row, t] -= generated.count(t) * self.frequency + self.presence
            for t, b in self.bias.items():
                scores[row, t] += b
        return scores


def _transformers(folder, prompt: list[int], frequency=0.0, presence=0.0, bias=None) -> list[int]:
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    hf = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    rule = OpenAIRule(len(prompt), frequency, presence, bias or {})
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=N, do_sample=False, eos_token_id=None, pad_token_id=0,
                      logits_processor=LogitsProcessorList([rule]))
    return out[0, len(prompt):].tolist()


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, **kw)


CASES = [dict(frequency_penalty=1.5), dict(presence_penalty=2.0), dict(frequency_penalty=0.7, presence_penalty=-0.4),
         dict(logit_bias=((17, 3.0), (200, -100.0))), dict(frequency_penalty=2.0, logit_bias=((33, 4.0),))]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(kw))
def test_greedy_tokens_follow_openai_s_rule_as_transformers_applies_it(engine, folder, kw):
    plain = engine.generate(PROMPTS, _greedy())
    seqs = engine.generate(PROMPTS, _greedy(**kw))
    for prompt, seq, alone in zip(PROMPTS, seqs, plain):
        expected = _transformers(folder, prompt, kw.get("frequency_penalty", 0.0), kw.get("presence_penalty", 0.0),
                                 dict(kw.get("logit_bias", ())))
        assert seq.output_ids == expected
    assert any(s.output_ids != p.output_ids for s, p in zip(seqs, plain))  # the rule changed something
    assert engine.pool.stats().live_blocks == 0


def test_a_batch_mixing_penalized_and_plain_rows_gives_each_its_own_tokens(engine):
    penalized = _greedy(frequency_penalty=1.5)
    alone = [engine.generate([p], penalized)[0].output_ids for p in PROMPTS]
    plain = [engine.generate([p], _greedy())[0].output_ids for p in PROMPTS]
    mixed = engine.generate(PROMPTS * 2, [penalized] * 3 + [_greedy()] * 3)
    assert [s.output_ids for s in mixed] == alone + plain


def test_a_bias_moves_the_pick_but_logprobs_report_the_model_s_own_logits(engine):
    forced = 77
    plain = engine.generate([PROMPTS[0]], _greedy(logprobs=5))[0]
    biased = engine.generate([PROMPTS[0]], _greedy(logprobs=5, logit_bias=((forced, 100.0),)))[0]
    assert biased.output_ids == [forced] * N
    first_plain, first_biased = plain.output_logprobs[0], biased.output_logprobs[0]
    # the same context for the first token: the same distribution, whatever was picked from it
    assert first_biased.top == first_plain.top
    assert first_biased.logprob < first_plain.logprob  # the model did not favour the forced token


def test_the_sampler_adjusts_only_the_rows_that_ask():
    logits = torch.tensor([[0.0, 1.0, 0.9, 0.0], [0.0, 1.0, 0.9, 0.0]])
    params = [SamplingParams(temperature=0, presence_penalty=0.2), SamplingParams(temperature=0)]
    # token 1 occurred: 1.0 - 0.2 < 0.9 in the first row; the second row keeps its argmax
    assert Sampler()(logits.clone(), params, [None, None], [(), ()], [[1], [1]]) == [2, 1]
    params = [SamplingParams(temperature=0, frequency_penalty=0.1), SamplingParams(temperature=0, logit_bias=((3, 2.0),))]
    # twice: 1.0 - 0.2 < 0.9; and the bias lifts token 3 above them all
    assert Sampler()(logits.clone(), params, [None, None], [(), ()], [[1, 1], []]) == [2, 3]
    params = [SamplingParams(temperature=0, frequency_penalty=0.1)]
    assert Sampler()(logits[:1].clone(), params, [None], [()], [[1]]) == [1]  # once: 0.9 < 1.0 - 0.1 still


@pytest.mark.parametrize("kw", [
    {"frequency_penalty": 2.5}, {"presence_penalty": -2.01}, {"frequency_penalty": float("nan")},
    {"presence_penalty": True}, {"logit_bias": ((5, 101.0),)}, {"logit_bias": ((-1, 1.0),)},
    {"logit_bias": ((5.0, 1.0),)}, {"logit_bias": {5: 1.0}}, {"logit_bias": ((5, float("inf")),)},
])
def test_out_of_range_values_are_refused(kw):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kw)


@pytest.mark.parametrize("kw", [dict(logit_bias=((256, 1.0),)), dict(stop_token_ids=(999,), min_tokens=2),
                                dict(stop_token_ids=(-1,))])
def test_token_ids_outside_the_vocabulary_are_refused_before_anything_is_queued(engine, kw):
    """Not failed inside a step (the sampler indexes the logits by them), with every request batched beside it."""
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.add_request([5, 6, 7], _greedy(**kw))
    assert not engine.has_work() and engine.pool.stats().live_blocks == 0
