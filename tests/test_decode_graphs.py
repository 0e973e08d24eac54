"""Decode steps as static batches (odma/engine/decode_graphs.py): the tokens of the eager path, through buckets padded
with empty requests, blocks that move, swaps, pages and mapped memory; and what makes a batch capturable as a CUDA
graph, checked on CPU: every launch of a bucket takes the same arguments whatever the step (tensors at the same
addresses, the same scalars), and the forward neither builds tensors from host values nor waits for the device.
The capture itself (torch.cuda.CUDAGraph) runs only on a GPU (scripts/gpu_check.sh); here a capture that fails
must leave the step to run eagerly."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from backends import triton_attention  # noqa: E402
from odma.engine import SamplingParams  # noqa: E402
from odma.engine.decode_graphs import buckets  # noqa: E402
from odma.engine.testing import tiny_engine  # noqa: E402
from odma.models.tiny import make_tiny_model  # noqa: E402
from test_engine_triton import DEVICE, GREEDY, PROMPTS, pytestmark  # noqa: E402,F401 (the same engine runs)


def _backend_class():
    """The class of the backend the engine opens on DEVICE (CPU in CI, CUDA on a GPU), whose capture is faked."""
    from odma.engine.llm_engine import open_backend

    return type(open_backend(DEVICE))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("qwen2"), "qwen2")


@pytest.fixture(scope="module")
def reference(folder):
    return [s.output_ids for s in tiny_engine(folder, kv_budget="1MiB").generate(PROMPTS, GREEDY)]


def test_buckets_cover_every_batch_size():
    assert buckets(1) == [1] and buckets(5) == [1, 2, 4, 5] and buckets(20) == [1, 2, 4, 8, 16, 20]
    assert buckets(128)[-3:] == [112, 120, 128] and len(buckets(128)) == 19


@pytest.mark.parametrize("policy", ["odma", "paged"])
def test_static_batches_give_the_eager_paths_tokens(folder, reference, policy):
    engine = tiny_engine(folder, kv_budget="1MiB", attention="triton", policy=policy, decode_graphs="static",
                         device=DEVICE, max_num_seqs=8)
    graphs = engine.workers[0].runner.graphs
    assert graphs is not None and graphs.mode == "static"
    seqs = engine.generate(PROMPTS, GREEDY)
    assert [s.output_ids for s in seqs] == reference
    assert graphs.replayed >= GREEDY.max_tokens - 2  # every decode step after the prompts went through a batch
    assert set(graphs._replays) <= set(buckets(8)) and 8 in graphs._replays  # 5 requests padded to 8


def test_requests_reading_a_shared_prefix_in_place_decode_through_the_batches(folder):
    """prefix_reads: every batch reads piece tables; a request reading its first rows from a holder's block (the
    holder ended: shrunk in place) decodes through them, beside one that reads only its own block."""
    base = list(range(60, 80))
    prompts = [base + [1], base + [1, 2, 3, 4, 5, 6, 7, 8], [5, 6, 7]]
    engine = tiny_engine(folder, kv_budget="1MiB", attention="triton", decode_graphs="static", device=DEVICE,
                         max_num_seqs=8, prefix_reads=True)
    graphs = engine.workers[0].runner.graphs
    assert graphs.pieces == 8
    first = engine.add_request(prompts[0], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    engine.step()
    later = [engine.add_request(p, GREEDY) for p in prompts[1:]]
    engine.step()  # the reader's prompt is mapped from the first, which ends
    assert first.finished and later[0].kv.pieces and not later[1].kv.pieces
    replayed = graphs.replayed
    while engine.has_work():
        engine.step()
    assert graphs.replayed - replayed >= GREEDY.max_tokens - 2  # the reader's decode steps went through batches
    alone = tiny_engine(folder, kv_budget="1MiB").generate(prompts[1:], GREEDY)
    assert [s.output_ids for s in later] == [s.output_ids for s in alone]
    assert engine.pool.stats().live_blocks == 0


def test_blocks_that_move_and_swap_are_refilled_every_step(folder, reference):
    engine = tiny_engine(folder, kv_budget="32KiB", attention="triton", policy="s3", s3_buckets=16, predicted=1,
                         preempt="swap", align=4, decode_graphs="static", device=DEVICE)
    seqs = engine.generate(PROMPTS, GREEDY)
    counters, stats = engine.scheduler.counters, engine.pool.stats()
    assert stats.migrations > 0 and counters.preemptions > 0 and counters.swap_ins > 0
    assert [s.output_ids for s in seqs] == reference
    assert engine.workers[0].runner.graphs.replayed > 0


@pytest.mark.skipif(DEVICE != "cpu", reason="the host's virtual memory")
def test_mapped_memory_through_static_batches(folder, reference):
    longer = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)  # past the first 32-token step
    expected = [s.output_ids for s in tiny_engine(folder, kv_budget="1MiB").generate(PROMPTS[:3], longer)]
    engine = tiny_engine(folder, kv_budget="64KiB", kv_growth="map", attention="triton", policy="s3", s3_buckets=16,
                         predicted=1, align=32, decode_graphs="static")
    assert type(engine.workers[0].kv).__name__ == "MappedKV"
    seqs = engine.generate(PROMPTS[:3], longer)
    assert [s.output_ids for s in seqs] == expected
    assert engine.workers[0].kv.counters()["growths_by_mapping"] > 0


def test_a_failed_capture_runs_the_batch_eagerly(folder, reference, monkeypatch, caplog):

    def refuse(self, fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(_backend_class(), "capture_graph", refuse)
    engine = tiny_engine(folder, kv_budget="1MiB", attention="triton", decode_graphs="capture", device=DEVICE,
                         max_num_seqs=8)
    seqs = engine.generate(PROMPTS, GREEDY)
    assert [s.output_ids for s in seqs] == reference
    graphs = engine.workers[0].runner.graphs
    assert graphs.capture_failures >= 1 and graphs.captured == 0 and "runs eagerly" in caplog.text


def test_auto_captures_only_on_cuda(folder):
    engine = tiny_engine(folder, kv_budget="1MiB", attention="triton", device=DEVICE)
    graphs = engine.workers[0].runner.graphs
    assert (graphs is not None and graphs.mode == "capture") if DEVICE == "cuda" else graphs is None
    assert tiny_engine(folder, kv_budget="1MiB", attention="triton", decode_graphs="off",
                       device=DEVICE).workers[0].runner.graphs is None


def _recording(attention, persistent: list[torch.Tensor]):
    """Wrap the kernels module: every launch's grid and arguments. A tensor inside one of the `persistent` buffers
    (the arena, the static batch, the rotary table) is its address; any other is an activation the forward made,
    which a graph's memory pool keeps at one address, so only its shape, strides and dtype count."""
    kernels = attention.kernels
    launches: list[tuple] = []
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in persistent]

    def key(a):
        if not isinstance(a, torch.Tensor):
            return a
        if any(lo <= a.data_ptr() < hi for lo, hi in spans):
            return ("buffer", a.data_ptr(), tuple(a.shape), a.stride())
        return ("activation", tuple(a.shape), a.stride(), a.dtype)

    class Recording:
        def __getattr__(self, name):
            kernel = getattr(kernels, name)

            class Launcher:
                def __getitem__(self, grid):
                    def launch(*args, **kwargs):
                        launches.append((name, grid, tuple(map(key, args)), tuple(sorted(kwargs.items()))))
                        return kernel[grid](*args, **kwargs)
                    return launch
            return Launcher()

    attention.kernels = Recording()
    return launches


def test_a_bucket_launches_the_same_arguments_every_step_and_never_syncs(folder):
    """What a CUDA graph replays is what the first capture saw: so every step of a bucket must launch its kernels
    with identical arguments, and the forward must not read host values (torch.tensor) or device values (.item())."""
    from torch.utils._python_dispatch import TorchDispatchMode

    engine = tiny_engine(folder, kv_budget="1MiB", attention="triton", decode_graphs="static", device=DEVICE,
                         max_num_seqs=4)
    runner = engine.workers[0].runner
    graphs = runner.graphs
    launches = _recording(runner.attention, [runner.arena.storage, graphs.static._dev, runner.model.rotary.table(1)])
    forbidden: list[str] = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__ in ("lift_fresh.default", "_local_scalar_dense.default"):
                forbidden.append(func.__name__)
            return func(*args, **(kwargs or {}))

    replay = graphs._record

    def watched(bucket):
        forward = replay(bucket)

        def run():
            with Watch():
                return forward()
        graphs._replays[bucket] = run
        return run

    graphs._record = watched
    seqs = [engine.add_request(p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
            for p in ([1, 2, 3], list(range(40, 60)), [7] * 9)]
    per_step = []
    while engine.has_work():
        before = len(launches)
        engine.step()
        if graphs.replayed and len(launches) > before:
            per_step.append((graphs.replayed, launches[before:]))
    assert all(s.num_generated == 6 for s in seqs)
    batches = [ls for _, ls in per_step if len(ls) == len(per_step[-1][1])]
    assert len(batches) >= 3  # several steps of the same bucket (4), contexts growing, blocks elsewhere
    assert all(b == batches[0] for b in batches[1:]), "a bucket's launches changed between steps"
    assert not forbidden, f"the static forward built or read host values: {forbidden}"


@pytest.mark.parametrize("policy", ["odma", "paged"])
def test_capture_records_every_bucket_at_start_and_replays_them(folder, reference, monkeypatch, policy):
    """A backend whose capture works (here: one that reruns the recorded function, as a replay reruns launches):
    every bucket is recorded before the first request, largest first, on padding (paged: an empty page table),
    and decode steps replay them."""

    recorded = []

    def capture(self, fn):
        fn(), fn()
        recorded.append(fn)
        return fn

    monkeypatch.setattr(_backend_class(), "capture_graph", capture)
    engine = tiny_engine(folder, kv_budget="1MiB", attention="triton", decode_graphs="capture", device=DEVICE,
                         max_num_seqs=8, policy=policy)
    graphs = engine.workers[0].runner.graphs
    assert graphs.captured == len(recorded) == len(buckets(8)) and list(graphs._replays) == [8, 4, 2, 1]
    seqs = engine.generate(PROMPTS, GREEDY)
    assert [s.output_ids for s in seqs] == reference and len(recorded) == len(buckets(8))


def test_triton_runs_only_where_its_backend_is_the_devices(monkeypatch):
    """Stock Triton on a Cambricon host compiles for no MLU: auto must not pick the kernels there."""
    from types import SimpleNamespace

    mlu, cuda = SimpleNamespace(type="mlu"), SimpleNamespace(type="cuda")
    monkeypatch.setattr(triton_attention, "active_backend", lambda: "cuda")
    assert "not one that compiles for mlu" in triton_attention.available(mlu)
    assert triton_attention.available(cuda) is None
    monkeypatch.setattr(triton_attention, "active_backend", lambda: "mlu")
    assert triton_attention.available(mlu) is None and triton_attention.available(cuda) is not None
    monkeypatch.setattr(triton_attention, "active_backend", lambda: None)
    assert "none" in triton_attention.available(cuda)
