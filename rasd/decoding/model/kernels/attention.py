"""Tree attention with grouped key/value heads, for the models that opted in (`route_attention`, via `install`).

Why: HF's sdpa attention copies the whole cache to repeat the grouped kv heads (`repeat_kv`) before every
masked step; passing them as they are (`enable_gqa`) skips that copy. Same attention, another summation order
(differences ~1e-7), so it runs only inside `fast_kernels()`, on a CPU, for the attention modules of a model
that `install` was given: an HF baseline sharing the process (or the module, outside `fast_kernels()`) keeps
HF's stock behaviour.

Why the slot `ALL_ATTENTION_FUNCTIONS["sdpa"]` is replaced process-wide rather than a new implementation name
registered through `AttentionInterface`: HF picks the attention function by `config._attn_implementation`,
and a model under another name would also change what HF builds its masks with (a name unknown to
`AttentionMaskInterface` gets no causal mask at all: a prompt's forward would see the future) and fail the
checks on "sdpa" that the lean forward (`target.lean_layers`) and HF baselines make. So the function in the
"sdpa" slot is ours, and it is HF's own for every attention module that did not opt in.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from rasd.decoding.model.kernels.mode import fast_enabled

_STOCK_SDPA = ALL_ATTENTION_FUNCTIONS["sdpa"]
# the attention modules of installed models: the only ones whose masked CPU steps keep the kv heads grouped
_GROUPED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def route_attention(model: torch.nn.Module) -> None:
    """Opt `model`'s attention modules in to `tree_sdpa` (idempotent)."""
    for module in model.modules():
        if getattr(module, "num_key_value_groups", 1) > 1:
            _GROUPED.add(module)
    ALL_ATTENTION_FUNCTIONS["sdpa"] = tree_sdpa


def tree_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """HF's sdpa attention, except that a masked CPU step of an opted-in module inside `fast_kernels()` keeps the
    kv heads grouped.

    query [B, H, T, D]; key/value [B, H_kv, past + T, D]; attention_mask [B, 1, T, past + T] (additive).
    """
    if (not fast_enabled() or attention_mask is None or query.device.type != "cpu"
            or getattr(module, "num_key_value_groups", 1) <= 1 or module not in _GROUPED
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None):
        return _STOCK_SDPA(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)   # [B, H, T, D]
    return out.transpose(1, 2).contiguous(), None
