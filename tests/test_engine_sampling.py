"""The sampler's partial top-k shortcut picks exactly what a full sort would."""

import torch

from odma.engine.sampling import Sampler, SamplingParams


def _draw(sampler_cls, logits, params, seed):
    gens = [torch.Generator().manual_seed(seed + i) for i in range(len(params))]
    return sampler_cls()(logits.clone(), params, gens, [()] * len(params))


class FullSort(Sampler):
    HEADS = ()  # never narrows: the reference


class SmallHeads(Sampler):
    HEADS = (16, 256)


def test_candidate_heads_match_full_sort():
    torch.manual_seed(0)
    vocab = 5000
    # peaked rows (the first head holds top_p), middling rows (100 tokens share 96 % of the mass: only the
    # second head holds it) and flat rows (the fallback to a full sort)
    middling = torch.full((6, vocab), 0.04 / (vocab - 100))
    middling[:, torch.randperm(vocab)[:100]] = 0.96 / 100
    middling = middling.log() + torch.randn(6, vocab) * 0.01  # no exact ties: sort and topk may order those apart
    logits = torch.cat([torch.randn(6, vocab) * 8, middling, torch.randn(6, vocab) * 0.01])
    params = [SamplingParams(temperature=t, top_p=p, top_k=k)
              for t, p, k in [(0.7, 0.95, 0), (1.0, 0.9, 0), (0.5, 1.0, 40), (1.3, 0.5, 0), (1.0, 0.95, 0),
                              (1.0, 0.8, 3000)] * 3]
    for seed in range(20):
        assert _draw(SmallHeads, logits, params, seed) == _draw(FullSort, logits, params, seed)


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05]]))
    params = [SamplingParams(temperature=1.0, top_p=0.8)]
    picks = {_draw(Sampler, logits, params, seed)[0] for seed in range(200)}
    assert picks == {0, 1}  # 0.6 alone < 0.8; 0.6 + 0.3 reaches it; the tail is never drawn


def test_the_model_s_inference_tensors_can_be_sampled_outside_inference_mode():
    # the sampler edits logits in place (temperature, banned ids); a model's output is an inference tensor
    with torch.inference_mode():
        logits = torch.randn(3, 50) * 4
    params = [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=0), SamplingParams(min_tokens=2)]
    picks = Sampler()(logits, params, [None, None, None], [(), (), (1, 2)])
    assert len(picks) == 3 and picks[1] == int(logits[1].argmax()) and picks[2] not in (1, 2)
