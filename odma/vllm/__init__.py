"""odma inside vLLM: predicted-size contiguous KV runs and length-aware order as a vLLM scheduler.

    pip install -e ".[vllm]"        # into the environment that has vLLM
    python -m vllm.entrypoints.openai.api_server --model M --scheduler-cls odma.vllm.Scheduler \\
        --additional-config '{"odma": {"order": "adaptive", "stats_file": "odma-vllm.json"}}'

Settings: odma.vllm.config.PluginConfig (also ODMA_VLLM_<FIELD> in the environment). Without
`--scheduler-cls odma.vllm.Scheduler` nothing of odma is loaded into vLLM.

The parts that need no vLLM (runs, order, tagging, config) import without it; `Scheduler` imports vLLM when it is
first named.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name in ("Scheduler", "SyncScheduler", "AsyncScheduler"):
        from odma.vllm import scheduler

        return getattr(scheduler, name)
    raise AttributeError(f"module 'odma.vllm' has no attribute {name!r}")
