"""Faster skinny matrix multiplies and tree attention for verification on CPU.

Verification multiplies a few activations (M = tree size, 2..64) by every weight matrix. On this machine's
MKL, `F.linear(x, W)` for 2 <= M <= 16 costs about 2x the M = 1 case (the LM head, 49152 x 576: 20 ms vs
9 ms), while the same product written as `(W @ x.T).T` takes 5 ms: the library picks a different kernel.
That product comes out transposed; it is copied to a row-major layout, because a query whose last dimension
is strided sends `scaled_dot_product_attention` down its slow math path (with a masked 2-token tree that
path cost more than all the matrix products together). Tree steps also pass the grouped key/value heads
to the attention kernel as they are (`enable_gqa`) instead of HF's `repeat_kv` copy of the whole cache.

With both, a 2-4 token tree costs about one plain step on this CPU. Only inside `fast_kernels()`: HF
baselines sharing the module keep stock behaviour. The results are the same products and attention with
another summation order (differences ~1e-7).
"""

from __future__ import annotations

import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

_state = threading.local()
_STOCK_SDPA = ALL_ATTENTION_FUNCTIONS["sdpa"]


def _enabled() -> bool:
    return getattr(_state, "on", False)


def _linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`F.linear`, except for M >= 2 rows on CPU inside `fast_kernels()`, where W @ x.T is faster."""
    if not _enabled() or x.device.type != "cpu" or x.dim() < 2:
        return F.linear(x, self.weight, self.bias)
    rows = x.reshape(-1, x.shape[-1])   # [M, in]
    if rows.shape[0] < 2:
        return F.linear(x, self.weight, self.bias)
    out = (self.weight @ rows.t()).t()  # [M, out], column-major
    if not getattr(self, "_rasd_head", False):
        out = out.contiguous()          # the LM head's logits are only read: skip a 49152-wide copy
    if self.bias is not None:
        out = out + self.bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _tree_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """HF's sdpa attention, except that a masked CPU step inside `fast_kernels()` keeps the kv heads grouped.

    query [B, H, T, D]; key/value [B, H_kv, past + T, D]; attention_mask [B, 1, T, past + T] (additive).
    """
    groups = getattr(module, "num_key_value_groups", 1)
    if (not _enabled() or attention_mask is None or query.device.type != "cpu" or groups <= 1
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
    return model


@contextmanager
def fast_kernels(enabled: bool = True) -> Iterator[None]:
    """Use the faster skinny products in this thread for the duration of the block."""
    previous = _enabled()
    _state.on = enabled
    try:
        yield
    finally:
        _state.on = previous
