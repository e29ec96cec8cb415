"""Weight-only quantized products (`--dtype int8` / `int4`): the decoder's and LM head's weights read as 8 or 4 bits,
activations in bf16, through torch's own CPU kernels (`aten._weight_int8pack_mm`, `aten._weight_int4pack_mm_for_cpu`,
the kernels torchao's weight-only configs call on CPU; no kernel of ours).

Why: a decoding step of a small model streams every weight once, so its time is mostly bytes: fp32 reads 4 bytes
a weight, bf16 2, int8 1, int4 about 0.6 (4 bits and a bf16 scale and zero per 32). The embedded model IS a 4-bit
model (its GGUF is Q4_1: per 32 weights a scale and a minimum), so int4 with groups of 32 and a zero point puts
its own grid back, up to rounding the scales to bf16.

How it plugs in: a quantized Linear keeps its module (state_dict, hooks and the EAGLE head's copy of a layer are
unchanged; the copy is not quantized, the head only proposes); its packed weight is kept in `QUANTIZED`, keyed
weakly by the module, and `linear._linear_forward` multiplies by it whenever it is there, in every path (HF's
forward too, so HF `generate` on this model is the same model). Every row's result is the same bits whatever the
row count (tests/decoding/test_row_exact.py), which the exact tree steps need.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

GROUP = 32          # int4: weights per scale and zero (the GGUF Q4_1 block)
BITS = (8, 4)


@dataclass(frozen=True)
class Quantized:
    """One Linear's weight-only quantized weight."""

    bits: int
    weight: torch.Tensor   # int8 [out, in]; int4: packed by `_convert_weight_to_int4pack_for_cpu`
    scales: torch.Tensor   # int8: [out] bf16; int4: [in / GROUP, out, 2] bf16 (scale, zero)
    out_features: int


QUANTIZED: weakref.WeakKeyDictionary[torch.nn.Module, Quantized] = weakref.WeakKeyDictionary()
# attention / MLP -> {part names: (their weights stacked and quantized, output sizes)}: one product instead of
# three (q, k, v) or two (gate, up) in the lean forward (`linear.projections`); bit for bit the parts' products
STACKS: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[str, ...], tuple[Quantized, list[int]]]] = \
    weakref.WeakKeyDictionary()
PARTS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def available(bits: int) -> bool:
    """Whether this torch build has the CPU kernel for `bits`."""
    name = "_weight_int8pack_mm" if bits == 8 else "_weight_int4pack_mm_for_cpu"
    return hasattr(torch.ops.aten, name)


@torch.no_grad()
def quantize_int8(weight: torch.Tensor) -> Quantized:
    """Symmetric per-output-channel int8: w ≈ q * scale, scale = max |w| / 127 (bf16)."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).to(torch.bfloat16)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    return Quantized(8, q, scale.contiguous(), int(w.shape[0]))


@torch.no_grad()
def quantize_int4(weight: torch.Tensor, group: int = GROUP) -> Quantized:
    """Asymmetric int4 per group of `group` input weights: w ≈ q * scale + minimum, q in 0..15; stored for the
    kernel as (q - 8) * scale + zero with zero = minimum + 8 * scale (bf16 scale and zero)."""
    w = weight.detach().float()
    out, inp = w.shape
    if inp % group:
        raise ValueError(f"int4 needs input features divisible by {group}; this weight has {inp}")
    blocks = w.reshape(out, inp // group, group)
    low, high = blocks.amin(-1), blocks.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-12).to(torch.bfloat16).float()
    zero = (low + 8 * scale).to(torch.bfloat16).float()
    q = torch.round((blocks - zero[..., None]) / scale[..., None] + 8).clamp(0, 15).to(torch.int32).reshape(out, inp)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scales = torch.stack([scale.t(), zero.t()], dim=-1).contiguous().to(torch.bfloat16)   # [in/g, out, 2]
    return Quantized(4, packed, scales, out)


def product(quantized: Quantized, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x` [.., in] (any float dtype: computed in bf16) times the quantized weight (+ bias): [.., out] in x's dtype."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    if quantized.bits == 8:
        out = torch.ops.aten._weight_int8pack_mm(rows, quantized.weight, quantized.scales)
    else:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, quantized.weight, GROUP, quantized.scales)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.to(x.dtype).reshape(*x.shape[:-1], quantized.out_features)


def targets(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The Linears read every step: the decoder layers' and the LM head."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    found = [m for m in decoder.modules() if isinstance(m, torch.nn.Linear)]
    return found + ([head] if isinstance(head, torch.nn.Linear) else [])


def quantize(model: torch.nn.Module, bits: int) -> list[torch.nn.Linear]:
    """Quantize `model`'s decoder and LM-head products to `bits` (8 or 4), weight-only, in place (`QUANTIZED`,
    `STACKS`); the float weights stay (the embedding lookup reads them; nothing else does). Returns the Linears
    now quantized, whose forward must be `linear._linear_forward` (`linear.quantize_model` sees to it)."""
    if bits not in BITS or not available(bits):
        raise ValueError(f"int{bits} weight-only products are not available in this torch build")
    make = quantize_int8 if bits == 8 else quantize_int4
    found = targets(model)
    for module in found:
        QUANTIZED[module] = make(module.weight)
    for owner in model.modules():
        for names in PARTS:
            parts = [getattr(owner, n, None) for n in names]
            if all(isinstance(p, torch.nn.Linear) and p.bias is None for p in parts):
                weight = torch.cat([p.weight.detach() for p in parts])
                STACKS.setdefault(owner, {})[names] = (make(weight), [int(p.weight.shape[0]) for p in parts])
    return found
