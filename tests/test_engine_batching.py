"""Continuous batching over contiguous blocks gives each request the tokens it gets alone in transformers."""

from __future__ import annotations

import pytest
import torch

from odma.engine import SamplingParams
from odma.engine.testing import tiny_engine
from odma.models.tiny import make_tiny_model

torch.set_num_threads(2)
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def folder(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


def _hf_greedy(folder, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


PROMPTS = [[5, 6, 7], list(range(10, 70)), [100] * 17, [3], list(range(200, 240))]


def test_batched_greedy_matches_transformers(folder):
    engine = tiny_engine(folder)
    seqs = engine.generate(PROMPTS, GREEDY)
    for prompt, seq in zip(PROMPTS, seqs):
        assert seq.output_ids == _hf_greedy(folder, prompt, 32)
        assert seq.finish_reason == "length"
    assert engine.pool.stats().live_blocks == 0
    engine.pool.check_invariants()


def test_requests_joining_mid_decode_get_the_same_tokens(folder):
    """Continuous batching: a request that arrives while others decode is prefilled in the same step."""
    alone = tiny_engine(folder).generate(PROMPTS, GREEDY)
    engine = tiny_engine(folder)
    first = [engine.add_request(p, GREEDY) for p in PROMPTS[:2]]
    for _ in range(5):
        engine.step()
    later = [engine.add_request(p, GREEDY) for p in PROMPTS[2:]]
    batch_sizes = []
    while engine.has_work():
        engine.step()
        batch_sizes.append(engine.num_running)
    assert max(batch_sizes) == len(PROMPTS)  # all five decoded together at some point
    for a, b in zip(alone, first + later):
        assert a.output_ids == b.output_ids


def test_eos_stops_unless_ignored(folder):
    engine = tiny_engine(folder)
    probe = engine.generate([[5, 6, 7]], GREEDY)[0].output_ids
    engine.runner.eos_ids = (probe[3],)  # pretend the 4th greedy token is EOS
    stopped = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=32, temperature=0))[0]
    assert stopped.finish_reason == "stop" and stopped.output_ids == probe[: probe.index(probe[3]) + 1]
    ignored = engine.generate([[5, 6, 7]], GREEDY)[0]
    assert ignored.output_ids == probe


def test_min_tokens_masks_eos(folder):
    engine = tiny_engine(folder)
    probe = engine.generate([[5, 6, 7]], GREEDY)[0].output_ids
    engine.runner.eos_ids = (probe[0],)
    seq = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=32, temperature=0, min_tokens=6))[0]
    assert len(seq.output_ids) >= 6 and probe[0] not in seq.output_ids[:6]


def test_seeded_sampling_repeats_and_differs_by_seed(folder):
    engine = tiny_engine(folder)
    p = [SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=s, ignore_eos=True) for s in (1, 1, 2)]
    a, b, c = engine.generate([[9, 8, 7]] * 3, p)
    assert a.output_ids == b.output_ids
    assert a.output_ids != c.output_ids


def test_bf16_weights_keep_an_fp16_cache_on_cpu_and_batching_changes_no_token(folder):
    """--dtype bfloat16 on CPU: the KV pool is float16 (sized as such; the kernels attend in fp32) unless --kv-dtype
    says otherwise, and a request decoded among others gets the tokens it gets alone."""
    engine = tiny_engine(folder, dtype="bfloat16", kv_dtype=None)  # the server's default
    assert engine.model.dtype == torch.bfloat16 and engine.runner.layout.dtype == torch.float16
    assert engine.pool.bytes_per_token == engine.model.kv_bytes_per_token(torch.float16)
    together = engine.generate(PROMPTS, GREEDY)
    for prompt, seq in zip(PROMPTS, together):
        alone = tiny_engine(folder, dtype="bfloat16", kv_dtype=None).generate([prompt], GREEDY)[0]
        assert seq.output_ids == alone.output_ids
    narrow = tiny_engine(folder, dtype="bfloat16", kv_dtype="bfloat16")
    wide = tiny_engine(folder, dtype="bfloat16", kv_dtype="float32")
    assert narrow.runner.layout.dtype == torch.bfloat16 and wide.runner.layout.dtype == torch.float32
    assert narrow.pool.bytes_per_token * 2 == engine.pool.bytes_per_token * 2 == wide.pool.bytes_per_token


def test_stop_strings_end_the_request_in_the_step_that_completes_them(tmp_path):
    """The engine, not only the HTTP layer, watches stop strings: the request ends with reason "stop" at the
    token that completes one, so its realized length has no overrun."""
    from odma.tokenizer import load_tokenizer

    folder = make_tiny_model(tmp_path / "m", "llama", vocab_size=49152, eos_token_id=2)
    engine = tiny_engine(folder)
    engine.tokenizer = load_tokenizer("smollm2").hf
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    full = engine.generate(["Hello there"], params)[0]
    text = engine.decode(full.output_ids)
    stop = text[4:7]
    needed = next(k for k in range(1, 25) if stop in engine.decode(full.output_ids[:k]))
    stopped = engine.generate(["Hello there"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                              stop=(stop,)))[0]
    assert stopped.finish_reason == "stop" and stopped.output_ids == full.output_ids[:needed]
    with pytest.raises(Exception, match="stop"):
        SamplingParams(stop=("",))
