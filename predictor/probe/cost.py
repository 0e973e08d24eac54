"""What the probe costs the engine, against the prefill step it rides on (target: under 1 %).

In serving the hidden state is a by-product of the prefill (`HiddenCapture`: one row copied per request), so the
probe's cost is the capture plus the head. Both are timed here next to the prefill of the same prompts, batch 1
and packed, in one run (the CPU is shared: only ratios measured side by side mean anything).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from predictor.base import PredictRequest


def _median_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def probe_cost(predictor, states_model, requests: Sequence[Any], n: int = 32, repeat: int = 3) -> dict:
    """Median seconds of: a prefill of one prompt without and with the capture, the head on one row, and the
    same for a packed prefill of `n` prompts with the head on `n` rows."""
    from odma.models.llama import HiddenCapture

    chosen = [r for r in requests if getattr(r, "prompt", None)][:n]
    if not chosen:
        return {}
    seqs = [states_model.prompt_ids(r.prompt) for r in chosen]
    layers = predictor.capture_layers
    meta_only = [PredictRequest(prompt=None, prompt_tokens=len(s), **{k: getattr(r, k, None) for k in
                 ("temperature", "type", "generator", "depth", "system_prompt_id")}) for s, r in zip(seqs, chosen)]
    row = np.zeros((1, predictor.hidden_size), np.float32)
    rows = np.zeros((len(chosen), predictor.hidden_size), np.float32)
    one = [seqs[0]]
    states_model._forward(one, None)  # warm-up
    single_plain = [_median_seconds(lambda s=s: states_model._forward([s], None), repeat) for s in seqs[:8]]
    single_capture = [_median_seconds(lambda s=s: states_model._forward([s], HiddenCapture(layers)), repeat)
                      for s in seqs[:8]]
    head_one = _median_seconds(lambda: predictor.predict_features(row, meta_only[:1]), 50)
    packed_plain = _median_seconds(lambda: states_model._forward(seqs, None), repeat)
    packed_capture = _median_seconds(lambda: states_model._forward(seqs, HiddenCapture(layers)), repeat)
    head_packed = _median_seconds(lambda: predictor.predict_features(rows, meta_only), 20)
    prefill_one = float(np.median(single_plain))
    return {
        "prompts": len(chosen), "mean_prompt_tokens": round(float(np.mean([len(s) for s in seqs])), 1),
        "prefill_ms_batch1": round(1000 * prefill_one, 3),
        "prefill_with_capture_ms_batch1": round(1000 * float(np.median(single_capture)), 3),
        "head_ms_batch1": round(1000 * head_one, 4),
        "head_share_of_prefill_batch1": round(head_one / prefill_one, 5),
        "prefill_ms_packed": round(1000 * packed_plain, 2),
        "prefill_with_capture_ms_packed": round(1000 * packed_capture, 2),
        "head_ms_packed": round(1000 * head_packed, 4),
        "head_share_of_prefill_packed": round(head_packed / packed_plain, 5),
    }
