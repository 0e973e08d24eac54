"""Swap preemption through the host KV buffer (eLLM §4.3.2, vLLM's swap space): a preempted request's
cached K/V is copied to host memory and copied back when it is admitted again, instead of recomputing
its prompt and outputs. The buffer's logical size is the `OffloadController`'s (Algorithm 2 can scale it
from SLO feedback); a request whose K/V does not fit is recomputed instead."""

from __future__ import annotations

from typing import Any

import torch

from odma.engine.sequence import Sequence
from odma.kv import OffloadController


class HostSwap:
    def __init__(self, backend: Any, runner: Any, controller: OffloadController) -> None:
        self.backend = backend
        self.runner = runner  # its arena is read at each call: ballooning may have replaced it
        self.controller = controller
        self._host: dict[str, torch.Tensor] = {}

    def swap_out(self, seq: Sequence) -> bool:
        n = seq.num_cached
        nbytes = n * self.runner.bytes_per_token
        if seq.block is None or nbytes > self.controller.free_bytes or seq.kv.pieces:
            return False  # (a request reading a shared prefix in place holds only its later rows: recomputed)
        self._host[seq.request_id] = self.backend.offload(self.runner.arena, seq.block, n)
        self.backend.synchronize()  # the block is released right after: the copy must be complete
        self.controller.record_offload(seq.request_id, nbytes)
        return True

    def swap_in(self, seq: Sequence) -> None:
        host = self._host.pop(seq.request_id)
        self.backend.fetch(host, self.runner.arena, seq.block, seq.num_cached)
        self.controller.record_fetch(seq.request_id)

    def drop(self, seq: Sequence) -> None:
        self._host.pop(seq.request_id, None)
        self.controller.discard(seq.request_id)

    @property
    def held_bytes(self) -> int:
        return self.controller.used_bytes
