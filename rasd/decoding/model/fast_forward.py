"""A lean forward for Llama-family causal LMs: HF's own operations, without HF's per-module call overhead.

Why: a decoding step of a small model on a CPU is short, and a good part of what is not matrix products is
Python: `nn.Module.__call__` hook checks on every module, keyword-argument decorators, output dataclasses,
mask building and cache dispatch. A draft forward is shorter still, so there the overhead is most of the
cost (measurements: docs/lab-notes/decoding-speed.md, "Lean forward"). This module runs the same tensors
through the same operations in the same order — embedding, RMSNorm in float32, rotary from the model's own
`rotary_emb`, q/k/v/o and MLP through each Linear's (possibly `kernels`-patched) `forward`,
`scaled_dot_product_attention` with grouped kv heads, the final norm and the LM head as modules (so forward
hooks on them, such as AdaEAGLE's tap, still fire) — and writes keys/values straight into the `TreeCache`
layers. Logits match HF's forward bit for bit on the
architectures it accepts (tests/decoding/test_fast_forward.py); anything else goes through HF.

Used only inside `kernels.fast_kernels()` (the engine's fast path); outside it, and for models whose layers it
does not run (`target.TargetModel.lean`), `forward` calls the HF model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rasd.decoding.model import exact_attention
from rasd.decoding.model.features import layer_keepers
from rasd.decoding.model.kernels import GATE_UP, QKV, REDUCED, fast_kernels, projections
from rasd.decoding.model.target import TargetModel
from rasd.decoding.step.cache import TreeCache, cache_kwargs


def supports(model: torch.nn.Module) -> bool:
    """Whether `forward` may bypass HF for this model (else it calls the model itself): `TargetModel.lean`."""
    return TargetModel.of(model).lean


def forward(model: torch.nn.Module, cache: TreeCache, input_ids: torch.Tensor, position_ids: torch.Tensor,
            mask: torch.Tensor | None = None, last_only: bool = False, exact: bool = True) -> torch.Tensor:
    """Logits [1, T, vocab] (or [1, 1, vocab] with `last_only`) for input_ids [1, T], appending to `cache`.

    mask: additive [1, 1, T, past + T], or None for plain causal attention over the cache. `exact`: a tree step of
    a reduced-precision model computes each node as plain decoding would (`row_exact`); a draft model's need not.
    """
    if not TargetModel.of(model).runs_lean(input_ids.device):
        return _hf_forward(model, cache, input_ids, position_ids, mask, last_only)
    exactly = exact and row_exact(model)
    if exactly and mask is None and input_ids.shape[1] > 1:   # a prompt: in chunks on the grid (`_on_grid`)
        hidden = _on_grid(model.model, cache, input_ids, position_ids)
    else:
        plans = _plans(cache, input_ids, mask) if exactly else None
        hidden = _decode(model.model, cache, input_ids, position_ids, mask, plans)
    # normed at every position (cheap) before the cut, so a feature reader (`decoding.features`) sees them all
    normed = model.model.norm(hidden)
    return model.lm_head(normed[:, -1:] if last_only else normed)


def _plans(cache: TreeCache, input_ids: torch.Tensor, mask: torch.Tensor | None
           ) -> list[exact_attention.RowPlan] | None:
    """Exact attention's plans for a step (a plain step's too: it must run the rule its tree nodes run)."""
    if mask is not None:
        return exact_attention.plan(mask)
    return exact_attention.plain(input_ids.shape[0], cache.get_seq_length(), input_ids.device)


PROMPT_GRID = 64   # reduced precision: prompt tokens run in chunks that start on multiples of this (`_on_grid`)


def prompt_grid(model: torch.nn.Module) -> int:
    """The grid a prompt's chunks (a prefix-cache hit, a chunked prefill) must start on for this model: 1 (any)
    unless it is row-exact (`row_exact`)."""
    return PROMPT_GRID if _lean_and_exact(model) else 1


def _on_grid(inner: torch.nn.Module, cache: TreeCache, input_ids: torch.Tensor, position_ids: torch.Tensor
             ) -> torch.Tensor:
    """Hidden states [1, T, H] of prompt tokens, run in chunks that end at multiples of `PROMPT_GRID`.

    Why: a row of a causal prompt forward gets other bits depending on how many rows share the call (the kernel
    tiles its queries by their count). With chunks fixed by absolute position, a prompt prefilled at once, after
    a prefix-cache hit (hits are cut to the grid) or in a batch's chunks runs the very same calls, so its K/V and
    first token are the same bits on every path, as reduced precision needs (`row_exact`)."""
    past, total = cache.get_seq_length(), input_ids.shape[1]
    keepers = layer_keepers(inner)
    collected = _Collect() if keepers else None
    parts, start = [], past
    while start < past + total:
        end = min((start // PROMPT_GRID + 1) * PROMPT_GRID, past + total)
        piece = slice(start - past, end - past)
        parts.append(_decode(inner, cache, input_ids[:, piece], position_ids[:, piece], None,
                             keepers=[collected] if collected is not None else []))
        start = end
    if collected is not None:
        for keeper in keepers:
            for index, outs in collected.outs.items():
                keeper.keep(index, torch.cat(outs, dim=1))
    return torch.cat(parts, dim=1)


class _Collect:
    """Stands in for the feature keepers while a prompt runs in chunks: each layer's outputs, chunk by chunk."""

    def __init__(self) -> None:
        self.outs: dict[int, list[torch.Tensor]] = {}

    def keep(self, index: int, out: torch.Tensor) -> None:
        self.outs.setdefault(index, []).append(out)


def prefill(model: torch.nn.Module, cache: TreeCache, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [vocab] of the last of `input_ids` [1, T] appended to `cache` after its entries.

    A reduced-precision model on the lean path prefills through it too (inside `fast_kernels`): its cache then
    holds what every later step computes with (float32 K/V, `_attention_dtype`), the same bits with or without
    a prefix hit. Others run HF's forward, as they always did."""
    past = cache.get_seq_length()
    if _lean_and_exact(model):
        positions = torch.arange(past, past + input_ids.shape[1], device=input_ids.device)[None]
        with fast_kernels(True):
            return forward(model, cache, input_ids, positions, last_only=True)[0, -1]
    out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
    return out.logits[0, -1]


def _lean_and_exact(model: torch.nn.Module) -> bool:
    """Row-exact (`row_exact`) and run by the lean forward: the models whose prompts run on the grid."""
    return row_exact(model) and TargetModel.of(model).lean


def row_exact(model: torch.nn.Module) -> bool:
    """Whether tree steps compute every node as plain decoding would, bit for bit (`exact_attention`): the lean
    CPU path of a model in reduced precision, where a last-bit difference would grow into another token."""
    param = next(model.parameters())
    return param.device.type == "cpu" and param.dtype in REDUCED



def _hf_forward(model: torch.nn.Module, cache: TreeCache, input_ids: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor | None, last_only: bool) -> torch.Tensor:
    extra: dict[str, Any] = {"logits_to_keep": 1} if last_only else {}
    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=True,
                **cache_kwargs(model, cache), **extra)
    return out.logits


def _decode(inner: torch.nn.Module, cache: TreeCache, input_ids: torch.Tensor, position_ids: torch.Tensor,
            mask: torch.Tensor | None, plans: list[exact_attention.RowPlan] | None = None,
            keepers: list[Any] | None = None) -> torch.Tensor:
    """Hidden states [1, T, H] after the last decoder layer (before the final norm). `keepers`: who is handed
    each layer's output (default: the model's feature keepers)."""
    hidden = F.embedding(input_ids, inner.embed_tokens.weight)           # [1, T, H]
    cos, sin = inner.rotary_emb.forward(hidden, position_ids)            # [1, T, D] each
    cos, sin = cos[:, None], sin[:, None]                                # broadcast over heads
    causal, pad = False, 0
    if mask is None and input_ids.shape[1] > 1:
        past = cache.get_seq_length()
        if past < input_ids.shape[1]:       # the causal kernel, its queries padded over the cache (`_layer`)
            causal, pad = True, past
        else:
            mask = _causal_mask(past, input_ids.shape[1], hidden.dtype, hidden.device)
    if keepers is None:   # a fused EAGLE head reads some layers' outputs (`decoding.features`)
        keepers = layer_keepers(inner)
    for i, (layer, kv) in enumerate(zip(inner.layers, cache.layers, strict=False)):
        hidden = _layer(layer, kv, hidden, cos, sin, mask, causal, pad, plans)
        for keeper in keepers:
            keeper.keep(i, hidden)
    return hidden


def _layer(layer: torch.nn.Module, kv: Any, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           mask: torch.Tensor | None, causal: bool = False, pad: int = 0,
           plans: list[exact_attention.RowPlan] | None = None) -> torch.Tensor:
    """One decoder layer, as LlamaDecoderLayer computes it.

    `causal`: the new tokens attend causally to themselves and to all `pad` cached entries before them.
    Why pad: the causal kernel aligns its triangle to the top left, so the queries get `pad` zero rows in
    front (dropped afterwards). That runs the kernel on the same shapes as one prefill of the whole prompt,
    skipping the masked half as it does, and gives the same bits for the new rows (a prefix-cache hit is
    exact); an explicit mask would make every query visit every key.

    `plans`: each tree node attends in its own call, as plain decoding would (`exact_attention`).
    """
    attn = layer.self_attn
    batch, length = hidden.shape[:2]
    x = _rms(hidden, layer.input_layernorm)
    shape = (batch, length, -1, attn.head_dim)
    q, k, v = (t.view(shape).transpose(1, 2) for t in projections(attn, QKV, x))   # [B, H or H_kv, T, D]
    q, k, v = _attention_dtype(_rotate(q, cos, sin), _rotate(k, cos, sin), v)
    k, v = kv.update(k, v)                                               # [B, H_kv, past + T, D]
    if plans is not None:
        k, v = kv.window(max(rp.span for rp in plans))                   # [B, H_kv, >= past + T, D]
        o = exact_attention.attend(q, k, v, plans, attn.scaling)
    else:
        if pad:
            q = torch.cat([q.new_zeros((*q.shape[:2], pad, q.shape[-1])), q], dim=2)   # [B, H, past + T, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask.to(q.dtype),
                                           is_causal=causal, scale=attn.scaling, enable_gqa=True)[:, :, pad:]
    o = o.transpose(1, 2).reshape(batch, length, -1).to(hidden.dtype)   # [B, T, H * D]
    return _mlp_block(layer, hidden + attn.o_proj.forward(o))


def _attention_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v in float32 on a CPU when they are bf16/fp16 (the cache then holds float32, exactly the same values).

    Why: on CPUs the reduced-precision attention kernel is slower than float32's for the few queries of a
    decoding step (one query over 600 keys: 340 us against 52 us, 2-core AVX-512 EPYC), and attention reads
    little memory next to the weights."""
    if q.device.type != "cpu" or q.dtype not in REDUCED:
        return q, k, v
    return q.float(), k.float(), v.float()


def _mlp_block(layer: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The layer's second half: pre-norm gated SiLU MLP plus its residual."""
    mlp = layer.mlp
    gate, up = projections(mlp, GATE_UP, _rms(hidden, layer.post_attention_layernorm))
    return hidden + mlp.down_proj.forward(F.silu(gate) * up)


def _rms(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """LlamaRMSNorm.forward: normalise in float32, scale in the input dtype."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x32.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary_pos_emb for one tensor: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _causal_mask(past: int, length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive [1, 1, T, past + T]: token i sees the cache and new tokens 0..i."""
    allowed = torch.ones(length, past + length, dtype=torch.bool, device=device).tril(diagonal=past)
    mask = torch.zeros(length, past + length, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def _prompt_mask(past: int, length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """Prompt tokens attending causally: None (use the causal kernel) on an empty cache, else a mask.

    Why both: the causal kernel skips the masked half of the products, but its causal flag aligns to the
    top-left, so after a cache it would hide the cache; there an explicit mask is needed.
    """
    return _causal_mask(past, length, dtype, device) if past else None


def forward_mixed(model: torch.nn.Module, cache: TreeCache, input_ids: torch.Tensor, position_ids: torch.Tensor,
                  mask: torch.Tensor, chunk_cache: TreeCache, chunk_ids: torch.Tensor,
                  chunk_last: bool) -> torch.Tensor:
    """A batched tree step [B, W] and a chunk of one prompt's prefill [1, C] through the layers together.

    Why: a batched step's matrix products run far below the CPU's peak (they stream every weight for few
    rows), while a prefill alone is at peak. Stacked, every Linear multiplies B·W + C rows at once,
    so the prefill rides along on the weights the step reads anyway (vLLM's chunked prefill, on a CPU).
    Attention stays separate: the rows attend to the batch cache with `mask`, the chunk causally to its own
    cache. Returns logits [B·W (+ 1), vocab]: the rows' nodes, then the chunk's last position if `chunk_last`.
    """
    inner = model.model
    batch, width = input_ids.shape
    rows = batch * width
    past = chunk_cache.get_seq_length()
    chunk_pos = torch.arange(past, past + chunk_ids.shape[1], device=chunk_ids.device)[None]
    embed = inner.embed_tokens.weight
    hidden_d, hidden_c = F.embedding(input_ids, embed), F.embedding(chunk_ids, embed)
    rope_d = [t[:, None] for t in inner.rotary_emb.forward(hidden_d, position_ids)]       # [B, 1, W, D]
    rope_c = [t[:, None] for t in inner.rotary_emb.forward(hidden_c, chunk_pos)]          # [1, 1, C, D]
    mask_c = _prompt_mask(past, chunk_ids.shape[1], hidden_c.dtype, hidden_c.device)
    hidden = torch.cat([hidden_d.reshape(rows, -1), hidden_c[0]])                         # [B·W + C, H]
    keepers = layer_keepers(inner)
    plans = exact_attention.plan(mask) if row_exact(model) else None
    for i, (layer, kv_d, kv_c) in enumerate(zip(inner.layers, cache.layers, chunk_cache.layers, strict=False)):
        hidden = _layer_mixed(layer, (kv_d, kv_c), hidden, (batch, width), (rope_d, rope_c), (mask, mask_c), plans)
        for keeper in keepers:
            keeper.keep(i, hidden)
    normed = model.model.norm(hidden)   # every position: the chunk's features too (`decoding.features`)
    return model.lm_head(torch.cat([normed[:rows], normed[-1:]]) if chunk_last else normed[:rows])


def _layer_mixed(layer: torch.nn.Module, kvs: tuple[Any, Any], hidden: torch.Tensor, shape: tuple[int, int],
                 ropes: tuple[list[torch.Tensor], list[torch.Tensor]],
                 masks: tuple[torch.Tensor, torch.Tensor | None],
                 plans: list[exact_attention.RowPlan] | None = None) -> torch.Tensor:
    """`_layer` on stacked rows [B·W + C, H]: shared products, attention per part (mask None: causal)."""
    attn = layer.self_attn
    batch, width = shape
    rows = batch * width
    x = _rms(hidden, layer.input_layernorm)
    q, k, v = projections(attn, QKV, x)
    outs = []
    for part, (kv, (cos, sin), mask) in enumerate(zip(kvs, ropes, masks, strict=True)):
        sl = slice(0, rows) if part == 0 else slice(rows, None)
        lead = (batch, width) if part == 0 else (1, hidden.shape[0] - rows)
        qp, kp, vp = (t[sl].view(*lead, -1, attn.head_dim).transpose(1, 2) for t in (q, k, v))
        qp, kp, vp = _attention_dtype(_rotate(qp, cos, sin), _rotate(kp, cos, sin), vp)
        kp, vp = kv.update(kp, vp)
        if part == 0 and plans is not None:
            kp, vp = kv.window(max(rp.span for rp in plans))
            o = exact_attention.attend(qp, kp, vp, plans, attn.scaling)
        else:
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=None if mask is None else mask.to(qp.dtype),
                                               is_causal=mask is None, scale=attn.scaling, enable_gqa=True)
        outs.append(o.transpose(1, 2).reshape(-1, o.shape[1] * o.shape[-1]))
    return _mlp_block(layer, hidden + attn.o_proj.forward(torch.cat(outs).to(hidden.dtype)))
