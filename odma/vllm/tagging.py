"""What odma knows about a vLLM request's length (no vLLM): the text predictor's L̂ and u at arrival, the
output tokens its calibrated bucket reserves, and what finished requests teach (the bucket bounds re-derive
from realized lengths; a predictor that learns, as the running-median fallback does, is told each one).

vLLM's engine core sees token ids, not text: the prompt is decoded with the served model's tokenizer and, for a
chat prompt, reduced to its last user turn (what the predictor was trained to read).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

from odma.config import BucketConfig, PoolConfig
from odma.engine.length_predictor import LoadedPredictor
from odma.kv import KVRequest, build_policy
from predictor.base import PredictRequest
from predictor.serving import ServedPredictor


# ChatML (SmolLM2, Qwen) and Llama-3 user turns
_USER_TURN = re.compile(r"<\|im_start\|>user\n(.*?)(?:<\|im_end\|>|$)"
                        r"|<\|start_header_id\|>user<\|end_header_id\|>\n\n(.*?)(?:<\|eot_id\|>|$)", re.S)


def user_text(decoded: str) -> str:
    """The last user turn of a chat-templated prompt, else the whole text."""
    turns = _USER_TURN.findall(decoded)
    if not turns:
        return decoded
    a, b = turns[-1]
    return (a or b).strip()


@dataclass(slots=True)
class Tag:
    predicted: float | None  # L̂ (output tokens); None: no usable prediction
    uncertainty: float
    reserved_output: int  # output tokens the run is sized for (the bucket's bound, at most max_tokens)
    request: PredictRequest | None = None  # what the predictor read: it learns from the same when the request ends


@dataclass(slots=True)
class PredictorStats:
    tagged: int = 0
    untagged: int = 0  # no usable prediction: sized for max_tokens
    observed: int = 0  # finished requests with a realized length (stopped or length-capped)
    observed_untagged: int = 0  # ... of which had no prediction
    abs_error_sum: float = 0.0  # |L̂ - realized| over observed requests with a prediction
    under_reserved: int = 0  # realized > reserved output: the run had to grow past its claim
    predict_s: float = 0.0

    def as_dict(self) -> dict:
        predicted = self.observed - self.observed_untagged
        return {"tagged": self.tagged, "untagged": self.untagged, "observed": self.observed,
                "mean_abs_error": self.abs_error_sum / predicted if predicted > 0 else None,
                "under_reserved": self.under_reserved, "predict_s": round(self.predict_s, 3)}


class LengthTags:
    def __init__(self, predictor: LoadedPredictor, *, max_tokens_cap: int, generator: str,
                 buckets: BucketConfig | None = None, calibrated: bool = False) -> None:
        self.predictor = predictor
        self.generator = generator
        self.served = ServedPredictor(predictor.predictor, on_call=self._count_call)
        cal = getattr(predictor.predictor, "calibration", None)
        cfg = buckets or BucketConfig()
        if cal is not None:  # the predictor's calibration: how its L̂ and u become a reservation
            # calibrated: its reservation table (sized for a 2 % miss rate, for odma's hard reservations); else the
            # smallest bucket >= L̂·(1 + α·u): a claim is soft, and claims near L̂ kept more requests in one run
            # (scripts/studies/vllm_runs_replay.py)
            table = cal.table if calibrated else None
            cfg = BucketConfig(max_buckets=cfg.max_buckets, align=cal.align, window=cfg.window,
                               min_samples=cfg.min_samples, refresh_every_n=cfg.refresh_every_n,
                               refresh_every_s=cfg.refresh_every_s, method=cfg.method, large_bound=max_tokens_cap,
                               alpha=0.0 if table is not None else cal.alpha, tau=cal.tau,
                               ceiling=math.inf if table is not None else cal.ceiling, table=table)
        # dynamic bounds: geometric until enough requests finished, then re-derived from their realized lengths
        self.policy = build_policy("odma", max_tokens=max_tokens_cap, buckets=cfg, pool=PoolConfig(reserve_scale=1.0))
        self.stats = PredictorStats()

    def tag(self, prompts: Sequence[str], prompt_tokens: Sequence[int], max_tokens: Sequence[int],
            temperatures: Sequence[float]) -> list[Tag]:
        """One batch: a failing predictor or an unusable answer leaves a request sized for its max_tokens."""
        requests = [PredictRequest(prompt=p, prompt_tokens=n, temperature=t, generator=self.generator)
                    for p, n, t in zip(prompts, prompt_tokens, temperatures)]
        tags = []
        for checked, request, prompt_len, cap in zip(self.served.predict(requests), requests, prompt_tokens,
                                                     max_tokens):
            if checked is None:
                self.stats.untagged += 1
                tags.append(Tag(None, 1.0, cap, request))
                continue
            length, u = checked
            reserved = self.policy.initial(KVRequest("-", prompt_len, cap, length, u)).output_tokens
            self.stats.tagged += 1
            tags.append(Tag(length, u, min(cap, reserved), request))
        return tags

    def _count_call(self, seconds: float, requests: int) -> None:
        self.stats.predict_s += seconds

    def observe(self, tag: Tag | None, realized: int) -> None:
        """A request finished with `realized` output tokens (`tag` None: it finished before it was tagged)."""
        self.stats.observed += 1
        if tag is None or tag.predicted is None:
            self.stats.observed_untagged += 1
        else:
            self.stats.abs_error_sum += abs(tag.predicted - realized)
            self.stats.under_reserved += realized > tag.reserved_output
        self.policy.observe(realized)
        self.served.observe(tag.request if tag is not None else None, realized)
        buckets = getattr(self.policy, "buckets", None)
        if buckets is not None and buckets.refresh_due():
            buckets.refresh()


def remaining(tag: Tag | None, generated: int) -> float:
    """Predicted output tokens still to come (inf without a prediction)."""
    if tag is None or tag.predicted is None:
        return math.inf
    return max(0.0, tag.predicted - generated)
