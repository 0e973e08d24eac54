"""Fixtures shared by the probe tests (a tiny served model with SmolLM2's tokenizer, and answers for it) and the
server tests (the tiny model folder they serve), and the slow subprocess checks started as the session starts
(`early_jobs`). Also: without a CUDA device, Triton's kernels run in its interpreter on CPU tensors (set before
anything imports triton)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

FIXTURE = Path(__file__).resolve().parent.parent / "datasets" / "fixtures" / "predictor_tiny.jsonl"


@pytest.fixture(scope="session", autouse=True)
def early_jobs(request, tmp_path_factory):
    """The selected modules' slow subprocess checks, started now in the background (tests/early_jobs.py)."""
    from early_jobs import EarlyJobs

    # fixed here, before the jobs' thread: pytest creates its base folder on first use without a lock, and two
    # threads creating it at once each get their own (mktemp then refuses a path outside the one it now holds)
    tmp_path_factory.getbasetemp()
    jobs = EarlyJobs()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # every worker collects every test but runs only the modules it is handed: a job started here could run
        # in both workers, for tests the other one runs; the worker that runs them runs their job inline instead,
        # beside the other worker's tests
        yield jobs
        jobs.close()
        return
    wanted: dict[str, set[str]] = {}  # module name → fixtures its selected tests use
    modules = {}
    for item in request.session.items:
        if getattr(item, "module", None) is not None:
            modules[item.module.__name__] = item.module
            wanted.setdefault(item.module.__name__, set()).update(getattr(item, "fixturenames", ()))
    for name in sorted(modules):  # the suite's own order: the earliest module's job first
        offer = getattr(modules[name], "start_early", None)
        for job, (fixture, prepare) in (offer(tmp_path_factory) if offer else {}).items():
            if fixture in wanted[name]:  # a selected test waits for it
                jobs.start(job, prepare)
    yield jobs
    jobs.close()


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """`odma.server.testing.tiny_model_folder`, once per test module: what `tiny_server` serves."""
    from odma.server.testing import tiny_model_folder

    return tiny_model_folder(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer (and chat template) as the served model."""
    from odma.models.tiny import make_tiny_model
    from odma.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2").hf
    folder = tmp_path_factory.mktemp("served")
    make_tiny_model(folder, vocab_size=len(tok), tie_word_embeddings=True,
                    eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    tok.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    """The tiny predictor fixture with answer texts whose length follows the prompt's kind."""
    rng = random.Random(0)
    rows = []
    for line in FIXTURE.read_text().splitlines():
        r = json.loads(line)
        r["output"] = " ".join(rng.choice(["river", "stone", "light"]) for _ in range(max(2, r.pop("output_tokens") // 8)))
        rows.append(r)
    path = tmp_path_factory.mktemp("trace") / "answers.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def pytest_collection_modifyitems(session, config, items):
    """Under pytest-xdist (`-n 2 --dist loadfile`, README's test command), the modules whose slow subprocess checks
    would have started early go first: their jobs then run inline while the other worker takes the rest, instead
    of leaving one worker alone with them at the end. Every worker sorts alike (xdist requires the same order)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: not hasattr(getattr(item, "module", None), "start_early"))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The same line at the end of the run, where `pytest -q` (which hides the header) shows it too."""
    terminalreporter.write_line(pytest_report_header(config))


def pytest_report_header(config):
    """The CPU GEMM paths this run tests: the kernel tests run once per instruction set this CPU runs (their ids
    name it), so a log says which path a CI machine exercised."""
    from backends import ckernels, cpu_linear, cpu_quant

    paths = []
    for isa in ckernels.ISAS:
        try:
            kernel = cpu_linear.load(isa) if ckernels.isa_runs_here(isa) else None
            quant = cpu_quant.load(isa) if kernel else None
        except Exception as exc:  # noqa: BLE001 - a header must not stop the run; the tests report the failure
            paths.append(f"{isa}: {exc}")
            continue
        int8 = f", int8 {quant.int8}" if quant else ""
        paths.append(f"ODMA_CPU_ISA={isa}: " + (f"{kernel.isa} (bf16 {kernel.bf16}{int8})" if kernel else "no kernel"))
    return "odma CPU GEMM paths: " + "; ".join(paths)
