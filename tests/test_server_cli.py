"""odma-serve's flags and EngineConfig's fields map one to one (the config-only ones are named in its docstring)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from odma.engine.config import EngineConfig
from odma.server.cli import build_parser, config_from_args

# field → (flags that set it, the value they give)
FLAGS = {
    "model": (["--model", "/m"], "/m"),
    "device": (["--device", "cuda:1"], "cuda:1"),
    "devices": (["--devices", "cpu:0,cpu:1"], ("cpu:0", "cpu:1")),
    "parallel_devices": (["--parallel-devices"], True),
    "dtype": (["--dtype", "bfloat16"], "bfloat16"),
    "kv_dtype": (["--kv-dtype", "bfloat16"], "bfloat16"),
    "policy": (["--policy", "s3"], "s3"),
    "attention": (["--attention", "sdpa"], "sdpa"),
    "kv_growth": (["--kv-growth", "map"], "map"),
    "decode_graphs": (["--decode-graphs", "static"], "static"),
    "kv_budget": (["--kv-budget", "64MiB"], "64MiB"),
    "max_num_seqs": (["--max-num-seqs", "7"], 7),
    "schedule": (["--schedule", "sjf"], "sjf"),
    "sjf_aging_rounds": (["--sjf-aging-rounds", "9"], 9),
    "max_prefill_tokens": (["--max-prefill-tokens", "99"], 99),
    "chunked_prefill": (["--no-chunked-prefill"], False),
    "max_tokens_cap": (["--max-tokens-cap", "300"], 300),
    "max_model_len": (["--max-model-len", "1000"], 1000),
    "default_max_tokens": (["--default-max-tokens", "12"], 12),
    "preempt": (["--preempt", "wait"], "wait"),
    "admission_theta": (["--admission-theta", "0.5"], 0.5),
    "admission_demand": (["--admission-demand", "0.9"], 0.9),
    "swap_space": (["--swap-space", "2GiB"], "2GiB"),
    "slo_ttft_s": (["--slo-ttft", "2"], 2.0),
    "slo_tpot_s": (["--slo-tpot", "0.2"], 0.2),
    "predictor": (["--predictor", "sklearn"], "sklearn"),
    "tagging": (["--tagging", "loop"], "loop"),
    "tag_batch": (["--tag-batch", "8"], 8),
    "tag_timeout_s": (["--tag-timeout", "1.5"], 1.5),
    "probe": (["--probe", "probe"], "probe"),
    "probe_online": (["--no-probe-online"], False),
    "s3_buckets": (["--s3-buckets", "5"], 5),
    "length_log": (["--length-log", "/tmp/x.jsonl"], Path("/tmp/x.jsonl")),
    "length_log_prompts": (["--length-log-prompts", "hash"], "hash"),
    "length_log_max_size": (["--length-log-max-size", "1GB"], "1GB"),
    "length_log_backups": (["--length-log-backups", "0"], 0),
    "bootstrap_from_log": (["--no-bootstrap-from-log"], False),
    "threads": (["--threads", "3"], 3),
    "weights": (["--weights", "native"], "native"),
    "balloon": (["--balloon"], True),
    "balloon_segment_tokens": (["--balloon-segment-tokens", "256"], 256),
    "balloon_keep_tokens": (["--balloon-keep-tokens", "128"], 128),
    "balloon_chunked_prefill": (["--no-balloon-chunked-prefill"], False),
    "clear_window": (["--no-clear-window"], False),
    "prefix_share_min_tokens": (["--prefix-share-min-tokens", "0"], 0),
    "prefix_reads": (["--prefix-reads"], True),
    "packing": (["--no-packing"], False),
}
POOL_FLAGS = {
    "growth": (["--growth", "double"], "double"),
    "reserve_scale": (["--reserve-scale", "0.7"], 0.7),
    "growth_hint": (["--growth-hint", "pred"], "pred"),
    "large_share": (["--large-share", "0.2"], 0.2),
    "worst_case_prompt_share": (["--worst-case-prompt-share", "0.3"], 0.3),
    "compact_growth": (["--compact-growth"], True),
    "slide_growth": (["--slide-growth"], True),
    "neighbour_growth": (["--neighbour-growth"], True),
    "continue_growth": (["--continue-growth"], True),
    "growth_step": (["--growth-step", "32"], 32),
}
CONFIG_ONLY = {"pool.align"} | {f"buckets.{f.name}" for f in dataclasses.fields(EngineConfig().buckets)} - {
    "buckets.large_bound"}


def config(*argv: str) -> EngineConfig:
    return config_from_args(build_parser().parse_args(list(argv)))


def test_no_flags_give_the_config_defaults():
    assert config() == EngineConfig()


def test_every_field_has_its_flag():
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"pool", "buckets"}
    assert set(FLAGS) == fields, "a field without a flag (or a stale entry here)"
    for name, (argv, value) in FLAGS.items():
        assert getattr(config(*argv), name) == value, name
    pool_fields = {f"pool.{f.name}" for f in dataclasses.fields(EngineConfig().pool)}
    assert {f"pool.{n}" for n in POOL_FLAGS} == pool_fields - CONFIG_ONLY
    for name, (argv, value) in POOL_FLAGS.items():
        assert getattr(config(*argv).pool, name) == value, name
    assert config("--max-tokens-cap", "300").buckets.large_bound == 300


def test_config_only_fields_are_the_documented_ones():
    import odma.engine.config

    doc = odma.engine.config.__doc__
    assert "pool.align" in doc and "buckets.*" in doc
    assert CONFIG_ONLY >= {"pool.align", "buckets.window", "buckets.method"}


def test_every_option_says_what_it_does_and_its_default(capsys):
    parser = build_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help, f"{action.option_strings[0]} has no help"
        assert re.search(r"\(default\b|\bdefault:", formatter._expand_help(action)), action.option_strings[0]
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # unwrapped
    for shown in ("(default: 127.0.0.1)", "(default: 8000)", "(default: 2048)", "(default: info)", "(default: off)"):
        assert shown in text


def test_the_switch_interval_is_set_before_the_server_starts(monkeypatch, capsys):
    """--gil-switch-ms sets the process's switch interval before the engine loop starts; out of range, a clear error
    and no server."""
    import sys

    import odma.server.cli as cli

    started = []
    monkeypatch.setattr(cli, "build_server", lambda *a, **k: started.append(sys.getswitchinterval()) or (None, None))
    monkeypatch.setattr(cli, "serve", lambda *a, **k: None)
    before = sys.getswitchinterval()
    try:
        assert cli.main(["--gil-switch-ms", "1"]) == 0
        assert started == [pytest.approx(0.001)]
        assert cli.main(["--gil-switch-ms", "0"]) == 2
        assert "--gil-switch-ms must be in (0, 1000]" in capsys.readouterr().err
        assert len(started) == 1
    finally:
        sys.setswitchinterval(before)


def test_the_engine_runs_in_its_own_process_by_default_where_steps_leave_the_host():
    from odma.engine import EngineConfig
    from odma.server.cli import engine_in_own_process

    assert engine_in_own_process(None, EngineConfig(device="cuda")) is True
    assert engine_in_own_process(None, EngineConfig(device="mlu")) is True
    assert engine_in_own_process(None, EngineConfig(device="cpu")) is False
    assert engine_in_own_process(False, EngineConfig(device="cuda")) is False
    assert engine_in_own_process(True, EngineConfig(device="cpu")) is True
