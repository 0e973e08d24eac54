"""What a prefill chunk costs of a step's prompt budget: its tokens, plus their attention over the context already
cached, counted in tokens' worth of linear-layer work. A chunk late in a long prompt attends to everything before
it: on one core, 256 prompt tokens took 0.3 s at the start of an 8,000-token prompt and 2.0 s at its end, so a
budget in plain tokens still froze the running streams for seconds. No torch: the scheduler's arithmetic."""

from __future__ import annotations

import math
from dataclasses import dataclass

# Prefill attention's FLOP rate relative to the linear layers' GEMMs: 0.45 on one Zen 5 core (SmolLM2-135M, fp32,
# 256-token chunks: 180 GFLOP/s in the GEMMs, 81 in attention at 8K context), rounded.
ATTENTION_RATE = 0.5


@dataclass(frozen=True, slots=True)
class PrefillCost:
    # the context length at which one prompt token's attention costs as much as its linear layers; None: a chunk
    # costs its tokens only
    span: float | None = None

    @classmethod
    def for_model(cls, config) -> "PrefillCost":
        """From an `odma.models.ModelConfig`: per layer, one token's linear layers take 2 FLOPs per weight and its
        attention 4·heads·head_dim per cached position (q·k and p·v), run at ATTENTION_RATE of the GEMMs' speed."""
        q_width, kv_width = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        weights = config.hidden_size * (2 * q_width + 2 * kv_width) + 3 * config.hidden_size * config.intermediate_size
        return cls(span=ATTENTION_RATE * 2 * weights / (4 * q_width))

    def __call__(self, start: int, tokens: int) -> float:
        """The cost of feeding prompt positions [start, start + tokens)."""
        if self.span is None or tokens <= 0:
            return max(tokens, 0)
        return tokens * (1 + (start + (tokens - 1) / 2) / self.span)

    def fit(self, start: int, want: int, budget: float) -> int:
        """The most of `want` tokens from `start` whose cost stays within `budget` (0 when not even one fits)."""
        if budget <= 0 or want <= 0:
            return 0
        if self.span is None:
            return min(want, int(budget))
        # cost(q) = q²/(2·span) + q·(1 + (start − ½)/span), increasing in q: the root of cost(q) = budget
        b = 1 + (start - 0.5) / self.span
        q = int(self.span * (math.sqrt(b * b + 2 * budget / self.span) - b))
        q = min(want, max(q, 0))
        while q < want and self(start, q + 1) <= budget:  # the root's float error, either way
            q += 1
        while q > 0 and self(start, q) > budget:
            q -= 1
        return q


# a chunk costs its tokens only: the budget of a scheduler that knows no model shape (replays on a step-time model)
PLAIN_TOKENS = PrefillCost()
