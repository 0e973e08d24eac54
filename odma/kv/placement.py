"""Several devices, one pool each, one set of bucket bounds: placement by compute load and memory pressure.

All pools share one reservation policy, so the bucket bounds are the same on every device at every moment (a
refresh swaps them for all at once), and realized lengths from every device feed the same window. The engine
places a request on the device with the lowest score
    w_memory · (reserved + this request's block) / capacity  +  w_compute · live tokens / max live tokens
among those whose pool can ever hold it (queued requests count as load); it then stays there.
On CPU, several pools in one process are a faithful test bed: placement is pure bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True, slots=True)
class DeviceLoad:
    device: str
    capacity_tokens: int
    reserved_tokens: int
    live_tokens: int  # tokens attention reads per decode step: the compute load
    live_blocks: int


def rank_devices(loads: Sequence[DeviceLoad], need: int, w_memory: float = 1.0, w_compute: float = 1.0) -> list[str]:
    """Devices best first for a request that will reserve `need` tokens (the score in the module docstring)."""
    busiest = max(1, max(l.live_tokens for l in loads))

    def score(l: DeviceLoad) -> tuple[float, str]:
        memory = (l.reserved_tokens + need) / max(1, l.capacity_tokens)
        return w_memory * memory + w_compute * l.live_tokens / busiest, l.device

    return [l.device for l in sorted(loads, key=score)]
