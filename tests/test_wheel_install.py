"""The wheel, installed the way a user installs it, serves: `pip wheel` builds it from a copy of the sources, a fresh
virtualenv gets it without `-e`, and its own `odma-serve`, started outside the repository, compiles the CPU kernels
it ships (backends/csrc, headers included) into an empty cache and answers a request through native GGUF weights.

The fresh virtualenv reaches the heavy dependencies (torch, transformers, ...) of the running one through a .pth
line naming that one's site-packages; that line adds a folder to sys.path and nothing more (the running
environment's editable odma is installed by a .pth hook, which a folder added this way never runs), and the fresh
environment's own site-packages comes first: odma, backends and predictor come from the wheel alone, as the test
asserts. Needs a C compiler (the kernels are built at run time). Most of the time is the compiler's: four kernels,
quant_linear.c the longest (38 s alone on 2 cores at a load of 7); a compile may take ODMA_CC_TIMEOUT seconds
(default 600), and one past it fails the start with the compiler's timeout in the server log shown.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from backends.ckernels import isa_runs_here
from odma.server.threaded import free_port

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
COMPILER = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
# what the native CPU path builds on its first request (backends/ckernels.py names each library <source>-<key>.so)
NATIVE_KERNELS = {"quant_linear", "linear", "decode_step", "decode_attention"}
# not the sources a wheel is built from: version control, environments, caches, earlier build outputs
NOT_SOURCES = shutil.ignore_patterns(".*", "__pycache__", "*.pyc", "*.so", "build", "dist", "*.egg-info", "runs")


def package_dirs() -> list[str]:
    """The top-level packages pyproject.toml ships ([tool.setuptools.packages.find] include patterns)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["packages"]["find"]["include"]
    return sorted({p.rstrip("*").rstrip(".") for p in patterns})


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip wheel` builds from a copy of the repository (an in-tree build would write build/ and
    *.egg-info into the checkout); offline: no build isolation, no dependencies."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "src"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCES, symlinks=True)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                           "--no-index", "-q", "-w", str(work / "dist")], capture_output=True, text=True, timeout=300,
                          cwd=work)
    assert done.returncode == 0, done.stdout + done.stderr
    (built,) = (work / "dist").glob("odma-*.whl")
    return built


def test_the_wheel_ships_every_file_of_its_packages(wheel):
    """Every file under the shipped packages (C sources and the headers they include, the default predictors'
    weights, ...) is in the wheel: a runtime build or load reads them from the installed package."""
    in_wheel = {n for n in zipfile.ZipFile(wheel).namelist() if ".dist-info/" not in n}
    sources = {p.relative_to(ROOT).as_posix() for d in package_dirs() for p in (ROOT / d).rglob("*")
               if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".so")}
    assert {"backends/csrc/panel.h", "predictor/default/sklearn/model.joblib"} <= sources  # the walk sees them
    left_out, strays = sorted(sources - in_wheel), sorted(in_wheel - sources)
    assert not left_out, f"files the wheel leaves out: {left_out}"
    assert not strays, f"files in the wheel that are no source: {strays}"


def byte_level_vocabulary(w) -> None:
    """A GGUF tokenizer for `make_tiny_gguf(..., vocab_size=257)`: GPT-2's 256 byte symbols (id = byte) and one
    merge, so transformers reads it as a byte-level BPE (it wants at least one merge)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    symbols, shifted = [], 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([*symbols, "he"])
    w.add_token_types([1] * 257)
    w.add_token_merges(["h e"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def fresh_venv(folder: Path, wheel: Path) -> Path:
    """A virtualenv at `folder` with `wheel` installed (not editable) and the running environment's site-packages
    behind its own: its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=120)
    python = folder / "bin" / "python"
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                           "-q", str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    running = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(site) / "running_env.pth").write_text("".join(f"{p}\n" for p in sorted(running)))
    return python


@pytest.mark.skipif(COMPILER is None, reason="no C compiler (cc/gcc): the CPU kernels are built at run time")
@pytest.mark.skipif(not isa_runs_here("avx2"), reason="native GGUF weights need AVX-512 or AVX2 + FMA + F16C")
def test_the_installed_wheel_serves_through_the_kernels_it_compiles(wheel, tmp_path):
    from odma.models.tiny import make_tiny_gguf

    python = fresh_venv(tmp_path / "venv", wheel)
    elsewhere = tmp_path / "cwd"  # not the repository: its folders would be importable from the working directory
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "ODMA_CPU_KERNELS",
                                                              "ODMA_CPU_ISA", "ODMA_CPU_STEP", "ODMA_CPU_LINEAR")}
    env.update(ODMA_CACHE_DIR=str(tmp_path / "cache"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    where = subprocess.run([str(python), "-c", "import odma, backends, predictor; "
                            "print(odma.__file__, backends.__file__, predictor.__file__, sep='\\n')"],
                           capture_output=True, text=True, cwd=elsewhere, env=env, timeout=120)
    assert where.returncode == 0, where.stderr
    for path in where.stdout.split():
        assert Path(path).is_relative_to(tmp_path / "venv"), f"{path} is not the wheel's"

    model = make_tiny_gguf(tmp_path / "tiny.gguf", "llama", metadata=byte_level_vocabulary, vocab_size=257)
    port = free_port(below_ephemeral=True)  # bound only after the kernels compile: no ephemeral port takes it
    log = tmp_path / "serve.log"
    cmd = [str(python.parent / "odma-serve"), "--model", str(model), "--weights", "native", "--predictor", "sklearn",
           "--length-log", "", "--kv-budget", "8MiB", "--threads", "1", "--port", str(port)]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=elsewhere, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"odma-serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"odma-serve did not start:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
        reply = httpx.post(url + "/v1/completions", timeout=60,
                           json={"model": "default", "prompt": "hello", "max_tokens": 6, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 6
        metrics = httpx.get(url + "/metrics", timeout=10).text
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    text = log.read_text()
    # the weights were the GGUF's own blocks, multiplied by the kernel the wheel's sources compiled
    assert re.search(r"engine: weights native .*linear layers: \d+ odma \w+ quantized", text), text[-3000:]
    built = {p.name.rsplit("-", 1)[0] for p in (tmp_path / "cache" / "kernels").glob("*.so")}
    assert NATIVE_KERNELS <= built, text[-3000:]
    assert "unavailable" not in text, text[-3000:]  # no kernel fell back to torch
    assert 'odma_predictor_info{fallback="0",name="sklearn"' in metrics  # the wheel's default predictor files
