"""Builds the CPU backend's C kernels (csrc/) with the system compiler, once per source, flags and CPU.

A library is compiled for this CPU (-march=native; the portable flags where the compiler refuses it) into
$ODMA_CACHE_DIR/kernels, keyed by the source (with csrc/'s headers), the flags, the compiler and the CPU's feature
flags, and loaded by ctypes. A build is written beside its target and renamed, so concurrent first starts never
load a half-written library.

The GEMM kernels come in two instruction sets (csrc/panel.h): `ODMA_CPU_ISA=auto` (default) builds them for this
CPU (AVX-512 where it has it, else AVX2 + FMA), `ODMA_CPU_ISA=avx2` for x86-64-v3 (AVX2, FMA, F16C) whatever the
CPU has beyond it: the path an AVX2-only CPU runs, built, tested and measured on an AVX-512 one.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Generic, TypeVar

from backends.errors import BackendError

T = TypeVar("T")

CSRC = Path(__file__).parent / "csrc"
# compile with -ffast-math, link without: linking with it adds crtfastmath.o, whose constructor turns on
# flush-to-zero for the whole process (Python then parsed 5e-324 as 0.0, and every float op lost its denormals)
LINK_FLAGS = ("-shared",)
ISA_VARIABLE = "ODMA_CPU_ISA"
ISAS = ("auto", "avx2")
# -ffp-contract=off: a product and a sum written apart stay apart (a GGUF block's w = d * q + m is rounded twice, as
# the reference dequantization rounds it); the FMAs are written as FMAs
_ISA_FLAGS = {"auto": ("-O3", "-march=native", "-ffp-contract=off"),
              "avx2": ("-O3", "-march=x86-64-v3", "-mtune=native", "-ffp-contract=off")}
_AVX2_FEATURES = ("avx2", "fma", "f16c")


def disabled() -> bool:
    """ODMA_CPU_KERNELS=0 turns every C kernel off (torch's own ops run instead)."""
    return os.environ.get("ODMA_CPU_KERNELS", "1") == "0"


def load_library(source: Path, flag_sets: tuple[tuple[str, ...], ...], link: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The first of `flag_sets` that builds and loads; RuntimeError with every attempt's reason otherwise.
    link: extra linker arguments (libraries) after the object."""
    errors = []
    for flags in flag_sets:
        try:
            return ctypes.CDLL(str(build(source, flags, link)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            errors.append(str(e))
    raise RuntimeError("; ".join(errors))


class Loader(Generic[T]):
    """Builds and wraps a kernel library on the first call, once per process; every later call answers the same
    (None where it could not be built: the reason logged once, with what runs instead)."""

    def __init__(self, source: Path, flag_sets: tuple[tuple[str, ...], ...], wrap: Callable[[ctypes.CDLL], T],
                 what: str, fallback: str, link: tuple[str, ...] = (), level: int = logging.WARNING) -> None:
        self.source, self.flag_sets, self.wrap, self.link = source, flag_sets, wrap, link
        self.what, self.fallback, self.level = what, fallback, level
        self._loaded: T | None = None
        self._tried = False

    def __call__(self) -> T | None:
        if self._tried:
            return self._loaded
        self._tried = True
        log = logging.getLogger(__name__)
        if disabled():
            log.info("%s disabled by ODMA_CPU_KERNELS=0; %s", self.what, self.fallback)
            return None
        try:
            self._loaded = self.wrap(load_library(self.source, self.flag_sets, self.link))
        except RuntimeError as e:
            log.log(self.level, "%s unavailable (%s); %s", self.what, e, self.fallback)
        return self._loaded


def requested_isa() -> str:
    """ODMA_CPU_ISA, checked: a typo must not silently build another kernel."""
    value = os.environ.get(ISA_VARIABLE, "auto").strip().lower() or "auto"
    if value not in ISAS:
        raise BackendError(f"{ISA_VARIABLE}={value!r}: expected one of {', '.join(ISAS)}")
    return value


def cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def isa_runs_here(isa: str) -> bool:
    """Whether this CPU can run a build for `isa` (auto: always, it is built for this CPU)."""
    return isa == "auto" or (platform.machine() in ("x86_64", "AMD64") and set(_AVX2_FEATURES) <= cpu_flags())


class IsaLoader(Generic[T]):
    """A kernel library built per instruction set (`ISAS`): one Loader each, on demand. Calling it answers the
    kernel for `isa` (default: ODMA_CPU_ISA's) or None; BackendError for an ISA this CPU cannot run."""

    def __init__(self, source: Path, wrap: Callable[[ctypes.CDLL], T], what: str, fallback: str,
                 level: int = logging.WARNING) -> None:
        self.source, self.wrap, self.what, self.fallback, self.level = source, wrap, what, fallback, level
        self._loaders: dict[str, Loader[T]] = {}

    def loader(self, isa: str) -> Loader[T]:
        if isa not in ISAS:
            raise BackendError(f"unknown instruction set {isa!r}: expected one of {', '.join(ISAS)}")
        if not isa_runs_here(isa):
            raise BackendError(f"{ISA_VARIABLE}={isa}: this CPU lacks {', '.join(_AVX2_FEATURES)}")
        if isa not in self._loaders:
            flags = _ISA_FLAGS[isa]
            # with OpenMP, then without (a compiler that has none); -fPIC for the shared library
            sets = (flags + ("-fopenmp", "-fPIC"), flags + ("-fPIC",))
            what = self.what if isa == "auto" else f"{self.what} ({isa})"
            self._loaders[isa] = Loader(self.source, sets, self.wrap, what, self.fallback, level=self.level)
        return self._loaders[isa]

    def __call__(self, isa: str | None = None) -> T | None:
        return self.loader(isa or requested_isa())()


def kernel_dir() -> Path:
    """Where built kernels are kept: kernels/ under $ODMA_CACHE_DIR, else under ~/.cache/odma (the folder odma
    caches into; read from the environment here, because backends know nothing of odma)."""
    env = os.environ.get("ODMA_CACHE_DIR")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "odma") / "kernels"


def build(source: Path, flags: tuple[str, ...], link: tuple[str, ...] = ()) -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    recipe = " ".join(flags) + " | link: " + " ".join(LINK_FLAGS + link)
    key = hashlib.sha256(text + recipe.encode() + compiler.encode() + _cpu_signature()).hexdigest()[:16]
    target = kernel_dir() / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    obj = tmp + ".o"
    try:
        for cmd in ([compiler, *flags, "-c", "-o", obj, str(source)], [compiler, *LINK_FLAGS, "-o", tmp, obj, *link]):
            returncode, stderr = _compile(cmd)
            if returncode != 0:
                raise RuntimeError(f"{compiler} failed: {stderr.strip()[:500]}")
        os.replace(tmp, target)
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)
    return target


def compile_timeout() -> float:
    """Seconds one compiler call may take ($ODMA_CC_TIMEOUT, default 600: a loaded 2-core machine took over 120 s
    for quant_linear.c)."""
    raw = os.environ.get("ODMA_CC_TIMEOUT", "600")
    try:
        seconds = float(raw)
    except ValueError:
        raise BackendError(f"ODMA_CC_TIMEOUT={raw!r}: expected a number of seconds") from None
    if seconds <= 0:
        raise BackendError(f"ODMA_CC_TIMEOUT={raw!r}: expected a positive number of seconds")
    return seconds


def _compile(cmd: list[str]) -> tuple[int, str]:
    """Runs one compiler call in a process group of its own, so a timeout ends the driver's children (cc1, as)
    too, not only the driver."""
    limit = compile_timeout()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RuntimeError(f"{cmd[0]} took longer than {limit:g} s (ODMA_CC_TIMEOUT)") from None
    return proc.returncode, stderr


def _cpu_signature() -> bytes:
    """What -march=native depends on: a library built on one CPU must not be loaded on another."""
    return (platform.machine() + platform.processor() + " ".join(sorted(cpu_flags()))).encode()
