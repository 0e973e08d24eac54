"""A clean stop: on SIGINT `odma-serve` ends every request in flight at once (a stream's last events are an error
saying so and [DONE]; a plain request gets a 503), then exits with 0 without waiting for them to finish or for
the interpreter's slow teardown. Bounds on time are wide (the numbers measured on SmolLM2: docs/serving.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from odma.server.testing import MODEL
from odma.server.threaded import free_port


class Served:
    """`python -m odma.server.cli` over the tiny model, as a user starts it."""

    def __init__(self, folder, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "odma.server.cli", "--model", str(folder), "--served-model-name", MODEL,
               "--port", str(self.port), "--predictor", "median", "--length-log", "", "--kv-budget", "8MiB",
               "--max-tokens-cap", "4000", "--threads", "1", *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "ODMA_CPU_KERNELS": "0"})  # the C kernels are not tested here
        deadline = time.monotonic() + 180
        while True:
            assert self.proc.poll() is None, self.proc.stderr.read()
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "odma-serve did not start"
            time.sleep(0.2)

    def children(self) -> list[int]:
        """The server's child processes now (the engine process, with --engine-process)."""
        out = []
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
            except OSError:
                continue
            if fields.get("PPid", "").strip() == str(self.proc.pid):
                out.append(int(status.parent.name))
        return out

    def interrupt(self) -> tuple[float, str]:
        """Ctrl-C: (seconds until the process exited, its stderr). No child process outlives it."""
        children = self.children()
        start = time.monotonic()
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        seconds = time.monotonic() - start
        # a child may still be on its way out when the server is gone (multiprocessing's resource tracker ends when
        # its pipe from the server closes): give them a moment, not forever
        deadline = time.monotonic() + 10
        while (left := [pid for pid in children if _running(pid)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert left == [], f"child processes left running: {left}"
        return seconds, self.proc.stderr.read()


def _running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie, or one being torn down, has)."""
    try:
        state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State:"))
    except (OSError, StopIteration):
        return False
    return not any(s in state for s in ("zombie", "dead", "Z", "X"))


# the engine in process, and in a process of its own (which the stop ends too, leaving no process behind)
SERVERS = pytest.mark.parametrize("flags", [(), ("--engine-process",)], ids=["in-process", "engine-process"])


@SERVERS
def test_an_idle_server_stops_at_once(tiny_folder, flags):
    served = Served(tiny_folder, *flags)
    assert bool(served.children()) == bool(flags)  # the engine process (and multiprocessing's tracker), where asked for
    seconds, stderr = served.interrupt()
    assert served.proc.returncode == 0, stderr
    assert "Finished server process" in stderr and "Traceback" not in stderr
    assert seconds < 5  # 0.21-0.31 s measured with SmolLM2; it was 0.92-1.12 s


def test_the_command_skips_the_interpreter_teardown_after_a_clean_stop(monkeypatch):
    """The teardown of torch, transformers and onnxruntime took 0.7-0.8 s after "Finished server process" (more on a
    loaded machine): the command exits at once once the server has stopped and the engine is closed."""
    from types import SimpleNamespace

    from odma.server import cli

    served, exits = [], []
    runtime = SimpleNamespace(engine=SimpleNamespace(close=lambda: served.append("closed")))
    monkeypatch.setattr(cli, "build_server", lambda *a, **k: ("app", runtime))
    monkeypatch.setattr(cli, "serve", lambda app, rt, *a: served.append(("served", rt is runtime)))
    monkeypatch.setattr(cli.os, "_exit", lambda code: exits.append(code))
    assert cli.main(["--predictor", "median"]) == 0 and exits == []  # in-process callers get their return
    cli.main(["--predictor", "median"], exit_fast=True)
    assert exits == [0] and served == [("served", True), ("served", True)]


@SERVERS
def test_requests_in_flight_end_with_a_clear_last_event(tiny_folder, flags):
    served = Served(tiny_folder, *flags)
    events: list[str] = []
    plain: list[httpx.Response] = []
    streaming = threading.Event()
    long = {"model": MODEL, "prompt": "a long story", "max_tokens": 4000, "ignore_eos": True}

    def stream():
        with httpx.stream("POST", served.url + "/v1/completions", json={**long, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) >= 3:
                        streaming.set()

    threads = [threading.Thread(target=stream),
               threading.Thread(target=lambda: plain.append(httpx.post(served.url + "/v1/completions", json=long,
                                                                        timeout=60)))]
    for t in threads:
        t.start()
    assert streaming.wait(60)
    seconds, stderr = served.interrupt()
    for t in threads:
        t.join(60)
    assert served.proc.returncode == 0, stderr
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 503 and "shutting down" in error["message"]
    assert len(events) < 4000  # cut short, not run to its end
    assert plain[0].status_code == 503 and "shutting down" in plain[0].json()["error"]["message"]
    assert seconds < 20  # 0.2 s measured with SmolLM2 and two streams; before, it waited for them to finish
