"""The suite's early jobs (tests/early_jobs.py): run in order at a lower priority, what a preparation or a run
raised reaches the test that waits, a job past its timeout is killed, and one never started runs inline."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from early_jobs import NICE, Command, EarlyJobs

PRINT_NICE = [sys.executable, "-c", "import os, time; print(os.nice(0), time.monotonic())"]


def test_jobs_run_one_after_another_below_the_tests_priority_and_failures_reach_the_waiting_test():
    jobs = EarlyJobs()

    def broken() -> Command:
        raise RuntimeError("the preparation failed")

    try:
        jobs.start("first", lambda: Command(PRINT_NICE, None, 60))
        jobs.start("broken", broken)
        jobs.start("second", lambda: Command(PRINT_NICE, None, 60))
        with pytest.raises(ValueError, match="twice"):
            jobs.start("first", broken)
        second, first = jobs.result("second", broken), jobs.result("first", broken)
        with pytest.raises(RuntimeError, match="the preparation failed"):
            jobs.result("broken", broken)
    finally:
        jobs.close()
    (nice_1, t_1), (nice_2, t_2) = (map(float, f.stdout.split()) for f in (first, second))
    assert nice_1 == nice_2 == min(19, os.nice(0) + NICE) and t_1 < t_2  # nice(1) adds to the tests' own
    assert first.returncode == second.returncode == 0


def test_a_job_past_its_timeout_is_killed_and_one_never_started_runs_inline_at_the_tests_priority():
    jobs = EarlyJobs()
    try:
        jobs.start("hangs", lambda: Command([sys.executable, "-c", "import time; time.sleep(60)"], None, 0.5))
        started = time.monotonic()
        with pytest.raises(subprocess.TimeoutExpired):
            jobs.result("hangs", None)
        assert time.monotonic() - started < 30
        inline = jobs.result("never started", lambda: Command(PRINT_NICE, None, 60))
    finally:
        jobs.close()
    assert float(inline.stdout.split()[0]) == os.nice(0)


def test_closing_one_set_of_jobs_kills_its_own_job_and_no_other():
    """The session's jobs run while these tests make and close jobs of their own: a close reaches only its own."""
    session, other = EarlyJobs(), EarlyJobs()
    try:
        session.start("whole", lambda: Command([sys.executable, "-c", "import time; time.sleep(2); print('whole')"],
                                               None, 60))
        other.start("hangs", lambda: Command([sys.executable, "-c", "import time; time.sleep(60)"], None, 60))
        deadline = time.monotonic() + 30
        while not other._running and time.monotonic() < deadline:  # its job has started
            time.sleep(0.05)
        (killed,) = other._running
        other.close()
        assert killed.wait(10) != 0
        whole = session.result("whole", None)
    finally:
        session.close()
    assert whole.returncode == 0 and whole.stdout.strip() == "whole"
