"""Builds the CPU backend's C kernels (csrc/) with the system compiler, once per source, flags and CPU.

A library is compiled for this CPU (-march=native; the portable flags where the compiler refuses it) into
$ODMA_CACHE_DIR/kernels, keyed by the source, the flags, the compiler and the CPU's feature flags, and loaded by
ctypes. A build is written beside its target and renamed, so concurrent first starts never load a half-written
library.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Generic, TypeVar

T = TypeVar("T")

CSRC = Path(__file__).parent / "csrc"
# compile with -ffast-math, link without: linking with it adds crtfastmath.o, whose constructor turns on
# flush-to-zero for the whole process (Python then parsed 5e-324 as 0.0, and every float op lost its denormals)
LINK_FLAGS = ("-shared",)


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


def kernel_dir() -> Path:
    """Where built kernels are kept: kernels/ under $ODMA_CACHE_DIR, else under ~/.cache/odma (the folder odma
    caches into; read from the environment here, because backends know nothing of odma)."""
    env = os.environ.get("ODMA_CACHE_DIR")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "odma") / "kernels"


def build(source: Path, flags: tuple[str, ...], link: tuple[str, ...] = ()) -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    text = source.read_bytes()
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
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[:500]}")
        os.replace(tmp, target)
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)
    return target


def _cpu_signature() -> bytes:
    """What -march=native depends on: a library built on one CPU must not be loaded on another."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return (platform.machine() + platform.processor() + flags).encode()
