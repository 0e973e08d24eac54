"""The scheduler's typed config: checked where it is made, made for the engine in one place from EngineConfig."""

from __future__ import annotations

import dataclasses

import pytest

from odma.engine.admission import PredictedDemand, ReservedShare
from odma.engine.config import EngineConfig
from odma.engine.prefill_cost import PLAIN_TOKENS, PrefillCost
from odma.engine.scheduler import Scheduler
from odma.engine.scheduler_config import SchedulerConfig
from odma.errors import ConfigError
from odma.kv import BucketManager, BucketPolicy, ContiguousKV, KVPool
from odma.models.config import ModelConfig

SMOLLM2 = ModelConfig.from_hf_dict({"model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
                                    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                                    "num_key_value_heads": 3, "rms_norm_eps": 1e-5, "rope_theta": 1e5,
                                    "max_position_embeddings": 8192, "tie_word_embeddings": True})


def _kv() -> ContiguousKV:
    return ContiguousKV(KVPool(48, BucketPolicy(BucketManager.fixed((8, 16, 32), 32)), large_share=0.0, align=8))


@pytest.mark.parametrize("change, message", [
    ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
    ({"max_prefill_tokens": 0}, "max_prefill_tokens must be >= 1"),
    ({"lookahead": 0}, "lookahead must be >= 1"),
    ({"max_skips": -1}, "max_skips must be >= 0"),
    ({"aging_rounds": -1}, "aging_rounds must be >= 0"),
    ({"preempt": "evict"}, "preempt must be one of"),
    ({"order": "lifo"}, "schedule must be one of"),
    ({"prefix_min_tokens": -1}, "prefix_min_tokens must be >= 0"),
    ({"admission_theta": 1.5}, "admission_theta must be in (0, 1]"),
    ({"admission_demand": 0.0}, "admission_demand must be a positive share"),
    ({"prefill_cost": None}, "prefill_cost must be a PrefillCost"),
    ({"custom_admission": (ReservedShare(0.5),)}, "rule factories"),
])
def test_a_bad_value_is_refused_where_the_config_is_made(change, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SchedulerConfig(**{"max_num_seqs": 4, "prefill_cost": PLAIN_TOKENS, **change})


def test_the_prefill_cost_must_be_stated_and_the_config_is_frozen():
    with pytest.raises(TypeError, match="prefill_cost"):
        SchedulerConfig(max_num_seqs=4)  # no default: a replay says PLAIN_TOKENS, the engine the model's cost
    config = SchedulerConfig(max_num_seqs=4, prefill_cost=PLAIN_TOKENS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_num_seqs = 8


def test_swap_preemption_needs_a_swapper():
    config = SchedulerConfig(max_num_seqs=4, prefill_cost=PLAIN_TOKENS, preempt="swap")
    with pytest.raises(ConfigError, match="needs a swapper"):
        Scheduler(_kv(), config)


def test_each_scheduler_gets_rules_of_its_own():
    """Rules keep per-round state, so two schedulers from one config (replicas, devices) never share one."""
    config = SchedulerConfig(max_num_seqs=4, prefill_cost=PLAIN_TOKENS, admission_theta=0.5, admission_demand=1.0)
    a, b = Scheduler(_kv(), config), Scheduler(_kv(), config)
    assert [type(r) for r in a.admission] == [ReservedShare, PredictedDemand]
    assert all(x is not y for x, y in zip(a.admission, b.admission))
    assert Scheduler(_kv(), dataclasses.replace(config, admission_theta=1.0, admission_demand=None)).admission == []


def test_the_prefill_cost_counts_only_for_chunked_prefill():
    cost = PrefillCost(span=100.0)
    assert Scheduler(_kv(), SchedulerConfig(max_num_seqs=4, prefill_cost=cost, chunk_prefills=True)).prefill_cost is cost
    whole = Scheduler(_kv(), SchedulerConfig(max_num_seqs=4, prefill_cost=cost, chunk_prefills=False))
    assert whole.prefill_cost == PLAIN_TOKENS  # whole prompts are budgeted in tokens


def test_the_engine_settings_map_onto_the_scheduler_config():
    engine = EngineConfig(max_num_seqs=7, max_prefill_tokens=96, preempt="swap", schedule="sjf", sjf_aging_rounds=9,
                          admission_theta=0.8, admission_demand=1.2, prefix_share_min_tokens=32, clear_window=True)
    config = engine.scheduler_config(SMOLLM2)
    assert config == SchedulerConfig(max_num_seqs=7, max_prefill_tokens=96, prefill_cost=PrefillCost.for_model(SMOLLM2),
                                     preempt="swap", order="sjf", aging_rounds=9, chunk_prefills=True,
                                     clear_window=True, prefix_min_tokens=32, admission_theta=0.8,
                                     admission_demand=1.2)
    assert config.prefill_cost.span is not None  # the engine prices a chunk's attention; replays say PLAIN_TOKENS
    # ballooning without chunks: prompts are fed whole
    assert not dataclasses.replace(engine, balloon=True, kv_growth="copy",
                                   balloon_chunked_prefill=False).scheduler_config(SMOLLM2).chunk_prefills
    assert dataclasses.replace(engine, balloon=True, kv_growth="copy").scheduler_config(SMOLLM2).chunk_prefills
    # the paged baseline recomputes (its pages are not swapped), has no contiguous windows, and shares prefixes
    # (by mapping whole pages: the scheduler asks the pool)
    paged = dataclasses.replace(engine, policy="paged", attention="triton").scheduler_config(SMOLLM2)
    assert (paged.preempt, paged.clear_window, paged.prefix_min_tokens) == ("recompute", False, 32)
    assert dataclasses.replace(engine, policy="paged", attention="triton",
                               preempt="wait").scheduler_config(SMOLLM2).preempt == "wait"
