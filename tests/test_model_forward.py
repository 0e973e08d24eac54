"""Our Llama / Qwen2 layers over contiguous KV blocks compute what transformers computes."""

from __future__ import annotations

import pytest
import torch

from odma.errors import ConfigError
from odma.models import ModelConfig, load_model
from odma.models.llama import SeqSlot
from odma.models.tiny import make_tiny_model

torch.set_num_threads(2)


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama-tied"])
def tiny(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    arch = request.param.split("-")[0]
    folder = make_tiny_model(tmp_path_factory.mktemp(request.param), arch, tie_word_embeddings=request.param.endswith("tied"))
    return load_model(folder), AutoModelForCausalLM.from_pretrained(str(folder)).eval()


def _block(model, capacity: int) -> torch.Tensor:
    c = model.config
    return torch.zeros(c.num_layers, 2, capacity, c.num_kv_heads, c.head_dim)


def test_prefill_and_decode_logits_match_transformers(tiny):
    ours, hf = tiny
    ids = torch.randint(3, 250, (23,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    kv = _block(ours, 32)
    # prefill the first 15 tokens in one step, then a 5-token chunk after the cache, then decode one by one
    out = ours(ids[:15], torch.arange(15), [SeqSlot(kv, 0, 15)])
    torch.testing.assert_close(out[0], ref[14], atol=1e-4, rtol=1e-4)
    out = ours(ids[15:20], torch.arange(15, 20), [SeqSlot(kv, 15, 5)])
    torch.testing.assert_close(out[0], ref[19], atol=1e-4, rtol=1e-4)
    for i in range(20, 23):
        out = ours(ids[i : i + 1], torch.tensor([i]), [SeqSlot(kv, i, 1)])
        torch.testing.assert_close(out[0], ref[i], atol=1e-4, rtol=1e-4)


def test_packed_step_of_several_requests_matches_each_alone(tiny):
    ours, hf = tiny
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 250, (n,), generator=g) for n in (1, 9, 30)]
    blocks = [_block(ours, 48) for _ in prompts]
    out = ours(torch.cat(prompts), torch.cat([torch.arange(len(p)) for p in prompts]),
               [SeqSlot(b, 0, len(p)) for b, p in zip(blocks, prompts)])
    for row, p in zip(out, prompts):
        with torch.no_grad():
            torch.testing.assert_close(row, hf(p[None]).logits[0, -1], atol=1e-4, rtol=1e-4)


def test_only_the_requests_range_of_the_block_is_touched(tiny):
    ours, _ = tiny
    kv = torch.full((ours.config.num_layers, 2, 16, ours.config.num_kv_heads, ours.config.head_dim), 7.0)
    ours(torch.tensor([4, 5, 6]), torch.arange(3), [SeqSlot(kv, 0, 3)])
    assert torch.all(kv[:, :, 3:] == 7.0)  # slots past the request's tokens are untouched
    assert not torch.all(kv[:, :, :3] == 7.0)


def test_unsupported_architecture_is_a_clear_error():
    with pytest.raises(ConfigError, match="not supported"):
        ModelConfig.from_hf_dict({"model_type": "gpt2", "vocab_size": 10})


def test_missing_weights_are_a_clear_error(tmp_path):
    folder = make_tiny_model(tmp_path / "m", "llama")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="safetensors"):
        load_model(folder)


def test_bf16_weights_over_fp32_kv_are_no_less_accurate_than_bf16_throughout(tiny):
    """The CPU mix (bf16 weights, fp32 KV and attention) against transformers' fp32 logits: its error must
    not exceed that of transformers' own all-bf16 model, over a prefill and decode steps."""
    ours32, hf = tiny
    from transformers import AutoModelForCausalLM

    hf16 = AutoModelForCausalLM.from_pretrained(hf.name_or_path, dtype=torch.bfloat16).eval()
    ours = load_model(hf.name_or_path, dtype=torch.bfloat16)
    ids = torch.randint(3, 250, (24,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref, ref16 = hf(ids[None]).logits[0], hf16(ids[None]).logits[0].float()
    kv = _block(ours32, 32)  # float32
    rows = [ours(ids[:16], torch.arange(16), [SeqSlot(kv, 0, 16)])[0]]
    for i in range(16, 24):
        rows.append(ours(ids[i : i + 1], torch.tensor([i]), [SeqSlot(kv, i, 1)])[0])
    assert kv.dtype == torch.float32 and rows[0].dtype == torch.float32
    positions = [15, *range(16, 24)]
    ours_err = max((r - ref[p]).abs().max().item() for r, p in zip(rows, positions))
    hf16_err = max((ref16[p] - ref[p]).abs().max().item() for p in positions)
    assert 0 < ours_err <= 1.5 * hf16_err, (ours_err, hf16_err)
