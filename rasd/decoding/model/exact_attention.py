"""Tree attention whose every node is computed exactly as plain decoding computes that token, bit for bit.

Why: in bf16 a product's result is rounded to 8 bits of mantissa after every layer, so the last-bit differences
that another summation order makes (a masked multi-query attention against plain decoding's one-query call; in
fp32 they stay ~1e-7 and never reach a token) flip roundings, grow through the layers and change greedy tokens
within a few dozen. Verification is only lossless if a tree node's logits equal those plain decoding would
compute for the same path. The products are made row-exact elsewhere (`kernels.linear`: one row padded to two,
so every row count takes the same kernel); attention is made exact here, by construction: each node attends in
a call of its own, with one query, over a contiguous cache that holds exactly what plain decoding's cache would
hold at that token (the row's committed context, then the node's ancestors and itself, in order).

How, without copying the cache per node: the tree's entries were appended after the row's context by the cache
update; nodes are visited depth first, each node's entry is copied to the slot of its depth right after the row's
own context (its ancestors are already there), the call reads a view of the first `length` slots, and the
appended block is put back afterwards (so `keep` compacts as before). A chain's nodes copy nothing.

Attention itself runs in float32 on the CPU (see `fast_forward._layer`): the one-query bf16 kernel is several
times slower than the float32 one there, and the K/V values of a bf16 model are exact in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class NodeAttention:
    """One tree node's attention: query `query` of batch row `row` sees `length` keys once `write` is placed."""

    row: int
    query: int
    length: int                # the row's context + the node's depth + 1
    write: int | None          # the node's own entry (offset from the row's `base`) to copy to slot length - 1;
                               # None: that slot already holds it


@dataclass(frozen=True)
class RowPlan:
    """A batch row's nodes in depth-first order and the slots they borrow: [base, end) is saved before and
    restored after."""

    base: int                  # the row's committed context length
    end: int                   # the shared end of the appended tree block
    nodes: tuple[NodeAttention, ...]

    @property
    def borrows(self) -> bool:
        return any(n.write is not None for n in self.nodes)


def plan(mask: torch.Tensor) -> list[RowPlan]:
    """Each batch row's nodes from an additive tree mask [B, 1, T, past + T] (0: visible).

    Every query must see a prefix [0, base) of the cache and then some of the appended block [past, past + T)
    (its ancestors and itself, in order): what `verify.batch_inputs` builds. Nodes are visited depth first, so
    when a node is reached its ancestors already lie in the slots after the context, and only its own entry may
    need copying (to the slot of its depth). A node past the first that sees no ancestor is a padding copy of the
    root (`verify.batch_inputs`): skipped, its output left zero."""
    batch, _, width, total = mask.shape
    past = total - width
    visible = (mask[:, 0] == 0).cpu()                                       # [B, T, past + T]
    plans = []
    for b in range(batch):
        base = int(visible[b, 0, :past].sum())
        if not bool(visible[b, :, :base].all()) or bool(visible[b, :, base:past].any()):
            raise ValueError("exact tree attention needs every node to see its row's context as a prefix")
        paths = [(visible[b, j, past:].nonzero().flatten() + past).tolist() for j in range(width)]
        occupant = {past + j: past + j for j in range(width)}               # slot -> whose entry is there
        nodes = []
        for j in sorted(range(width), key=lambda q: paths[q]):             # depth first: by path
            if j > 0 and len(paths[j]) == 1:
                continue   # a padding copy of the root (a shorter tree in a batch): its output is never read
            slot, own = base + len(paths[j]) - 1, past + j
            write = None if occupant.get(slot) == own else own - base
            occupant[slot] = own
            nodes.append(NodeAttention(b, j, slot + 1, write))
        plans.append(RowPlan(base, total, tuple(nodes)))
    return plans


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plans: list[RowPlan],
           scale: float | None) -> torch.Tensor:
    """query [B, H, T, D]; keys/values [B, H_kv, past + T, D], views of the cache (their storage is borrowed
    and restored) -> [B, H, T, D], each node by its own one-query call (`NodeAttention`)."""
    out = query.new_zeros((*query.shape[:3], values.shape[-1]))
    for row, rp in enumerate(plans):
        saved = (keys[row, :, rp.base: rp.end].clone(), values[row, :, rp.base: rp.end].clone()) if rp.borrows else None
        k_row, v_row, q_row = keys[row: row + 1], values[row: row + 1], query[row: row + 1]
        for node in rp.nodes:
            if node.write is not None and saved is not None:
                keys[row, :, node.length - 1] = saved[0][:, node.write]
                values[row, :, node.length - 1] = saved[1][:, node.write]
            out[row, :, node.query] = F.scaled_dot_product_attention(
                q_row[:, :, node.query: node.query + 1], k_row[:, :, : node.length], v_row[:, :, : node.length],
                scale=scale, enable_gqa=True)[0, :, 0]
        if saved is not None:
            keys[row, :, rp.base: rp.end] = saved[0]
            values[row, :, rp.base: rp.end] = saved[1]
    return out
