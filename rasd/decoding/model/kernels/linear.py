"""The tuned Linear forward: `install` gives every nn.Linear of a model a forward that, inside `fast_kernels()`
on a CPU for 1-64 rows, multiplies by the form measured fastest (`choices`), and stacks the q/k/v (and gate/up)
products of tree steps into one product each (`projections`).

What each patched module is (the LM head? a draft head's, allowed half precision?) and its stacked weights are
kept in `TunedLinears`, keyed weakly by the module, not stamped on it: state_dict, pickling and deep copies of a
model see its own modules only. Measurements: docs/lab-notes/decoding-speed.md, "Kernels".
"""

from __future__ import annotations

import types
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F

import rasd.decoding.model.kernels.choices as _choices
from rasd.decoding.model.kernels.attention import route_attention
from rasd.decoding.model.kernels.choices import BUCKETS, MAX_TUNED_ROWS, forced_form, key
from rasd.decoding.model.kernels.forms import (
    COPIES,
    HALF,
    ONEDNN,
    PACKED_FORMS,
    STOCK,
    can_pack,
    half,
    packed_product,
    unpacked,
)
from rasd.decoding.model.kernels.mode import fast_enabled, tuned_products
from rasd.decoding.model.kernels.quantized import QUANTIZED
from rasd.decoding.model.kernels.quantized import STACKS as QUANT_STACKS
from rasd.decoding.model.kernels.quantized import product as quantized_product

QKV, GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")   # parts that read the same input


class Role(NamedTuple):
    """What a patched Linear is to its model."""

    head: bool          # the model's LM head (its logits are only read: a transposed product stays strided)
    approximate: bool   # a draft head's own module: may take the `HALF` form


class Stack(NamedTuple):
    """One Linear over an owner's parts' stacked weights (`stack_products`), and what it was stacked from."""

    linear: torch.nn.Linear
    names: tuple[str, ...]      # the parts (QKV or GATE_UP)
    sizes: list[int]            # their output sizes, to split the stacked product
    pointers: tuple[int, ...]   # their weights' pointers when stacked

    def holds(self, owner: torch.nn.Module) -> bool:
        """Whether the owner's parts are still views of this stack (a part whose weight was replaced is not)."""
        return self.pointers == _part_pointers(owner, self.names)


class TunedLinears:
    """The patched Linears' roles and the attentions' and MLPs' stacked products, keyed weakly by module."""

    def __init__(self) -> None:
        self.roles: weakref.WeakKeyDictionary[torch.nn.Module, Role] = weakref.WeakKeyDictionary()
        self.stacks: weakref.WeakKeyDictionary[torch.nn.Module, Stack] = weakref.WeakKeyDictionary()

    def role(self, module: torch.nn.Module) -> Role:
        return self.roles.get(module, _PLAIN)

    def approximate(self, module: torch.nn.Module) -> bool:
        return self.role(module).approximate


_PLAIN = Role(head=False, approximate=False)
LINEARS = TunedLinears()   # one per process, like the modules it describes


REDUCED = (torch.bfloat16, torch.float16)


def row_exact(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              module: torch.nn.Linear | None = None) -> torch.Tensor:
    """`x @ W.T (+ b)` whose every row's result is the same bits whatever the row count: one row goes as the first
    of two, through oneDNN's product with the weight packed once where it can (`module` given), else `F.linear`.

    Why: on CPU a reduced-precision product of one row takes another kernel than two or more rows (which agree
    with one another: tests/decoding/test_row_exact.py), summing in another order; in bf16 such a last-bit
    difference grows into another token (`exact_attention`). Why packed: `F.linear` in bf16 reorders the weight
    on every call; a bf16 model's products read their packed weight at about twice the speed (a 135M model's
    layers: 13-14 ms against 21-25 ms for 1-8 rows, 2-core AVX-512 EPYC)."""
    rows = x.reshape(-1, x.shape[-1])   # [M, in]
    single = rows.shape[0] == 1
    if single:
        rows = torch.cat([rows, rows])
    if module is not None and can_pack(weight, ONEDNN) and not torch.is_grad_enabled():
        out = packed_product(ONEDNN, rows, COPIES.packed(module, ONEDNN), weight, bias)
    else:
        out = F.linear(rows, weight, bias)
    out = out[:1] if single else out
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`F.linear`, or on CPU inside `fast_kernels()` for 1-64 rows, the form measured fastest for M; a reduced-
    precision target's products there are row-exact (`row_exact`); a quantized one's take its quantized weight in
    every path (`quantized`)."""
    found = QUANTIZED.get(self)
    if found is not None and x.device.type == "cpu":
        return quantized_product(found, x, self.bias)
    if (self.weight.dtype in REDUCED and x.device.type == "cpu" and fast_enabled() and x.dim() >= 2
            and not LINEARS.approximate(self)):
        return row_exact(x, self.weight, self.bias, self)
    if not tuned_products() or x.device.type != "cpu" or x.dim() < 2:
        return F.linear(x, self.weight, self.bias)
    rows = x.reshape(-1, x.shape[-1])   # [M, in]
    head, approximate = LINEARS.role(self)
    approximate = approximate and not torch.is_grad_enabled()   # never under training's gradients
    form = (_choices.ACTIVE.form(self.weight, rows.shape[0], head, approximate=approximate)
            if rows.shape[0] <= MAX_TUNED_ROWS else STOCK)
    if form == STOCK or (form in PACKED_FORMS and torch.is_grad_enabled()
                         and (self.weight.requires_grad or x.requires_grad)):   # packed copies carry no gradient
        return F.linear(x, self.weight, self.bias)
    if form in PACKED_FORMS:
        out = packed_product(form, rows, COPIES.packed(self, form), self.weight, self.bias)
    else:
        out = half(self.weight, rows) if form == HALF else unpacked(form, self.weight, rows, head)
        if self.bias is not None:
            out = out + self.bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


def quantize_model(model: torch.nn.Module, bits: int) -> torch.nn.Module:
    """`model` with its decoder and LM-head products weight-only quantized to `bits` (`quantized.quantize`), in
    every path: those Linears take the switchable forward now, not only at `install`. Returns the model."""
    from rasd.decoding.model.kernels.quantized import quantize

    for module in quantize(model, bits):
        if not _patched(module):
            module.forward = types.MethodType(_linear_forward, module)
    return model


def product(x: torch.Tensor, weight: torch.Tensor, approximate: bool = False) -> torch.Tensor:
    """`F.linear(x, weight)` for a weight that no nn.Linear owns, with a head's read-only output (an EAGLE head's
    rows of the target's LM head), by the form measured fastest for its rows inside `fast_kernels()`.

    Why: that product is a large part of a head forward's bytes, and `F.linear`'s few-row kernels read such a cold
    weight slower than the padded or transposed form. No packed form: there is no module to keep a packed copy
    on. `approximate`: the `HALF` form may be chosen (a draft's product, whose result only proposes tokens).
    """
    if not tuned_products() or x.device.type != "cpu":
        return F.linear(x, weight)
    rows = x.reshape(-1, x.shape[-1])   # [M, in]
    if rows.shape[0] > MAX_TUNED_ROWS:
        return F.linear(x, weight)
    form = _choices.ACTIVE.form(weight, rows.shape[0], True, bare=True, approximate=approximate)
    if form == STOCK:
        return F.linear(x, weight)
    out = unpacked(form, weight, rows, True)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def install(model: torch.nn.Module) -> torch.nn.Module:
    """Give every nn.Linear of `model` the switchable forward, let its attentions keep grouped kv heads in tree
    steps (`attention`), and choose the product forms now (idempotent).

    A model whose `approximate_products` is true (a draft head with only its own modules: `EagleHead`) may have
    its products run from half-precision weights (`HALF`); the target's and a self-draft's never."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    approximate = bool(getattr(model, "approximate_products", False))
    if not approximate:   # q/k/v and gate/up as one product each in tree steps (`projections`)
        stack_products(model)
    for module in [*model.modules(), *_stacked_linears(model)]:
        if not isinstance(module, torch.nn.Linear):
            continue
        if not _patched(module):
            module.forward = types.MethodType(_linear_forward, module)
        # the head flag is the first model's (a self-draft sharing the target's LM head does not reset it); the
        # approximate flag is set even on a module already patched: a head's layer is a deep copy of an installed
        # target layer
        known = LINEARS.roles.get(module)
        LINEARS.roles[module] = Role(head=known.head if known is not None else module is head, approximate=approximate)
    route_attention(model)
    _tune(model, head)
    return model


def _patched(module: torch.nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, types.MethodType) and forward.__func__ is _linear_forward


def _tune(model: torch.nn.Module, head: torch.nn.Module | None) -> None:
    """Measure the kernel choice for every CPU Linear shape and tree-size bucket now, not mid-decoding.

    Why up front: measured lazily, the first tree of each size would carry the timing and the cost-aware sizer,
    which learns from measured verification times, would take that size for expensive. Once per (shape, bucket,
    threads) on a machine (`KernelChoices.load`). The weights whose shape packs best for some bucket are packed
    here too, for the same reason. The layers' products are timed as decoding runs them, one after another over
    the whole model (`KernelChoices.sweep`); the LM head alone is larger than any cache, so timing its weight by
    itself is already fair.
    """
    table = _choices.ACTIVE
    table.load()
    known = set(table.choices)
    before = table.probe() if not _measured(model, head, known) else None
    linears = _cpu_linears(model)
    body = [m for m in linears if m is not head]
    approximate = bool(getattr(model, "approximate_products", False))
    if forced_form() == "auto" and len(body) > 1:
        for rows in BUCKETS:
            table.sweep(body, rows, LINEARS.approximate)
    for weight in getattr(model, "bare_weights", list)():   # products without a module (`product`)
        for rows in BUCKETS:
            table.form(weight, rows, True, bare=True, approximate=approximate)
    for module in linears:
        forms = {table.form(module.weight, rows, module is head, approximate=LINEARS.approximate(module))
                 for rows in BUCKETS}
        for form in PACKED_FORMS:
            if form not in forms:
                COPIES.drop_packed(module, form)   # packed only to be timed
            else:
                COPIES.packed(module, form)
    table.stamp_new(known, before)
    table.save()


def _measured(model: torch.nn.Module, head: torch.nn.Module | None, known: set) -> bool:
    """Whether every product `_tune` would time for `model` already has a form (then no probe is taken)."""
    approximate = bool(getattr(model, "approximate_products", False))
    keys = [key(m.weight, rows, m is head, LINEARS.approximate(m)) for m in _cpu_linears(model) for rows in BUCKETS]
    keys += [key(w, rows, "bare", approximate) for w in getattr(model, "bare_weights", list)() for rows in BUCKETS]
    return all(k in known for k in keys)


def _cpu_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The model's Linear modules with a weight on the CPU: the products whose forms are tuned."""
    return [m for m in [*model.modules(), *_stacked_linears(model)] if isinstance(m, torch.nn.Linear)
            and getattr(m, "weight", None) is not None and m.weight.device.type == "cpu"]


# ---------------------------------------------------------------------- stacked q/k/v and gate/up products
def projections(owner: torch.nn.Module, names: tuple[str, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`owner.<name>(x)` for each name: q/k/v of an attention, gate/up of an MLP. Where the tuned products run
    (`tuned_products`, CPU), one product over their stacked weights (`stack_products`), split.

    Why: a tree step's products stream weights for a few rows, and each one more costs its own call and its
    threads' start. A row's result is the same dot products in another blocking: differences like the tuned
    forms' (~1e-5 in the logits), none at all in a prompt's forward, which never stacks (`prefill_products`, so a
    prefix hit keeps a whole prefill's bits). A weight-only quantized model's parts are stacked in every path
    (`quantized.STACKS`): its kernel's columns do not depend on their neighbours, so stacked and apart give the
    same bits."""
    stacked = QUANT_STACKS.get(owner) if x.device.type == "cpu" else None
    if stacked is not None and names in stacked:
        packed, sizes = stacked[names]
        return quantized_product(packed, x, None).split(sizes, dim=-1)
    fused = (LINEARS.stacks.get(owner) if x.device.type == "cpu" and tuned_products() and not torch.is_grad_enabled()
             else None)   # under gradients the parts' own products: the stacked weight carries none
    if fused is not None and fused.names == names and fused.holds(owner):
        return fused.linear.forward(x).split(fused.sizes, dim=-1)
    return tuple(getattr(owner, n).forward(x) for n in names)


@torch.no_grad()
def stack_products(model: torch.nn.Module) -> None:
    """Stack the q/k/v weights of every attention and the gate/up weights of every MLP into one Linear per group
    (`projections`); the parts' weights become views of the stacked one, so memory does not grow and an in-place
    change of a part (a load, an optimiser step) is seen by both. A part whose weight is later replaced is seen by
    `projections`, which then multiplies the parts again (and by a later call here, which stacks them anew)."""
    for owner in model.modules():
        for names in (QKV, GATE_UP):
            if not all(isinstance(getattr(owner, n, None), torch.nn.Linear) for n in names):
                continue
            if owner not in LINEARS.stacks or not LINEARS.stacks[owner].holds(owner):
                stacked = _stack(owner, names)
                if stacked is not None:
                    LINEARS.stacks[owner] = stacked


def _stack(owner: torch.nn.Module, names: tuple[str, ...]) -> Stack | None:
    """One Linear over the parts' stacked weights (and biases), the parts rebound to views of it; None when the
    parts cannot stack (not all CPU float32, or bf16 that oneDNN packs; some with a bias and some without).

    Why bf16 too: oneDNN's packed bf16 product gives each output column the same bits stacked or apart
    (tests/decoding/test_row_exact.py), and a bf16 step of the 135M model makes 211 products instead of 121."""
    parts = [getattr(owner, n) for n in names]
    weights = [p.weight for p in parts]
    biases = [p.bias for p in parts]
    if not all(_stackable(w) for w in weights) or len({w.dtype for w in weights}) > 1 \
            or len({b is None for b in biases}) > 1:
        return None
    sizes = [w.shape[0] for w in weights]
    stacked = torch.nn.Linear(weights[0].shape[1], sum(sizes), bias=biases[0] is not None, dtype=weights[0].dtype)
    stacked.weight.data = torch.cat([w.data for w in weights])             # [sum(out), in]
    stacked.weight.requires_grad_(False)
    for part, view in zip(parts, stacked.weight.data.split(sizes), strict=True):
        part.weight.data = view
    if stacked.bias is not None:
        stacked.bias.data = torch.cat([b.data for b in biases])
        stacked.bias.requires_grad_(False)
        for part, view in zip(parts, stacked.bias.data.split(sizes), strict=True):
            part.bias.data = view
    return Stack(stacked, names, sizes, _part_pointers(owner, names))


def _stackable(weight: torch.Tensor) -> bool:
    """A CPU weight in float32, or in bf16 where oneDNN packs it (`row_exact` multiplies the stack)."""
    return weight.device.type == "cpu" and (weight.dtype == torch.float32
                                            or (weight.dtype == torch.bfloat16 and can_pack(weight, ONEDNN)))


def _part_pointers(owner: torch.nn.Module, names: tuple[str, ...]) -> tuple[int, ...]:
    """The parts' weight pointers: equal to a stack's record while the parts are still its views."""
    return tuple(getattr(owner, n).weight.data_ptr() for n in names)


def _stacked_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The stacked Linears (`stack_products`) whose parts in `model` are still their views: tuned beside its own."""
    stacks = LINEARS.stacks
    return [stacks[owner].linear for owner in model.modules() if owner in stacks and stacks[owner].holds(owner)]
