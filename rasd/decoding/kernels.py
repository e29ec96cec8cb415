"""Faster skinny matrix multiplies and tree attention for verification on CPU.

Verification multiplies a few activations (M = tree size, 2..64) by every weight matrix. Which BLAS kernel
is fastest for such skinny products depends on the CPU. On one machine (AVX2, no AVX-512) `F.linear(x, W)`
for 2 <= M <= 16 cost about 2x the M = 1 case (the LM head, 49152 x 576: 20 ms vs 9 ms), while the same
product written as `(W @ x.T).T` took 5 ms. On another (AVX-512) it is the reverse up to M = 8 (the
576 x 576 product at M = 2: 11 us with `F.linear`, 51 us transposed) and the transposed form wins only from
M = 16 on some shapes. So the choice is measured, not assumed: when `install` patches a model, both forms
are timed a few times for each weight shape and M bucket (2, 4, ..., 64) and the faster one is kept for
the process (a shape first met later is timed then; `linear_choices()` shows them;
`RASD_LINEAR=stock|transposed` forces one). A transposed product
comes out column-major; it is copied to a row-major layout, because a query whose last dimension is strided
sends `scaled_dot_product_attention` down its slow math path.

Tree steps also pass the grouped key/value heads to the attention kernel as they are (`enable_gqa`) instead
of HF's `repeat_kv` copy of the whole cache. Only inside `fast_kernels()`: HF baselines sharing the module
keep stock behaviour. The results are the same products and attention with another summation order
(differences ~1e-7).
"""

from __future__ import annotations

import os
import threading
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

_state = threading.local()
_STOCK_SDPA = ALL_ATTENTION_FUNCTIONS["sdpa"]
_CHOICES: dict[tuple[Any, ...], bool] = {}   # (out, in, M bucket, dtype, threads, head) -> transposed?
_TUNE_ROUNDS = 5
_MAX_TUNED_ROWS = 64   # trees; a prefill (hundreds of rows) is not skinny: stock, and no timing on the way


def fast_enabled() -> bool:
    """Whether this thread is inside `fast_kernels()` (the engine's fast path; see also `lean`)."""
    return getattr(_state, "on", False)


def _linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`F.linear`, or for M >= 2 rows on CPU inside `fast_kernels()`, W @ x.T where that measured faster."""
    if not fast_enabled() or x.device.type != "cpu" or x.dim() < 2:
        return F.linear(x, self.weight, self.bias)
    rows = x.reshape(-1, x.shape[-1])   # [M, in]
    head = getattr(self, "_rasd_head", False)
    if not 2 <= rows.shape[0] <= _MAX_TUNED_ROWS or not _transposed_faster(self.weight, rows.shape[0], head):
        return F.linear(x, self.weight, self.bias)
    out = _transposed(self.weight, rows, head)
    if self.bias is not None:
        out = out + self.bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _transposed(weight: torch.Tensor, rows: torch.Tensor, head: bool) -> torch.Tensor:
    """(W @ x.T).T: [M, out]; row-major unless it is the LM head (its logits are only read)."""
    out = (weight @ rows.t()).t()
    return out if head else out.contiguous()


def _rows_bucket(rows: int) -> int:
    """1, 2, then powers of two (3-4 -> 4, 5-8 -> 8, ...): the cost curve's sizes cover every bucket."""
    return rows if rows <= 2 else 1 << (rows - 1).bit_length()


def _transposed_faster(weight: torch.Tensor, rows: int, head: bool) -> bool:
    """Whether W @ x.T beats F.linear for this weight and row count (measured once per process)."""
    key = (*weight.shape, _rows_bucket(rows), weight.dtype, torch.get_num_threads(), head)
    choice = _CHOICES.get(key)
    if choice is None:   # the environment is read here, once per key, not on every product
        forced = os.environ.get("RASD_LINEAR", "auto")
        choice = (forced == "transposed" if forced in ("stock", "transposed")
                  else _time_forms(weight, key[2], head))
        _CHOICES[key] = choice
    return choice


@torch.inference_mode()
def _time_forms(weight: torch.Tensor, rows: int, head: bool) -> bool:
    """Best of a few interleaved timings of both forms; the transposed one must win by 10% to be used."""
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
    best = {False: float("inf"), True: float("inf")}
    for _ in range(_TUNE_ROUNDS):
        for transposed in (False, True):
            t0 = time.perf_counter()
            _transposed(weight, x, head) if transposed else F.linear(x, weight)
            best[transposed] = min(best[transposed], time.perf_counter() - t0)
    return best[True] < 0.9 * best[False]


def linear_choices() -> dict[str, str]:
    """What was measured so far, readable: "out x in @ M" -> "transposed" | "stock"."""
    return {f"{k[0]}x{k[1]}@{k[2]}{' head' if k[5] else ''}": "transposed" if v else "stock"
            for k, v in sorted(_CHOICES.items(), key=lambda kv: kv[0][:3])}


def _tree_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """HF's sdpa attention, except that a masked CPU step inside `fast_kernels()` keeps the kv heads grouped.

    query [B, H, T, D]; key/value [B, H_kv, past + T, D]; attention_mask [B, 1, T, past + T] (additive).
    """
    groups = getattr(module, "num_key_value_groups", 1)
    if (not fast_enabled() or attention_mask is None or query.device.type != "cpu" or groups <= 1
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None):
        return _STOCK_SDPA(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)   # [B, H, T, D]
    return out.transpose(1, 2).contiguous(), None


def install(model: torch.nn.Module) -> torch.nn.Module:
    """Give every nn.Linear of `model` the switchable forward and route sdpa through `_tree_sdpa` (idempotent)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and not getattr(module, "_rasd_fast", False):
            module.forward = types.MethodType(_linear_forward, module)
            module._rasd_fast = True
            module._rasd_head = module is head
    ALL_ATTENTION_FUNCTIONS["sdpa"] = _tree_sdpa
    _tune(model, head)
    return model


def _tune(model: torch.nn.Module, head: torch.nn.Module | None) -> None:
    """Measure the kernel choice for every CPU Linear shape and tree-size bucket now, not mid-decoding.

    Why up front: measured lazily, the first tree of each size would carry the timing (≈ 0.1 s for the LM
    head) and the cost-aware sizer, which learns from measured verification times, would take that size
    for expensive. Once per (shape, bucket, threads) in a process: under a second for SmolLM2-135M.
    """
    seen = set()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, torch.nn.Linear) or weight is None or weight.device.type != "cpu":
            continue
        shape = (tuple(weight.shape), module is head)
        if shape in seen:
            continue
        seen.add(shape)
        rows = 2
        while rows <= _MAX_TUNED_ROWS:
            _transposed_faster(weight, rows, module is head)
            rows *= 2


@contextmanager
def fast_kernels(enabled: bool = True) -> Iterator[None]:
    """Use the faster skinny products in this thread for the duration of the block."""
    previous = fast_enabled()
    _state.on = enabled
    try:
        yield
    finally:
        _state.on = previous
