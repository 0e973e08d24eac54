"""Linear layers with their weights packed once: for odma's own kernel, or for oneDNN (CPU).

The default (`ODMA_CPU_LINEAR=odma`): fp32 layers, and bf16 ones on CPUs with AVX512_BF16, run the CPU backend's
kernel (backends/cpu_linear.py) where it builds here (AVX-512, a C compiler) and serves torch's thread count; it
overlaps the weight stream with the FMAs, which oneDNN does not: one thread, SmolLM2's layers, fp32 0.72-0.81x
oneDNN's time at 16 rows, bf16 0.70x, both level from 64-256 rows on; two threads 0.71-0.80x at 16 rows but 1.1x
at 600 (Zen 5, 2026-11-24; docs/BENCHMARKS.md, "CPU linear layers"). Every other layer is packed for oneDNN as below.

Why: `F.linear` on CPU re-packs the weight matrix into the GEMM's blocked layout on every call; with the few
rows of a decode step (one per request) that packing is a large share of the GEMM, and the GEMMs are most
of a decode step (`odma-bench profile`). Packing once at load and calling oneDNN's linear on the packed weight
is what vLLM-CPU does too (its `create_onednn_mm`); here through torch's own mkldnn ops, no extension.
The results differ from `F.linear` in the last bits (another summation order), as any other GEMM would.
The packed call serves every row count, large prefills included. On SmolLM2's shapes, one thread, at every M from
16 to 2,600 it ran at 102-112 GF/s against 74-101 for `F.linear` on a Zen 4 CPU, and at 141-262 against 82-112 on
a Zen 5 (oneDNN picks its AVX-512 kernels by CPU flag, MKL did not reach them); inside the engine a 638-token
prefill step took 0.71-0.76 s instead of 1.51-2.08 s on the Zen 5 (2026-11-24; docs/BENCHMARKS.md, "CPU linear
layers"). An earlier, isolated measurement on an AVX2 CPU had MKL 5-10 % ahead above 512 rows;
`ODMA_CPU_LINEAR=mixed` keeps that split (F.linear for steps of more than DENSE_ABOVE rows) for such machines. The
dense weight stays either way (a tied LM head, `mixed`), so the packed copy costs the weights' size once more in
host memory (538 MB for SmolLM2-135M in fp32).

bfloat16 weights (`--dtype bfloat16`) are packed too where oneDNN has a bf16 path on this CPU: one thread, 16 rows,
SmolLM2's shapes, the packed call took 0.78 × F.linear's time for the layers and 0.57 × for the LM head, with
bit-identical results; from 256 rows on the two are within 7 % (measured on 2026-11-24 on an EPYC with AVX-512).

`ODMA_CPU_LINEAR` = `odma` (default: the kernel where it serves, oneDNN for the rest) | `onednn` (packed for every
step) | `mixed` (F.linear above DENSE_ABOVE rows) | `torch` (F.linear always: A/B measurements, or a torch build
without mkldnn).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from backends import BackendError, for_device
from odma.errors import ConfigError

if TYPE_CHECKING:
    from backends.cpu_linear import LinearKernel

log = logging.getLogger(__name__)
BATCH_HINT = 64  # rows oneDNN lays the packed weight out for: a decode batch (any row count still works)
DENSE_ABOVE = 512  # with ODMA_CPU_LINEAR=mixed: rows above which F.linear (MKL) is used instead
# on several threads, rows above which oneDNN beats odma's kernel (two threads: level at 128 rows, 1.1x at 256-600)
LARGE_ROWS = 128
MODES = ("odma", "onednn", "mixed", "torch")


def linear_mode() -> str:
    """ODMA_CPU_LINEAR, checked: a typo must not silently select another GEMM."""
    mode = os.environ.get("ODMA_CPU_LINEAR", "odma").strip().lower() or "odma"
    if mode not in MODES:
        raise ConfigError(f"ODMA_CPU_LINEAR={mode!r}: expected one of {', '.join(MODES)}")
    return mode


def onednn_linear_available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def packable_dtypes() -> tuple[torch.dtype, ...]:
    """Weight dtypes packed for oneDNN here: float32, and bfloat16 where this CPU has oneDNN's bf16 path."""
    bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return (torch.float32, torch.bfloat16) if bf16 is not None and bf16() else (torch.float32,)


class PackedLinear(nn.Module):
    """y = x @ W.T + b: oneDNN on the packed weight, or F.linear on W for steps of more than `dense_above` rows
    (None: never)."""

    def __init__(self, linear: nn.Linear, batch_hint: int = BATCH_HINT, dense_above: int | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the same Parameters (a tied LM head stays tied)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach().contiguous(), batch_hint)
        self.dense_above = dense_above

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense_above is not None and x.shape[0] > self.dense_above:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for oneDNN"


class KernelLinear(nn.Module):
    """y = x @ W.T + b through the CPU backend's kernel on a copy of W packed for it (fp32 or bf16); steps of more
    than LARGE_ROWS rows through `large` where one is given (oneDNN, on several threads: see pack_linears)."""

    def __init__(self, linear: nn.Linear, kernel: LinearKernel, large: PackedLinear | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the same Parameters (a tied LM head stays tied)
        self.kernel = kernel
        self.packed = kernel.pack(self.weight)
        self.large = large

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.packed.dtype:
            return F.linear(x, self.weight, self.bias)
        if self.large is not None and x.numel() > LARGE_ROWS * self.in_features:
            return self.large(x)
        return self.kernel(x, self.packed, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for odma's kernel"


def pack_linears(model: nn.Module, kernel: LinearKernel | None = None, mode: str | None = None) -> int:
    """Replace every nn.Linear of `model` on a device whose backend runs native layers (the CPU's) by a KernelLinear
    (in the default mode, where `kernel` is given and serves the layer: `LinearKernel.serves`) or a PackedLinear
    (dtypes oneDNN packs here, `packable_dtypes`); in place, idempotent. On more than one torch thread a
    KernelLinear also keeps oneDNN's packed copy for large steps (the weights' size once more in memory; on one
    thread the kernel is level with oneDNN there). Returns how many were replaced; 0 with ODMA_CPU_LINEAR=torch.
    mode: one of MODES instead of ODMA_CPU_LINEAR's (benchmarks compare them)."""
    mode = mode or linear_mode()
    if mode == "torch":
        return 0
    use_kernel = mode == "odma" and kernel is not None
    onednn = onednn_linear_available()
    if not onednn and not use_kernel:
        log.info("oneDNN linear unavailable in this torch build; linear layers use F.linear")
        return 0
    dtypes = packable_dtypes() if onednn else ()
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is not nn.Linear or not _native_layers(child.weight.device):
                continue
            if use_kernel and kernel.serves(child.weight):
                several = torch.get_num_threads() > 1 and child.weight.dtype in dtypes
                setattr(module, name, KernelLinear(child, kernel, PackedLinear(child) if several else None))
            elif child.weight.dtype in dtypes:
                setattr(module, name, PackedLinear(child, dense_above=DENSE_ABOVE if mode == "mixed" else None))
            else:
                continue
            replaced += 1
    return replaced


def _native_layers(device: torch.device) -> bool:
    try:
        return for_device(device).capabilities.native_layers
    except BackendError:  # a device no backend serves ("meta"): nothing to pack for
        return False


def linear_summary(model: nn.Module) -> str:
    """Which GEMM each linear layer runs, counted ("121 odma avx512" ...): what a start log says."""
    from odma.models.quantized import QuantLinear

    inner = {id(m.large) for m in model.modules() if isinstance(m, KernelLinear) and m.large is not None}
    kinds: Counter[str] = Counter()
    for m in model.modules():
        if isinstance(m, KernelLinear):
            kinds[f"odma {m.kernel.isa} {str(m.packed.dtype).removeprefix('torch.')}"] += 1
        elif isinstance(m, QuantLinear):
            kinds[f"odma {m.kernel.isa} quantized"] += 1
        elif isinstance(m, PackedLinear) and id(m) not in inner:
            kinds["oneDNN"] += 1
        elif type(m) is nn.Linear:
            kinds["F.linear"] += 1
    return ", ".join(f"{n} {kind}" for kind, n in kinds.most_common()) or "none"


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes a decode step streams for the linear layers and the LM head, as the layers hold them (quantized
    blocks, packed fp32 / bf16 panels, dense weights): the weight term of a step's roofline."""
    from odma.models.quantized import QuantLinear

    inner = {id(m.large) for m in model.modules() if isinstance(m, KernelLinear) and m.large is not None}
    total = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            total += m.nbytes
        elif isinstance(m, KernelLinear):
            total += m.packed.numel() * m.packed.element_size()
        elif (isinstance(m, PackedLinear) and id(m) not in inner) or type(m) is nn.Linear:
            total += m.weight.numel() * m.weight.element_size()
    return total
