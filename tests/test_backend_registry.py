"""A new accelerator is one module in backends/ and one line in `backends.BACKENDS`: registered from a temporary
module here, a fake accelerator (host memory underneath, an accelerator's declarations) is parsed, opened and served
by the engine, whose device-dependent decisions (dtype defaults, attention, native layers, graphs, parallel pools, the
CLI's notice of a torch extension) follow its `Capabilities`, with no edit outside backends/. The declarations of the
real backends pin what CPU, CUDA and MLU decided before they were declarations (the GPU ones without a GPU)."""

from __future__ import annotations

import logging
import uuid

import pytest
import torch

from backends import BACKENDS, BackendError, Capabilities, CPUBackend, for_device, get_backend, parse_device
from backends.cuda import CUDABackend
from backends.mlu import MLUBackend
from odma.engine.config import EngineConfig
from odma.errors import ConfigError

FAKE_MODULE = '''
from dataclasses import replace

from backends import BackendError, Capabilities, CPUBackend


class FakeAccelerator(CPUBackend):
    """Host memory (the CPU's calls) behind an accelerator's declarations; records what the engine asked of it."""

    name = "fakeacc"
    capabilities = Capabilities(attention="triton", graphs=True)

    def __init__(self, index=0):
        self.index = index
        self.captures = 0

    def linear_kernel(self):
        raise AssertionError("asked for the host's GEMM: native layers are not this backend's")

    def decode_step(self):
        raise AssertionError("asked for the host's decode step: native layers are not this backend's")

    def capture_graph(self, fn):
        self.captures += 1
        fn()
        return fn  # a replay reruns the launches and returns their output


class NeedsExtension(FakeAccelerator):
    capabilities = Capabilities(torch_extension="fake_accelerator_runtime")

    def __init__(self, index=0):
        raise BackendError("fake_accelerator_runtime is not installed")


class HostVariant(CPUBackend):
    """The CPU with the native layers and KV widening declared off: what a tensor on the host is given follows it."""

    capabilities = replace(CPUBackend.capabilities, native_layers=False, widens_half_kv=False)
'''


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """The temporary module, registered as the devices fakeacc[:N] and needs-ext[:N] (one line each)."""
    name = f"fake_accelerator_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(FAKE_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(BACKENDS, "fakeacc", f"{name}:FakeAccelerator")
    monkeypatch.setitem(BACKENDS, "needs-ext", f"{name}:NeedsExtension")
    return name


def test_a_registered_kind_is_parsed_opened_and_declares_without_opening(fake):
    assert parse_device("fakeacc:1") == ("fakeacc", 1)
    cls = for_device("fakeacc:3")
    assert cls.__name__ == "FakeAccelerator" and cls.__module__ == fake
    backend = get_backend("fakeacc:2")
    assert type(backend) is cls and backend.index == 2
    assert for_device("needs-ext").capabilities.torch_extension == "fake_accelerator_runtime"  # nothing opened
    with pytest.raises(BackendError, match="not installed"):
        get_backend("needs-ext")


def test_the_registry_refuses_what_it_does_not_serve(monkeypatch):
    with pytest.raises(BackendError, match="cpu, cuda, mlu"):
        parse_device("tpu:0")
    with pytest.raises(BackendError, match="no backend serves device 'meta'"):
        for_device(torch.device("meta"))
    monkeypatch.setitem(BACKENDS, "broken", "backends.base:KVLayout")
    with pytest.raises(BackendError, match="names no Backend class"):
        for_device("broken")
    with pytest.raises(ConfigError, match="unknown device 'tpu'"):
        EngineConfig(device="tpu")
    with pytest.raises(BackendError, match="attention must be one of"):
        Capabilities(attention="flash")


def test_the_config_and_the_cli_take_their_defaults_from_the_declaration(fake, caplog):
    from odma.server.cli import build_parser, config_from_args, main

    assert config_from_args(build_parser().parse_args(["--device", "fakeacc:1"])).dtype == "bfloat16"
    assert config_from_args(build_parser().parse_args(["--device", "cpu"])).dtype == "float32"
    config = EngineConfig(device="fakeacc", dtype="bfloat16")
    assert config.resolved_kv_dtype == "bfloat16"  # the weights' dtype: no float16 default as on the host
    assert EngineConfig(device="cpu", dtype="bfloat16").resolved_kv_dtype == "float16"
    assert EngineConfig(devices=("fakeacc:0", "fakeacc:1")).parallel_devices_resolved
    assert not EngineConfig(devices=("cpu:0", "cpu:1")).parallel_devices_resolved
    threads = ["--threads", str(torch.get_num_threads())]  # main sets torch's threads: leave them as they are
    with caplog.at_level(logging.WARNING, logger="odma"):
        assert main(["--device", "needs-ext:0", "--model", "/nonexistent", *threads]) == 2  # it refuses to open
    assert "torch extension fake_accelerator_runtime" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="odma"):
        assert main(["--device", "tpu", *threads]) == 2
    assert "torch extension" not in caplog.text


def test_an_engine_on_a_new_accelerator_follows_its_declarations(fake, tmp_path):
    pytest.importorskip("triton")
    from backends.triton_attention import TritonAttention
    from odma.engine import SamplingParams
    from odma.engine.decode_graphs import buckets
    from odma.engine.testing import tiny_engine
    from odma.models.cpu_linear import KernelLinear, PackedLinear
    from odma.models.tiny import make_tiny_model

    folder = make_tiny_model(tmp_path / "qwen2", "qwen2")
    engine = tiny_engine(folder, device="fakeacc:1", kv_dtype=None, kv_budget="1MiB", max_num_seqs=4)
    worker = engine.workers[0]
    backend, runner = worker.backend, worker.runner
    assert type(backend).__name__ == "FakeAccelerator" and backend.index == 1
    assert isinstance(runner.attention, TritonAttention)  # attention "auto" is what the backend declares
    assert runner.layout.dtype == torch.float32  # KV in the weights' dtype, not the host's float16
    assert not any(isinstance(m, (PackedLinear, KernelLinear)) for m in engine.model.modules())
    assert engine.model.native_layers is None  # the model's own layers, not the host's C step
    assert runner.graphs is not None and runner.graphs.mode == "capture"  # decode graphs "auto": declared
    assert backend.captures == len(buckets(4))  # every bucket captured at start, through the backend's capture
    seqs = engine.generate([[5, 6, 7], list(range(10, 30)), [3]], SamplingParams(max_tokens=5, ignore_eos=True))
    assert [s.num_generated for s in seqs] == [5, 5, 5] and runner.graphs.replayed > 0  # decode steps replayed


def test_what_a_host_tensor_is_given_follows_the_cpu_line(fake, tmp_path, monkeypatch):
    """Packing linear layers, widening a float16 cache and serving a GGUF's blocks ask the backend of the tensor's
    device: with the registry's cpu line pointing at a variant, each follows the variant."""
    import odma.models.llama as llama
    from odma.models import load_model
    from odma.models.cpu_linear import linear_mode, onednn_linear_available, pack_linears
    from odma.models.llama import SeqSlot
    from odma.models.tiny import make_tiny_model
    from odma.models.weights import native_unavailable

    folder = make_tiny_model(tmp_path / "llama")
    model = load_model(folder)
    c = model.config
    read: list[torch.dtype] = []
    attend = llama._attend
    monkeypatch.setattr(llama, "_attend", lambda q, k, v, start: read.append(k.dtype) or attend(q, k, v, start))

    def cache_read_as() -> set[torch.dtype]:
        read.clear()
        kv = torch.zeros(c.num_layers, 2, 8, c.num_kv_heads, c.head_dim, dtype=torch.float16)
        with torch.inference_mode():
            model(torch.arange(4), torch.arange(4), [SeqSlot(kv, 0, 4)])
        return set(read)

    assert cache_read_as() == {torch.float32}  # the CPU widens its float16 cache
    assert "is not a GGUF file" in native_unavailable(str(folder), "float32", "cpu")
    monkeypatch.setitem(BACKENDS, "cpu", f"{fake}:HostVariant")
    assert type(get_backend("cpu")).__name__ == "HostVariant"
    assert cache_read_as() == {torch.float16}
    assert "runs on the CPU" in native_unavailable(str(folder), "float32", "cpu")
    assert pack_linears(model) == 0
    monkeypatch.setitem(BACKENDS, "cpu", "backends.cpu:CPUBackend")
    linears = sum(1 for m in model.modules() if type(m) is torch.nn.Linear)
    assert linears > 0
    assert pack_linears(model) == (linears if onednn_linear_available() and linear_mode() != "torch" else 0)


class _Declared(CPUBackend):
    """The CPU's memory calls with another backend's declarations (no GPU here)."""

    def __init__(self, capabilities: Capabilities) -> None:
        self.capabilities = capabilities


def test_the_real_backends_declare_what_was_decided_by_name():
    from odma.engine.model_runner import _graph_mode

    cpu, cuda, mlu = CPUBackend.capabilities, CUDABackend.capabilities, MLUBackend.capabilities
    assert (cpu.default_dtype, cpu.default_kv_dtype, cpu.attention) == ("float32", "float16", "native")
    assert cpu.native_layers and cpu.widens_half_kv and not cpu.graphs and not cpu.parallel_pools
    for accel in (cuda, mlu):
        assert (accel.default_dtype, accel.default_kv_dtype, accel.attention) == ("bfloat16", None, "triton")
        assert not accel.native_layers and not accel.widens_half_kv and accel.parallel_pools
        assert accel.supports_streams and accel.returns_memory_to_driver
    assert cuda.graphs and not mlu.graphs
    assert (cuda.torch_extension, mlu.torch_extension, cpu.torch_extension) == (None, "torch_mlu", None)
    assert [for_device(d) for d in ("cpu:1", "cuda", "mlu:0")] == [CPUBackend, CUDABackend, MLUBackend]
    assert [_graph_mode("auto", _Declared(caps)) for caps in (cpu, cuda, mlu)] == ["off", "capture", "off"]
    assert _graph_mode("static", _Declared(cuda)) == "static"
    assert EngineConfig(device="cuda:0", dtype="bfloat16").resolved_kv_dtype == "bfloat16"
    assert EngineConfig(device="mlu:1", dtype="float16").resolved_kv_dtype == "float16"


def test_attention_auto_runs_what_the_backend_declares(monkeypatch):
    pytest.importorskip("triton")
    from backends.triton_attention import TritonAttention

    asked = []
    monkeypatch.setattr(_Declared, "decode_attention", lambda self: asked.append(self) or "the native kernel")
    native = _Declared(CPUBackend.capabilities)
    assert native.attention("auto") == "the native kernel" and asked == [native]
    assert isinstance(_Declared(CUDABackend.capabilities).attention("auto"), TritonAttention)  # the interpreter
    assert _Declared(Capabilities(attention="sdpa")).attention("auto") is None
    assert native.attention("sdpa") is None and isinstance(native.attention("triton"), TritonAttention)
    assert len(asked) == 1
