"""The forms a skinny product `x @ W.T` can take on a CPU, and the weight copies some of them multiply by.

Why several: which BLAS kernel is fastest for a few rows times a large weight depends on the CPU and the row
count (measurements: docs/lab-notes/decoding-speed.md, "Kernels"). `F.linear` (STOCK); `(W @ x.T).T`
(TRANSPOSED); one or three rows padded to two or four, transposed (PADDED: some BLAS builds take a slow path for
those counts); MKL's or oneDNN's product with a weight packed once (PACKED, ONEDNN: no per-call packing of W,
and a row's result does not depend on how many rows come with it); a draft head's weight in half precision
(HALF: a head only proposes, verification decides, so rounding there cannot change a generated token).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F

STOCK, TRANSPOSED, PACKED, PADDED, HALF, ONEDNN = "stock", "transposed", "packed", "padded", "half", "onednn"
FORMS = (STOCK, TRANSPOSED, PACKED, PADDED, HALF, ONEDNN)
PACKED_FORMS = (PACKED, ONEDNN)   # forms that multiply by a copy of the weight packed once per module
HALF_DTYPE = torch.float16   # the shipped head is fp16: its weights lose nothing, only the activations round
PAD_TO = {1: 2, 3: 4}         # the padded form's row counts (`padded`)
PACK_ROWS = 16                # the row count MKL is told to pack for (the packed product then serves any M)


def packing_available() -> bool:
    """Whether this torch has MKL's packed GEMM (x86 builds with MKL)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def onednn_available() -> bool:
    """Whether this torch has oneDNN's linear with a weight packed once (x86 builds with MKL-DNN)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def can_pack(weight: torch.Tensor, form: str = PACKED) -> bool:
    """Whether `weight` can take `form` here: MKL packs float32 weights; oneDNN also bf16 ones, on CPUs where its
    bf16 kernels run (AVX-512 and up; an AVX2-only CPU takes `F.linear`)."""
    available = onednn_available() if form == ONEDNN else packing_available()
    if weight.dtype == torch.bfloat16 and form == ONEDNN:
        return available and weight.device.type == "cpu" and onednn_bf16()
    return available and weight.dtype == torch.float32 and weight.device.type == "cpu"


def onednn_bf16() -> bool:
    """Whether oneDNN's bf16 kernels run on this CPU."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check is not None and check())


def unpacked_form(rows: int) -> str:
    """The unpacked form timed against `F.linear` for this many rows: padded for one and three rows (their BLAS
    paths are slow), transposed otherwise."""
    return PADDED if rows in PAD_TO else TRANSPOSED


def unpacked(form: str, weight: torch.Tensor, rows: torch.Tensor, head: bool) -> torch.Tensor:
    """The padded, transposed or half-precision product of `rows` [M, in]: [M, out]."""
    if form == HALF:
        return half(weight, rows)
    return padded(weight, rows, head) if form == PADDED else transposed(weight, rows, head)


def half(weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`rows` [M, in] times the weight's half-precision copy, in rows' dtype: [M, out]."""
    return F.linear(rows.to(HALF_DTYPE), COPIES.half(weight)).to(rows.dtype)


def padded(weight: torch.Tensor, rows: torch.Tensor, head: bool) -> torch.Tensor:
    """One row as the first of two, or three as the first of four, transposed: [M, out]."""
    pad = rows.new_zeros(PAD_TO[rows.shape[0]] - rows.shape[0], rows.shape[1])
    return transposed(weight, torch.cat([rows, pad]), head)[: rows.shape[0]]


def transposed(weight: torch.Tensor, rows: torch.Tensor, head: bool) -> torch.Tensor:
    """(W @ x.T).T: [M, out]; row-major unless it is the LM head (its logits are only read).

    Why row-major: the product comes out column-major, and a query whose last dimension is strided sends
    `scaled_dot_product_attention` down its slow math path."""
    out = (weight @ rows.t()).t()
    return out if head else out.contiguous()


def pack(weight: torch.Tensor, form: str = PACKED) -> torch.Tensor:
    """MKL's packed copy of W (physical memory ≈ W's; the tensor over-reserves address space only), or
    oneDNN's (`ONEDNN`: an opaque blocked layout for this CPU's kernels)."""
    if form == ONEDNN:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), PACK_ROWS)


def packed_product(form: str, rows: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """`rows` [M, in] times a weight packed by `pack(weight, form)`: [M, out].

    Why oneDNN beside MKL: on some CPUs MKL's products for 5-8 rows are slow, and oneDNN's packed layout is the
    fastest form there."""
    if form == ONEDNN:
        return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return torch.ops.mkl._mkl_linear(rows, packed, weight, bias, rows.shape[0])


def stamp(weight: torch.Tensor) -> tuple[int, int]:
    """What identifies a weight's values for a derived copy: its storage and in-place version. A weight made
    inside `torch.inference_mode` (a model built there, or q/k/v stacked there on a first `install`) keeps no
    version counter: only its replacement is seen."""
    return weight.data_ptr(), -1 if weight.is_inference() else weight._version


class WeightCopies:
    """The packed and half-precision copies of weights, made again whenever a weight is replaced or changed in
    place (a model fine-tuned or loaded into after `install` must not keep multiplying by a stale copy).

    Kept off the modules: a packed tensor is opaque, and a model that carried one could no longer be pickled
    (Ray) or deep-copied."""

    def __init__(self) -> None:
        # form -> module -> (stamp of its weight, packed weight)
        self.packs: dict[str, weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple[int, int], torch.Tensor]]] = {
            form: weakref.WeakKeyDictionary() for form in PACKED_FORMS}
        # id(weight) -> (weak reference to it, its stamp, its half copy): tensors cannot be weak dict keys
        self.halves: dict[int, tuple[Any, tuple[int, int], torch.Tensor]] = {}

    def packed(self, module: torch.nn.Linear, form: str = PACKED) -> torch.Tensor:
        """The module's packed weight, re-packed whenever the weight was replaced or changed in place."""
        packs = self.packs[form]
        weight = module.weight
        current = stamp(weight)
        cached = packs.get(module)
        if cached is None or cached[0] != current:
            cached = (current, pack(weight, form))
            packs[module] = cached
        return cached[1]

    def drop_packed(self, module: torch.nn.Module, form: str) -> None:
        """Forget a module's packed copy (packed only to be timed)."""
        self.packs[form].pop(module, None)

    def half(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight's half copy, made again whenever the weight was replaced or changed in place (training)."""
        current = stamp(weight)
        cached = self.halves.get(id(weight))
        if cached is None or cached[0]() is not weight or cached[1] != current:
            for key in [k for k, (ref, _, _) in self.halves.items() if ref() is None]:
                del self.halves[key]          # weights that are gone
            cached = (weakref.ref(weight), current, weight.detach().to(HALF_DTYPE).contiguous())
            self.halves[id(weight)] = cached
        return cached[2]


COPIES = WeightCopies()   # one per process: a weight's copy serves every model that shares it
