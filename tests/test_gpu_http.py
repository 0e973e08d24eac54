"""`odma-bench gpu`'s http part on CPU (tiny): the engine in process and odma-serve in its own process run the same
burst and report real figures; a server that fails to start, or never answers, is an error in the part's JSON and
leaves no process behind. Timings here mean nothing."""

from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("triton")


def _args(tmp_path, *extra):
    import argparse

    from odma.bench import gpu_bench

    parser = argparse.ArgumentParser()
    gpu_bench.add_arguments(parser)
    return parser.parse_args(["--device", "cpu", "--tiny", "--rounds", "1", "--parts", "http", "--caps", "http=240",
                              "--out", str(tmp_path / "r.json"), *extra])


@pytest.fixture
def launched(monkeypatch):
    """Every Python process started while the test runs: the server, or what stands in for it (to check that none
    is left; libraries' own short commands, ldconfig and uname, are not recorded)."""
    from odma.bench import gpu_http

    procs = []
    real = gpu_http.subprocess.Popen

    def recording(cmd, *a, **kw):
        proc = real(cmd, *a, **kw)
        if isinstance(cmd, list) and cmd[0] == sys.executable:
            procs.append(proc)
        return proc

    monkeypatch.setattr(gpu_http.subprocess, "Popen", recording)
    return procs


def _gone(proc) -> bool:
    """Exited and reaped, and nothing of its process group is left."""
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return proc.poll() is not None
    return False


def test_the_http_part_serves_the_engines_burst_and_every_forced_token(tmp_path, launched):
    from odma.bench import gpu_bench, gpu_http

    args = _args(tmp_path, "--http-requests", "5")
    gpu_bench.run(args)
    part = json.loads((tmp_path / "r.json").read_text())["http"]
    work = gpu_http.burst_work(args)
    assert part["requests"] == work.requests == 5 and part["forced_output_tokens"] == sum(work.lengths)
    assert part["model"] == "random:tiny-qwen2" and part["concurrency"] == 64
    for run in ("engine", "server"):
        r = part[run]
        assert "error" not in r, r
        assert r["requests_ok"] == 5 and r["requests_failed"] == 0 and not r["cut_at_cap"], r
        assert r["output_tokens"] == sum(work.lengths), r
        assert r["tokens_per_s"] > 0 and 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] <= r["seconds"], r
    assert part["tokens_equal"] is True and part["http_vs_engine"] > 0
    assert part["server"]["exit_code"] == 0  # stopped by SIGTERM, cleanly
    assert part["server"]["ready_s"] > 0 and "--max-num-seqs" in part["server_flags"]
    assert len(launched) == 1 and _gone(launched[0])


def test_a_server_that_fails_to_start_is_an_error_in_the_json_and_leaves_no_process(tmp_path, launched, monkeypatch):
    from odma.bench import gpu_bench, gpu_http

    real = gpu_http.server_command
    # the in-process engine takes the flags as they are; the server gets a KV budget it cannot parse
    monkeypatch.setattr(gpu_http, "server_command", lambda flags, port: real(flags, port) + ["--kv-budget", "lots"])
    gpu_bench.run(_args(tmp_path, "--http-requests", "2"))
    part = json.loads((tmp_path / "r.json").read_text())["http"]
    assert part["engine"]["requests_ok"] == 2
    error = part["server"]["error"]
    assert error.startswith("RuntimeError: odma-serve exited with code 2 before it was ready") and "lots" in error
    assert "http_vs_engine" not in part and "tokens_equal" not in part
    assert len(launched) == 1 and _gone(launched[0])


def test_a_server_that_never_answers_is_killed_at_its_time_limit(tmp_path, launched, monkeypatch):
    from odma.bench import gpu_http

    # a "server" that ignores SIGTERM and never listens: the wait ends at its limit, SIGKILL ends the process
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"
    monkeypatch.setattr(gpu_http, "server_command", lambda flags, port: [sys.executable, "-c", stubborn])
    monkeypatch.setattr(gpu_http, "STOP_GRACE_S", 1.0)
    with pytest.raises(RuntimeError, match=r"did not answer /health within 3 s; its log .* ends: .*up"):
        with gpu_http.running_server([], tmp_path / "server.log", ready_timeout_s=3):
            pass
    assert len(launched) == 1 and _gone(launched[0]) and launched[0].returncode == -9


def test_the_server_is_stopped_when_the_burst_fails(tmp_path, launched, monkeypatch):
    """Whatever happens while the server runs, it is stopped (here: the client's side raises)."""
    from odma.bench import gpu_http

    args = _args(tmp_path, "--http-requests", "2")
    work = gpu_http.burst_work(args)
    flags = gpu_http.server_flags(args, work, "cpu", "float32")

    async def broken_drive(*a, **kw):
        raise ConnectionError("injected")

    monkeypatch.setattr(gpu_http, "_drive", broken_drive)
    with pytest.raises(ConnectionError, match="injected"):
        gpu_http.http_run(flags, work, tmp_path / "server.log", 240, float("inf"))
    assert len(launched) == 1 and _gone(launched[0]) and launched[0].returncode == 0


@pytest.mark.parametrize("memory", ["packed", "headroom", "compact", "swap", "wait", "compact-wait"])
def test_the_server_gets_the_engine_parts_odma_memory(tmp_path, memory):
    """The server's flags give it the odma memory the engine part runs (the same EngineConfig fields)."""
    from odma.analyze.gpu_burst import odma_memory
    from odma.bench import gpu_http
    from odma.server import cli

    args = _args(tmp_path, "--http-requests", "2", "--odma-memory", memory)
    work = gpu_http.burst_work(args)
    parser = cli.build_parser()
    config = cli.config_from_args(parser.parse_args(gpu_http.server_flags(args, work, "cpu", "float32")))
    want = odma_memory(memory)
    assert config.preempt == want.get("preempt", "swap")
    assert config.packing_resolved == want["packing"]
    assert config.resolved_pool.compact_growth == ("pool" in want and want["pool"].compact_growth)
    assert config.resolved_admission_theta == want.get("admission_theta", 1.0)


def test_a_memory_the_server_cannot_spell_is_refused(tmp_path):
    """"packed-swap" packs without `packing` (which would wait instead of swapping): the server has no flags for it."""
    from odma.bench import gpu_http
    from odma.errors import ConfigError

    args = _args(tmp_path, "--http-requests", "2", "--odma-memory", "packed-swap")
    with pytest.raises(ConfigError, match="packed-swap"):
        gpu_http.server_flags(args, gpu_http.burst_work(args), "cpu", "float32")
