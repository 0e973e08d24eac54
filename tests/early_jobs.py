"""Slow checks that run as a subprocess of their own (the GPU check's CPU dry run, the vLLM plugin's two engine runs)
start when the session starts, one after another on a background thread at a lower CPU priority, so the rest of
the suite runs beside them instead of before or after them.

A test module offers its jobs as `start_early(tmp_path_factory) -> {name: (fixture, prepare)}`; a job starts only
where a selected test uses its fixture. `prepare()` returns the `Command` to run, or raises pytest's skip or fail,
which every test waiting for that job then raises. The fixture waits with `EarlyJobs.result(name, prepare)`; a job
that was not started early runs then, inline, at the normal priority. Under pytest-xdist (README's test command)
no job starts early: each worker runs the jobs of the modules it is handed inline, and conftest.py hands those
modules out first."""

from __future__ import annotations

import queue
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

NICE = 10  # the background job yields to the tests (timing-sensitive ones included) whenever they want the core


@dataclass(frozen=True)
class Command:
    args: list[str]
    env: dict[str, str] | None
    timeout_s: float
    out: Path | None = None  # where the job writes what its tests read


@dataclass(frozen=True)
class Finished:
    command: Command
    returncode: int
    stdout: str
    stderr: str


Prepare = Callable[[], Command]


def run(command: Command, nice: bool = False, running: set[subprocess.Popen] | None = None) -> Finished:
    """The command to its end (killed at its timeout: subprocess.TimeoutExpired), output captured; `running` holds
    the process while it runs (for `EarlyJobs.close`)."""
    running = set() if running is None else running
    # through nice(1), not a preexec_fn (not safe in a process with threads: the child could deadlock before exec)
    args = ["nice", "-n", str(NICE), *command.args] if nice and shutil.which("nice") else command.args
    proc = subprocess.Popen(args, env=command.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    running.add(proc)
    try:
        stdout, stderr = proc.communicate(timeout=command.timeout_s)
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    finally:
        running.discard(proc)
    return Finished(command, proc.returncode, stdout, stderr)



class EarlyJobs:
    """See the module docstring."""

    def __init__(self) -> None:
        self._done: dict[str, threading.Event] = {}
        self._results: dict[str, Finished | BaseException] = {}
        self._queue: queue.Queue[tuple[str, Prepare] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._running: set[subprocess.Popen] = set()  # this instance's job while it runs: close() kills only that

    def start(self, name: str, prepare: Prepare) -> None:
        """Queue the job behind those started before it."""
        if name in self._done:
            raise ValueError(f"early job {name!r} started twice")
        self._done[name] = threading.Event()
        self._queue.put((name, prepare))
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="early-jobs", daemon=True)
            self._thread.start()

    def result(self, name: str, prepare: Prepare) -> Finished:
        """The job's outcome once it ended (raising what its preparation or run raised); a job never started early
        runs now, inline."""
        done = self._done.get(name)
        if done is None:
            return run(prepare())
        done.wait()
        outcome = self._results[name]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def close(self) -> None:
        """Stop: what has not started never will, what runs is killed (an interrupted session leaves no process)."""
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._queue.put(None)
        for proc in list(self._running):
            proc.kill()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            name, prepare = job
            try:
                self._results[name] = run(prepare(), nice=True, running=self._running)
            except BaseException as exc:  # noqa: BLE001 - pytest's skip/fail included: the waiting test raises it
                self._results[name] = exc
            self._done[name].set()
