"""The scheduler's policy, one frozen value (vLLM's `SchedulerConfig` plays the same part): what the engine's
`Scheduler` takes besides its memory (`KVManager`) and host swap buffer, which are runtime objects, not settings.

The engine makes it from its settings in one place (`EngineConfig.scheduler_config`, with the served model's
prefill cost); replays and benches build it from their own flags. `prefill_cost` has no default on purpose: a
scheduler that knows the model's shape budgets a chunk's attention over its context too, one that does not says
`PLAIN_TOKENS`, so the difference between the engine and a replay is written where the config is made. No torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from odma.engine.admission import AdmissionRule, admission_rules
from odma.engine.ordering import ORDERS
from odma.engine.prefill_cost import PrefillCost
from odma.errors import ConfigError

# under memory pressure a request that cannot grow: "wait" (stall until it can), "recompute" (the newest is preempted
# and redone later) or "swap" (preempted, its K/V kept in the host buffer: needs the scheduler's swapper)
PREEMPT_MODES = ("wait", "recompute", "swap")


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    max_num_seqs: int  # running requests at most (the decode batch cap)
    # what a prefill chunk costs of the step's budget: `PrefillCost.for_model(...)` where the model's shape is known,
    # `PLAIN_TOKENS` where it is not. Only chunked prefill reads it: whole prompts are budgeted in tokens
    prefill_cost: PrefillCost
    max_prefill_tokens: int = 2048  # prompt tokens a step prefills beside its decodes (its budget, in prefill_cost)
    preempt: str = "wait"  # one of PREEMPT_MODES
    order: str = "fcfs"  # the order of service (odma.engine.ordering): fcfs | sjf | adaptive
    lookahead: int = 16  # waiting requests an admission round considers
    max_skips: int = 8  # rounds a head-of-queue request may be bypassed before nobody overtakes it
    aging_rounds: int = 256  # sjf: rounds waited beyond the newest waiting request after which a request goes first
    # a long prompt is fed over several steps, at most max_prefill_tokens' worth a step, so running streams keep
    # getting tokens (False: a prompt is fed whole; one longer than the budget passes alone)
    chunk_prefills: bool = False
    # a head that holds the queue without a contiguous range gets one: the blocks in the emptiest range are relocated
    clear_window: bool = False
    # a prompt whose first tokens (at least this many) a running request holds copies their K/V; 0: off
    prefix_min_tokens: int = 0
    # eLLM Algorithm 1: admit while reservations stay within this share of the pool (1.0: no rule)
    admission_theta: float = 1.0
    # admit while the running requests' predicted final KV, plus the newcomer's, stays within this share of the
    # pool; None: no rule
    admission_demand: float | None = None
    # admission rules beyond those two (odma.engine.admission.AdmissionRule), as factories: each scheduler calls
    # them once for rules of its own (a rule keeps per-round state); asked before θ and demand
    custom_admission: tuple[Callable[[], AdmissionRule], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.prefill_cost, PrefillCost):
            raise ConfigError(f"prefill_cost must be a PrefillCost (PLAIN_TOKENS: tokens only), got {self.prefill_cost!r}")
        if self.preempt not in PREEMPT_MODES:
            raise ConfigError(f"preempt must be one of {PREEMPT_MODES}, got {self.preempt!r}")
        if self.order not in ORDERS:
            raise ConfigError(f"schedule must be one of {ORDERS}, got {self.order!r}")
        for name in ("max_num_seqs", "max_prefill_tokens", "lookahead"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_skips", "aging_rounds"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.prefix_min_tokens < 0:
            raise ConfigError(f"prefix_min_tokens must be >= 0 (0: off), got {self.prefix_min_tokens}")
        if not all(callable(make) for make in self.custom_admission):
            raise ConfigError("custom_admission holds rule factories (a rule class, say), not rules")
        try:
            admission_rules(self.admission_theta, self.admission_demand)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def admission_rules(self) -> list[AdmissionRule]:
        """Fresh admission rules for one scheduler, in the order it asks them: the custom ones, then θ and demand."""
        return [make() for make in self.custom_admission] + admission_rules(self.admission_theta, self.admission_demand)
