"""Tree attention whose every node is computed exactly as plain decoding computes that token, bit for bit.

Why: in bf16 a product's result is rounded to 8 bits of mantissa after every layer, so the last-bit differences
that another summation order makes (a masked multi-query attention against plain decoding's one-query call; in
fp32 they stay ~1e-7 and never reach a token) flip roundings, grow through the layers and change greedy tokens
within a few dozen. Verification is only lossless if a tree node's logits equal those plain decoding would
compute for the same path. The products are made row-exact elsewhere (`kernels.linear`: one row padded to two,
so every row count takes the same kernel); attention is made exact here, by one rule that plain decoding and
tree steps share (`attention_call`):

- a query sees a contiguous cache holding exactly what plain decoding's cache would hold at that token (the
  row's committed context, then the node's ancestors and itself, in order), its `length` first slots;
- the call reads the slots up to `length` rounded up to a multiple of `GRID`, the rest masked, and carries at
  least `MIN_QUERIES` queries (padded with copies).

Under that rule the CPU kernel gives a query the same bits whichever other queries share its call (checked at
1-64 queries, 5-4096 keys: tests/decoding/test_row_exact.py). A one-query call without the rule takes another
kernel (other bits), and a call whose keys run a whole `GRID` past a query's own rounded length changes that
query's bits: so plain decoding pads its one query too, and a call only groups queries of the same `GRID` cell.
A chain of 8 nodes is then one or two calls per layer instead of eight (a long context's tree step was mostly
these calls: docs/lab-notes/precision.md).

How, without copying the cache per node: the tree's entries were appended after the row's context by the cache
update; nodes are visited depth first, each node's entry is copied to the slot of its depth right after the row's
own context (its ancestors are already there). Nodes are run in groups: a group ends where the next node's copy
would overwrite a slot a waiting node reads (a branch), and the appended block is put back after the row (so
`keep` compacts as before). A chain copies nothing and is one group.

Attention itself runs in float32 on the CPU (see `fast_forward._layer`): the one-query bf16 kernel is several
times slower than the float32 one there, and the K/V values of a bf16 model are exact in float32. The slots past
the cache's length that a call reads must be finite (masked scores of NaN keys would be NaN): the caches keep
them zero or old entries (`cache.GrowableLayer.window`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

GRID = 64          # a call reads its queries' keys rounded up to a multiple of this
MIN_QUERIES = 4    # and carries at least this many queries: fewer take another kernel (other bits)


@dataclass(frozen=True)
class NodeAttention:
    """One tree node's attention: query `query` of batch row `row` sees `length` keys once `write` is placed."""

    row: int
    query: int
    length: int                # the row's context + the node's depth + 1
    write: int | None          # the node's own entry (offset from the row's `base`) to copy to slot length - 1;
                               # None: that slot already holds it


@dataclass(frozen=True)
class Call:
    """One attention call: `queries` of a row, each over its own first keys (`mask`), reading `span` slots."""

    queries: torch.Tensor      # [M] query indices, padded to `MIN_QUERIES` with copies of the last
    kept: int                  # the first `kept` of them are real
    span: int                  # slots read: the queries' cell of `GRID`
    mask: torch.Tensor         # additive [1, 1, M, span] float32: query i sees its first length_i slots


@dataclass(frozen=True)
class Group:
    """Nodes whose paths lie in the slots together: their copies (`writes`), then their calls."""

    writes: tuple[NodeAttention, ...]
    calls: tuple[Call, ...]


@dataclass(frozen=True)
class RowPlan:
    """A batch row's nodes in depth-first order and the slots they borrow: [base, end) is saved before and
    restored after."""

    base: int                  # the row's committed context length
    end: int                   # the shared end of the appended tree block
    nodes: tuple[NodeAttention, ...]
    groups: tuple[Group, ...]

    @property
    def borrows(self) -> bool:
        return any(n.write is not None for n in self.nodes)

    @property
    def span(self) -> int:
        """Slots the row's calls read (at least the cache's length: `window`)."""
        return max(call.span for group in self.groups for call in group.calls)


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
        plans.append(RowPlan(base, total, tuple(nodes), _groups(nodes, mask.device)))
    return plans


def plain(batch: int, past: int, device: torch.device | str = "cpu") -> list[RowPlan]:
    """The plan of a plain decoding step: every row's one new token over the `past` entries before it and itself."""
    plans = []
    for b in range(batch):
        node = NodeAttention(b, 0, past + 1, None)
        plans.append(RowPlan(past, past + 1, (node,), _groups([node], device)))
    return plans


def _groups(nodes: list[NodeAttention], device: torch.device | str) -> tuple[Group, ...]:
    """Depth-first nodes cut where a copy would overwrite a slot that a node still waiting for its call reads."""
    groups, pending, writes = [], [], []
    for node in nodes:
        if node.write is not None and any(p.length >= node.length for p in pending):
            groups.append(Group(tuple(writes), _calls(pending, device)))
            pending, writes = [], []
        if node.write is not None:
            writes.append(node)
        pending.append(node)
    groups.append(Group(tuple(writes), _calls(pending, device)))
    return tuple(groups)


def _calls(nodes: list[NodeAttention], device: torch.device | str) -> tuple[Call, ...]:
    """One call per `GRID` cell of the nodes' lengths (`attention_call`'s rule)."""
    cells: dict[int, list[NodeAttention]] = {}
    for node in nodes:
        cells.setdefault(-(-node.length // GRID), []).append(node)
    return tuple(_call([n.query for n in cell], [n.length for n in cell], device) for cell in cells.values())


def _call(queries: list[int], lengths: list[int], device: torch.device | str) -> Call:
    padded = max(MIN_QUERIES - len(queries), 0)
    index = queries + [queries[-1]] * padded
    lengths = lengths + [lengths[-1]] * padded
    span = -(-max(lengths) // GRID) * GRID
    hidden = torch.arange(span)[None] >= torch.tensor(lengths)[:, None]   # [M, span]
    mask = torch.zeros(len(index), span).masked_fill_(hidden, float("-inf"))
    return Call(torch.tensor(index, device=device), len(queries), span, mask[None, None].to(device))


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plans: list[RowPlan],
           scale: float | None) -> torch.Tensor:
    """query [B, H, T, D]; keys/values [B, H_kv, >= past + T, D], views of the cache reaching every plan's
    `span` (their storage is borrowed and restored) -> [B, H, T, D], each node by the shared rule (`Call`)."""
    out = query.new_zeros((*query.shape[:3], values.shape[-1]))
    for row, rp in enumerate(plans):
        saved = (keys[row, :, rp.base: rp.end].clone(), values[row, :, rp.base: rp.end].clone()) if rp.borrows else None
        k_row, v_row, q_row = keys[row: row + 1], values[row: row + 1], query[row: row + 1]
        for group in rp.groups:
            for node in group.writes:
                if saved is not None and node.write is not None:
                    keys[row, :, node.length - 1] = saved[0][:, node.write]
                    values[row, :, node.length - 1] = saved[1][:, node.write]
            for call in group.calls:
                out[row, :, call.queries[: call.kept]] = _attention_call(q_row, k_row, v_row, call, scale)
        if saved is not None:
            keys[row, :, rp.base: rp.end] = saved[0]
            values[row, :, rp.base: rp.end] = saved[1]
    return out


def _attention_call(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, call: Call,
                    scale: float | None) -> torch.Tensor:
    """[H, kept, D]: one call under the rule, query [1, H, T, D], keys/values [1, H_kv, >= span, D]."""
    out = F.scaled_dot_product_attention(query[:, :, call.queries], keys[:, :, : call.span],
                                         values[:, :, : call.span], attn_mask=call.mask.to(query.dtype),
                                         scale=scale, enable_gqa=True)
    return out[0, :, : call.kept]
