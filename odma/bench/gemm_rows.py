"""What the GEMM row-count benchmarks share (scripts/gemm_decode_rows.py, scripts/gemm_int8_rows.py): SmolLM2-135M's
decode-step GEMM shapes, a timer that rotates through the contenders, and random GGUF blocks to multiply."""

from __future__ import annotations

import statistics
import time

import numpy as np

from backends import cpu_quant

# (in features K, out features N) of SmolLM2-135M's layers, q/k/v and gate/up fused as the engine packs them
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}


def interleaved_ms(fns: dict, reps: int = 30) -> dict[str, float]:
    """The median ms of each function, timed in rotation (one call of each per round): a change in the machine's
    load falls on every library alike."""
    for fn in fns.values():
        fn(), fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: round(statistics.median(ts) * 1e3, 2) for name, ts in times.items()}


def random_blocks(ggml_id: int, n: int, k: int, seed: int) -> np.ndarray:
    """n rows of random GGUF blocks whose fp16 scale (and min) are small: timing needs no real weights."""
    t = cpu_quant.BLOCK_TYPES[ggml_id]
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 256, size=(n, k // t.block, t.block_bytes), dtype=np.uint8)
    rows[..., 0:2] = np.full(rows.shape[:-1] + (1,), 0.01, np.float16).view(np.uint8)
    if t.offset:
        rows[..., 2:4] = np.full(rows.shape[:-1] + (1,), -0.05, np.float16).view(np.uint8)
    if t.name == "Q6_K":  # its scale d is the block's last two bytes
        rows[..., -2:] = np.full(rows.shape[:-1] + (1,), 0.001, np.float16).view(np.uint8)
    return rows.reshape(n, -1)
