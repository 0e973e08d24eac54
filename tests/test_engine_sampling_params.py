"""Sampling parameters at their edges: tiny temperatures are greedy, seeds cover OpenAI's int64 range (-1 is
unseeded, as in vLLM), and out-of-range values are refused before anything is queued."""

from __future__ import annotations

import pytest
import torch

from odma.engine import SamplingParams
from odma.engine.sampling import generator_seed
from odma.engine.testing import tiny_engine
from odma.errors import InvalidRequestError
from odma.models.tiny import make_tiny_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tiny_engine(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama"))


PROMPT = [5, 6, 7, 8, 9]


def _tokens(engine, **kw) -> list[int]:
    return engine.generate([PROMPT], SamplingParams(max_tokens=16, ignore_eos=True, **kw))[0].output_ids


@pytest.mark.parametrize("temperature", [1e-39, 1e-45, 1e-300, 5e-324, 9.9e-6])
def test_a_temperature_below_epsilon_is_greedy(engine, temperature):
    greedy = _tokens(engine, temperature=0)
    assert _tokens(engine, temperature=temperature, seed=3) == greedy
    assert SamplingParams(temperature=temperature).greedy


def test_small_but_real_temperatures_still_sample(engine):
    assert not SamplingParams(temperature=1e-4).greedy
    runs = {tuple(_tokens(engine, temperature=2.0, seed=s)) for s in range(4)}
    assert len(runs) > 1


@pytest.mark.parametrize("seed", [-(2**63), -2, 0, 1, 2**63 - 1])
def test_every_int64_seed_is_accepted_and_reproducible(engine, seed):
    a = _tokens(engine, temperature=1.0, seed=seed)
    assert _tokens(engine, temperature=1.0, seed=seed) == a


def test_distinct_seeds_give_distinct_generators():
    seeds = [-(2**63), -2, -1, 0, 1, 2**63 - 1]
    assert len({generator_seed(s) for s in seeds}) == len(seeds)
    assert all(0 <= generator_seed(s, i) < 2**64 for s in seeds for i in range(4))


def test_seed_minus_one_is_unseeded():
    assert SamplingParams(seed=-1).seed is None


@pytest.mark.parametrize("kw", [
    {"seed": 2**64}, {"seed": 2**63}, {"seed": -(2**63) - 1}, {"seed": 10**30}, {"seed": 2**64 - 1},
    {"temperature": 1e39}, {"temperature": 2.5}, {"temperature": float("nan")}, {"temperature": True},
    {"logprobs": 21}, {"logprobs": -1}, {"prompt_logprobs": 99},
])
def test_out_of_range_values_are_refused(kw):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kw)
