"""The sampler's partial top-k shortcut picks exactly what a full sort would."""

import torch

from odma.engine.sampling import Sampler, SamplingParams


def _draw(sampler_cls, logits, params, seed):
    gens = [torch.Generator().manual_seed(seed + i) for i in range(len(params))]
    return sampler_cls()(logits.clone(), params, gens, [()] * len(params))


class FullSort(Sampler):
    CANDIDATES = 10**9  # never narrows: the reference


def test_candidate_head_matches_full_sort():
    torch.manual_seed(0)
    vocab = 5000
    # peaked rows (head holds top_p) and flat rows (the fallback to a full sort)
    logits = torch.cat([torch.randn(6, vocab) * 8, torch.randn(6, vocab) * 0.01])
    params = [SamplingParams(temperature=t, top_p=p, top_k=k)
              for t, p, k in [(0.7, 0.95, 0), (1.0, 0.9, 0), (0.5, 1.0, 40), (1.3, 0.5, 0), (0.7, 1.0, 0), (1.0, 0.8, 3000)] * 2]
    Sampler.CANDIDATES, saved = 256, Sampler.CANDIDATES
    try:
        for seed in range(20):
            assert _draw(Sampler, logits, params, seed) == _draw(FullSort, logits, params, seed)
    finally:
        Sampler.CANDIDATES = saved


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05]]))
    params = [SamplingParams(temperature=1.0, top_p=0.8)]
    picks = {_draw(Sampler, logits, params, seed)[0] for seed in range(200)}
    assert picks == {0, 1}  # 0.6 alone < 0.8; 0.6 + 0.3 reaches it; the tail is never drawn
