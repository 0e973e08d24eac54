"""The device interface: everything device-specific lives behind `Backend`; the pool never sees torch.

A backend allocates arenas (the KV pool's first arena and any later segments), views blocks as tensors,
copies block → block (migration) and device ↔ host (offload / fetch), and exposes streams, events,
memory figures and capability flags. CPU is the reference; CUDA and MLU share `TorchDeviceBackend`.
"""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, NamedTuple, Protocol

import torch

from backends.errors import BackendError

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from backends.cpu_attention import DecodeAttention
    from backends.cpu_linear import LinearKernel
    from backends.cpu_step import DecodeStepKernel
    from backends.triton_attention import TritonAttention
    from backends.virtual_memory import VirtualMemory

ATTENTION_KINDS = ("auto", "triton", "sdpa")


class Block(Protocol):
    """A contiguous range of token slots: what an arena views and copies (the pool's blocks have these fields)."""

    offset: int
    capacity: int

    @property
    def end(self) -> int: ...


class Span(NamedTuple):
    """A range of token slots built on this side (a segment-local range, a scratch range for profiling)."""

    offset: int
    capacity: int

    @property
    def end(self) -> int:
        return self.offset + self.capacity


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one token's KV: a block views as [layers, 2, capacity, kv_heads, head_dim]."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if min(self.layers, self.kv_heads, self.head_dim) < 1:
            raise BackendError(f"KV layout dimensions must be >= 1, got {self}")

    @property
    def elements_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim

    @property
    def bytes_per_token(self) -> int:
        return self.elements_per_token * torch.empty((), dtype=self.dtype).element_size()


ATTENTION_PLANS = ("native", "triton", "sdpa")


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend can do and what the engine decides from it: callers branch on these, never on device names.

    A backend class declares them (`backends.for_device(spec).capabilities` answers before any device is opened:
    the config's defaults); an opened backend's `capabilities` adds what it probed (virtual memory, pinning)."""

    supports_vmm: bool = False  # reserve address space and map memory behind it (`Backend.virtual_memory`)
    supports_streams: bool = False  # streams/events are real (False: no-op objects, work is synchronous)
    pinned_host: bool = False  # host buffers are page-locked, so device↔host copies can be asynchronous
    returns_memory_to_driver: bool = False  # free_arena(..., return_to_driver=True) gives bytes back
    default_dtype: str = "bfloat16"  # weights and activations when none is asked for
    default_kv_dtype: str | None = None  # the KV cache's dtype when none is asked for (None: the weights')
    # attention outside the kernels reads a float16 cache widened to float32 (the cache is storage only there:
    # the device has no fast half-precision attention)
    widens_half_kv: bool = False
    # the host's native layers apply: linear layers packed for `linear_kernel()` / oneDNN, steps through
    # `decode_step()`, a GGUF's quantized blocks served as they are
    native_layers: bool = False
    attention: str = "triton"  # what attention "auto" runs: native (`decode_attention()`), triton or sdpa
    graphs: bool = False  # `capture_graph` records graphs; decode batches are captured by default
    parallel_pools: bool = True  # several devices of this kind step at once (False: they share the host's cores)
    # copying a block inside device memory costs far less than sending it to the host and back (HBM against the
    # host link): odma packs its blocks (compaction, sliding) rather than swap a request out. False where both are
    # the same memcpy (a CPU pool)
    cheap_block_copies: bool = False
    # the model's step runs on the device while the host's cores wait for it: host work such as the length
    # predictor overlaps the steps there (a server tags requests ahead of its loop). False where the step runs on
    # the host's own cores (a CPU), which the predictor would take from it
    steps_off_host: bool = False
    torch_extension: str | None = None  # the module that registers the device with torch (imported when opened)

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_PLANS:
            raise BackendError(f"attention must be one of {', '.join(ATTENTION_PLANS)}, got {self.attention!r}")


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    """Device memory in bytes. `free, total = backend.memory_info()` still works (the old tuple)."""

    total_bytes: int
    free_bytes: int
    framework_bytes: int  # held by live tensors of this framework (arenas included)
    framework_reserved_bytes: int  # held by the framework's caching allocator (>= framework_bytes)

    def __iter__(self) -> Iterator[int]:
        return iter((self.free_bytes, self.total_bytes))


# an overlapping move goes through temporaries of at most this many bytes (groups of a layer's K or V slices): few
# copies per move (a slid block of a 7B model's ~1 K tokens: 3 groups), a bounded transient for a long one
OVERLAP_TEMP_BYTES = 32 << 20


def copy_kv(view: Callable[[Block], torch.Tensor], src: Block, dst: Block, n_tokens: int) -> None:
    """The migration copy: the first n_tokens of every layer's K and V, sequentially. `dst` may overlap `src` (a
    block grown in place or over the gap before it, or slid over a gap): a block's layout depends on its offset and
    capacity, so each layer's K and V slice moves by its own distance. The slices that move toward the block's
    start go first, front first, then those that move toward its end, back first, a group of neighbouring slices at
    a time through a temporary (at most OVERLAP_TEMP_BYTES): a group's new place may overlap its own old one, and only
    the old ones of slices moved already."""
    if n_tokens > min(src.capacity, dst.capacity) or n_tokens < 0:
        raise BackendError(f"cannot copy {n_tokens} tokens from {src} to {dst}")
    if not n_tokens or (src.offset, src.capacity) == (dst.offset, dst.capacity):
        return
    if src.offset < dst.end and dst.offset < src.end:
        if dst.capacity < src.capacity and dst.offset != src.offset:
            # (a block shrunk in place is fine: every slice moves toward the start, each by more than the last)
            raise BackendError(f"overlapping copy from {src} to {dst} into a smaller block")
        old, new = view(src).flatten(0, 1), view(dst).flatten(0, 1)  # one storage, two layouts: [2·layers, capacity, ...]
        count = old.shape[0]
        rows = old[0, :n_tokens]
        group = max(1, OVERLAP_TEMP_BYTES // (rows.numel() * rows.element_size()))
        # slice i moves by (dst.offset - src.offset)·count + i·(dst.capacity - src.capacity) rows, rising with i
        down = sum(1 for i in range(count) if (dst.offset - src.offset) * count + i * (dst.capacity - src.capacity) < 0)
        for a in range(0, down, group):
            b = min(down, a + group)
            new[a:b, :n_tokens].copy_(old[a:b, :n_tokens].clone())
        for b in range(count, down, -group):
            a = max(down, b - group)
            new[a:b, :n_tokens].copy_(old[a:b, :n_tokens].clone())
        return
    view(dst)[:, :, :n_tokens].copy_(view(src)[:, :, :n_tokens])


class Arena:
    """One flat device tensor holding every block; a block is one contiguous range of it."""

    def __init__(self, storage: torch.Tensor, layout: KVLayout, total_tokens: int) -> None:
        self.storage = storage
        self.layout = layout
        self.total_tokens = total_tokens

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    @property
    def released(self) -> bool:
        return self.total_tokens == 0

    def view(self, block: Block) -> torch.Tensor:
        """[layers, 2, capacity, kv_heads, head_dim] over the block's range (a view, no copy)."""
        lay = self.layout
        if block.offset < 0 or block.end > self.total_tokens:
            raise BackendError(f"block {block} lies outside the arena of {self.total_tokens} tokens")
        e = lay.elements_per_token
        flat = self.storage[block.offset * e : block.end * e]
        return flat.view(lay.layers, 2, block.capacity, lay.kv_heads, lay.head_dim)

    def copy(self, src: Block, dst: Block, n_tokens: int) -> None:
        """The migration copy (`copy_kv`)."""
        copy_kv(self.view, src, dst, n_tokens)

    def kv_address(self, block: Block) -> tuple[int, int, int]:
        """Where `view(block)` lies, in elements of `storage`: its first element, the elements between its layers
        and from a layer's K to its V (what kernels indexing the storage need; arithmetic, no view made)."""
        lay = self.layout
        if block.offset < 0 or block.end > self.total_tokens:
            raise BackendError(f"block {block} lies outside the arena of {self.total_tokens} tokens")
        row = lay.kv_heads * lay.head_dim
        return block.offset * lay.elements_per_token, 2 * block.capacity * row, block.capacity * row

    def release(self) -> None:
        """Drop the storage (the arena can no longer view anything); the backend decides where bytes go."""
        self.storage = self.storage.new_empty(0)
        self.total_tokens = 0


class NullEvent:
    """An event on a synchronous device: always complete."""

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream: Any = None) -> None:
        pass


class NullStream:
    """A stream on a synchronous device: work submitted 'on' it has finished when the call returns."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> NullEvent:
        return event if event is not None else NullEvent()


class Backend(ABC):
    """Device-specific operations; CPU, CUDA and MLU implement the same methods. A backend class serves the devices
    `<kind>[:N]` its line in `backends.BACKENDS` names it for, and is opened as `cls(N)`."""

    name: str = "backend"
    capabilities: Capabilities = Capabilities()

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    def describe(self) -> str:
        """The device as a report names it (the product and its size where the backend can tell)."""
        return str(self.device)

    def decode_attention(self) -> DecodeAttention | None:
        """A kernel for decode attention over contiguous blocks, where this backend has one (None: the model
        uses torch's SDPA per request)."""
        return None

    def decode_step(self) -> DecodeStepKernel | None:
        """A kernel that runs a model's decoder layers for a step of one token per request in one call, where this
        backend has one (None: the model's own layers)."""
        return None

    def attention(self, kind: str = "auto") -> DecodeAttention | TritonAttention | None:
        """The model's attention kernel. auto: what `capabilities.attention` declares (native: `decode_attention()`,
        the CPU's C decode kernel; triton: the Triton kernels when Triton can compile for the device, else None,
        logged; sdpa: None); triton: the Triton kernels for every request (BackendError where they cannot run: on
        CPU only under TRITON_INTERPRET=1); sdpa: None, torch's SDPA per request (the reference)."""
        if kind not in ATTENTION_KINDS:
            raise BackendError(f"attention must be one of {', '.join(ATTENTION_KINDS)}, got {kind!r}")
        plan = kind if kind != "auto" else self.capabilities.attention
        if plan == "sdpa":
            return None
        if plan == "native":
            return self.decode_attention()
        from backends.triton_attention import TritonAttention, available

        if kind == "triton":
            return TritonAttention(self.device)
        why = available(self.device)
        if why is not None:
            log.warning("%s: Triton attention unavailable (%s); attention runs as SDPA per request", self.device, why)
            return None
        return TritonAttention(self.device)

    def linear_kernel(self) -> LinearKernel | None:
        """A GEMM for the model's linear layers on weights packed for it, where this backend has one (None:
        torch's own)."""
        return None

    def virtual_memory(self) -> VirtualMemory | None:
        """Reserve address space and map memory behind it granule by granule (None: this backend cannot)."""
        return None

    def capture_graph(self, fn: Callable[[], Any]) -> Callable[[], Any] | None:
        """Record `fn` (device work on buffers that never move) once and return a replay that reruns its launches
        without the host issuing them again, returning what `fn` returned (overwritten by the next replay). None
        where the backend has no graphs. `fn` runs (twice, to compile and warm whatever it launches) before it is
        recorded, so it must be idempotent."""
        return None

    def timing_events(self) -> tuple[Any, Any] | None:
        """Two events that can time device work between them (`start.elapsed_time(end)`, milliseconds, after
        `end.synchronize()`); None where work is synchronous and the host's clock tells."""
        return None

    # -- arenas and segments -------------------------------------------------------------------------

    def create_arena(self, total_tokens: int, layout: KVLayout) -> Arena:
        if total_tokens < 1:
            raise BackendError(f"arena needs at least one token, got {total_tokens}")
        storage = torch.zeros(total_tokens * layout.elements_per_token, dtype=layout.dtype, device=self.device)
        return Arena(storage, layout, total_tokens)

    def create_segment(self, total_tokens: int, layout: KVLayout) -> Arena:
        """An additional arena (a ballooning segment); uninitialised, since blocks are written before read."""
        if total_tokens < 1:
            raise BackendError(f"segment needs at least one token, got {total_tokens}")
        storage = torch.empty(total_tokens * layout.elements_per_token, dtype=layout.dtype, device=self.device)
        return Arena(storage, layout, total_tokens)

    def free_arena(self, arena: Arena, *, return_to_driver: bool = False) -> int:
        """Release an arena or segment; returns its bytes. The caller guarantees no live block is in it.
        With return_to_driver the framework's cache is emptied too (other processes can then use it)."""
        nbytes = arena.nbytes
        arena.release()
        if return_to_driver:
            self.empty_cache()
        return nbytes

    def empty_cache(self) -> None:
        """Give the framework's cached free memory back to the driver (no-op where there is no cache)."""

    # -- device ↔ host -------------------------------------------------------------------------------

    def host_buffer(self, n_tokens: int, layout: KVLayout) -> torch.Tensor:
        """A host tensor [layers, 2, n_tokens, kv_heads, head_dim], page-locked when the backend can."""
        if n_tokens < 1:
            raise BackendError(f"host buffer needs at least one token, got {n_tokens}")
        shape = (layout.layers, 2, n_tokens, layout.kv_heads, layout.head_dim)
        return torch.empty(shape, dtype=layout.dtype, device="cpu", pin_memory=self.capabilities.pinned_host)

    def offload(self, arena: Arena, block: Block, n_tokens: int, out: torch.Tensor | None = None,
                *, stream: Any = None) -> torch.Tensor:
        """Copy the block's first n_tokens to host; returns the host tensor (`out` if given). With a stream
        on an asynchronous backend the copy is queued on it: synchronize it before reading the result."""
        if not 0 <= n_tokens <= block.capacity:
            raise BackendError(f"cannot offload {n_tokens} tokens of {block}")
        if out is None:
            out = self.host_buffer(max(n_tokens, 1), arena.layout)
        if out.shape[2] < n_tokens:
            raise BackendError(f"host buffer holds {out.shape[2]} tokens, {n_tokens} needed")
        with self._on(stream):
            out[:, :, :n_tokens].copy_(arena.view(block)[:, :, :n_tokens], non_blocking=self._async(stream))
        return out

    def fetch(self, host: torch.Tensor, arena: Arena, block: Block, n_tokens: int, *, stream: Any = None) -> None:
        """Copy host[:, :, :n_tokens] into the block's first n_tokens (the inverse of `offload`). With a
        stream the copy is queued: keep `host` alive and synchronize before the block is read."""
        if not 0 <= n_tokens <= min(block.capacity, host.shape[2]):
            raise BackendError(f"cannot fetch {n_tokens} tokens into {block} from a {host.shape[2]}-token buffer")
        with self._on(stream):
            arena.view(block)[:, :, :n_tokens].copy_(host[:, :, :n_tokens], non_blocking=self._async(stream))

    # -- synchronisation -----------------------------------------------------------------------------

    @abstractmethod
    def synchronize(self) -> None: ...

    def new_stream(self) -> Any:
        return NullStream()

    def current_stream(self) -> Any:
        return NullStream()

    def new_event(self) -> Any:
        return NullEvent()

    def use_stream(self, stream: Any) -> ContextManager:
        """Context in which work is queued on `stream` (a no-op on synchronous backends)."""
        return contextlib.nullcontext()

    def _on(self, stream: Any) -> ContextManager:
        return contextlib.nullcontext() if stream is None else self.use_stream(stream)

    def _async(self, stream: Any) -> bool:
        # only page-locked host memory makes a device↔host copy truly asynchronous
        return stream is not None and self.capabilities.pinned_host

    # -- observability -------------------------------------------------------------------------------

    def activation_peak_bytes(self, fn: Callable[[], Any]) -> int:
        """Peak bytes allocated by torch on this device while `fn` runs, above what was allocated before
        (the activation profile of a prefill). Here: torch's profiler replays the allocation events."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
        now = peak = 0
        for _, nbytes in events:
            now += nbytes
            peak = max(peak, now)
        return peak

    @abstractmethod
    def memory_info(self) -> MemoryInfo:
        """Total / free bytes of the device and bytes held by this framework."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})"
