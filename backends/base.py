"""The device interface: everything device-specific lives behind `Backend`; the pool never sees torch."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from odma.allocator import Block
from odma.errors import ConfigError


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one token's KV: a block views as [layers, 2, capacity, kv_heads, head_dim]."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if min(self.layers, self.kv_heads, self.head_dim) < 1:
            raise ConfigError(f"KV layout dimensions must be >= 1, got {self}")

    @property
    def elements_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim

    @property
    def bytes_per_token(self) -> int:
        return self.elements_per_token * torch.empty((), dtype=self.dtype).element_size()


class Arena:
    """One flat device tensor holding every block; a block is one contiguous range of it."""

    def __init__(self, storage: torch.Tensor, layout: KVLayout, total_tokens: int) -> None:
        self.storage = storage
        self.layout = layout
        self.total_tokens = total_tokens

    def view(self, block: Block) -> torch.Tensor:
        """[layers, 2, capacity, kv_heads, head_dim] over the block's range (a view, no copy)."""
        lay = self.layout
        if block.offset < 0 or block.end > self.total_tokens:
            raise ConfigError(f"block {block} lies outside the arena of {self.total_tokens} tokens")
        e = lay.elements_per_token
        flat = self.storage[block.offset * e : block.end * e]
        return flat.view(lay.layers, 2, block.capacity, lay.kv_heads, lay.head_dim)

    def copy(self, src: Block, dst: Block, n_tokens: int) -> None:
        """The migration copy: the first n_tokens of every layer's K and V, sequentially."""
        if n_tokens > min(src.capacity, dst.capacity) or n_tokens < 0:
            raise ConfigError(f"cannot copy {n_tokens} tokens from {src} to {dst}")
        if n_tokens:
            self.view(dst)[:, :, :n_tokens].copy_(self.view(src)[:, :, :n_tokens])


class Backend(ABC):
    """Device-specific operations. CPU now; CUDA and MLU implement the same methods."""

    name: str = "backend"

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    def create_arena(self, total_tokens: int, layout: KVLayout) -> Arena:
        if total_tokens < 1:
            raise ConfigError(f"arena needs at least one token, got {total_tokens}")
        storage = torch.zeros(total_tokens * layout.elements_per_token, dtype=layout.dtype, device=self.device)
        return Arena(storage, layout, total_tokens)

    @abstractmethod
    def synchronize(self) -> None: ...

    @abstractmethod
    def memory_info(self) -> tuple[int, int]:
        """(free bytes, total bytes) of the device."""
