"""Static-shape tree verification: a preallocated KV store, bucketed shapes, CUDA-graph replay on a GPU.

Why: on a GPU a small model's verification forward is launch-bound: its time hardly depends on the tree's
size and is far above what reading its weights takes (docs/lab-notes/decoding-speed.md, "Static step"). A
CUDA graph replays the whole step's kernels with one launch, but only for fixed shapes and fixed memory.
So every input of a step lives in a static buffer, shapes are padded to buckets, and keys/values go into
a store that never moves while graphs point into it.

Layout (the batch cache's, made static):
- store [layers, 2 (k, v), slots, kv_heads, capacity, head_dim], zero-initialised (masked entries must be
  finite: an additive mask does not hide a NaN). Row b holds its committed entries [0, len_b).
- a step writes every row's tree at the shared end S = max(len_b), padded to a tree bucket Tb (1, 2, 4,
  ...), rows padded to a batch bucket Bb; attention reads keys [0, Kb), Kb a power of two >= S + Tb. A padded
  node (a copy of its root) and a padded row (length 0) see only themselves: never NaN, never accepted
  (acceptance reads only a tree's real nodes), and their writes land in masked slots.
- the mask is built inside the step from the row lengths, S and the trees' ancestor matrices, so the host
  copies B·T² booleans per step rather than a B·T·K float mask.
After acceptance `keep_rows` moves each row's accepted entries down to its own length: one gather and one
scatter over the whole store. Prefill stays eager (a prompt's length is not worth a graph): `add_row` copies
a prefilled one-row `TreeCache` into a slot.

On a CPU the same code runs uncaptured (tests; the CPU default stays the dynamic lean path, which is
faster there). Graphs are captured lazily, one per (Bb, Tb, Kb), at most `max_graphs`; later shapes run
eagerly. A store that must grow (more rows or a longer context) drops its graphs, which point into it.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rasd.decoding.model import fast_forward
from rasd.decoding.model.features import layer_keepers, norm_tap
from rasd.decoding.model.kernels import QKV, projections
from rasd.decoding.model.target import TargetModel
from rasd.decoding.step.cache import TreeCache, drop_rows
from rasd.decoding.step.row_store import SlotStore
from rasd.decoding.step.sampling import SamplingParams
from rasd.decoding.step.tree import DraftTree
from rasd.decoding.step.verify import Process, Verdict, accept

MIN_KEYS = 256          # smallest key bucket (and initial capacity)
MAX_GRAPHS = 96         # graphs kept per store; shapes beyond run eagerly


@dataclass(frozen=True)
class StepConfig:
    """How verification forwards run: the dynamic lean/HF path, or the static one (captured on CUDA)."""

    static: bool = False
    graphs: bool = False

    @classmethod
    def for_device(cls, device: str | torch.device, graphs: bool = True) -> StepConfig:
        """CUDA: static shapes in CUDA graphs (unless `graphs` is off); CPU: the dynamic lean path."""
        cuda = torch.device(device).type == "cuda"
        return cls(static=cuda and graphs, graphs=cuda and graphs)

    @property
    def label(self) -> str:
        """For cost-curve keys and reports: `dynamic`, `static` or `graphs`."""
        return "graphs" if self.graphs else "static" if self.static else "dynamic"

    def applies(self, model: torch.nn.Module) -> bool:
        """The static path runs the lean layer code, so only on the architectures that code accepts."""
        return TargetModel.of(model).runs_static(self.static)


def bucket(n: int) -> int:
    """The power of two >= n (>= 1): a handful of shapes instead of one per size."""
    return 1 << max(n - 1, 0).bit_length()


@dataclass
class _Inputs:
    """One shape's static input buffers (graph inputs are read from these addresses on every replay)."""

    ids: torch.Tensor       # [Bb, Tb] long
    pos: torch.Tensor       # [Bb, Tb] long
    lens: torch.Tensor      # [Bb] long: each row's committed length
    start: torch.Tensor     # [1] long: the shared end S, where the trees are written
    anc: torch.Tensor       # [Bb, Tb, Tb] bool: node i sees node j of its own tree
    keys: int               # Kb


class StaticRows(SlotStore):
    """The static KV store of up to `slots` rows and the (captured) verification step over it (`SlotStore`)."""

    def __init__(self, model: torch.nn.Module, slots: int = 1, graphs: bool = False,
                 capacity: int = MIN_KEYS, max_graphs: int = MAX_GRAPHS):
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.graphs = graphs and self.device.type == "cuda"
        self.max_graphs = max_graphs
        layer = model.model.layers[0].self_attn
        self.head_dim = int(layer.head_dim)
        self.kv_heads = int(layer.k_proj.out_features) // self.head_dim
        self.row_lengths: list[int] = []
        self.in_use = False
        self._captured: dict[tuple[int, int, int], tuple[Any, torch.Tensor, torch.Tensor]] = {}   # graph, logits, feats
        self._inputs: dict[tuple[int, int, int], _Inputs] = {}
        self._pool: Any = None
        self.kv = self._new_store(bucket(slots), max(capacity, MIN_KEYS))

    # ------------------------------------------------------------------ the store
    def _new_store(self, slots: int, capacity: int) -> torch.Tensor:
        layers = len(self.model.model.layers)
        return torch.zeros(layers, 2, slots, self.kv_heads, capacity, self.head_dim, dtype=self.dtype,
                           device=self.device)

    @property
    def slots(self) -> int:
        return int(self.kv.shape[2])

    @property
    def capacity(self) -> int:
        return int(self.kv.shape[4])

    @property
    def rows(self) -> int:
        return len(self.row_lengths)

    def get_seq_length(self) -> int:
        """The shared end S: where the next step writes its trees."""
        return max(self.row_lengths, default=0)

    def _ensure(self, slots: int, capacity: int) -> None:
        """Grow the store (doubling what grows); graphs point into the old one, so they are dropped."""
        if slots <= self.slots and capacity <= self.capacity:
            return
        new = self._new_store(max(bucket(slots), self.slots),
                              max(capacity, 2 * self.capacity) if capacity > self.capacity else self.capacity)
        end = self.get_seq_length()
        new[:, :, : self.rows, :, :end] = self.kv[:, :, : self.rows, :, :end]
        self.kv = new
        self.reset_graphs()

    def reset_graphs(self) -> None:
        """Forget every captured graph and its buffers (the next steps capture again), and their memory
        pool: the allocator refuses to capture into a pool whose graphs are gone while it still holds blocks."""
        self._captured.clear()
        self._inputs.clear()
        self._pool = None

    def add_row(self, single: TreeCache) -> int:
        """Copy a prefilled one-row cache into the next slot; returns its row index."""
        length = single.get_seq_length()
        row = self.rows
        self._ensure(row + 1, max(length + 1, MIN_KEYS))
        for i, layer in enumerate(single.layers):
            self.kv[i, 0, row, :, :length] = layer.keys[0]
            self.kv[i, 1, row, :, :length] = layer.values[0]
        self.row_lengths.append(length)
        return row

    def remove_rows(self, rows: Sequence[int]) -> list[int]:
        """Drop rows (the last row moves into a freed slot); returns the old index now at each position."""
        def move(src: int, dst: int, length: int) -> None:
            self.kv[:, :, dst, :, :length] = self.kv[:, :, src, :, :length]

        return drop_rows(self.row_lengths, rows, move)

    def clear(self) -> None:
        """No rows (graphs stay: they depend on shapes and addresses only)."""
        self.row_lengths = []

    def keep_rows(self, start: int, kept: Sequence[Sequence[int]]) -> None:
        """After a step written at `start`, keep row b's tree nodes `kept[b]` at its own length."""
        rows = [b for b, nodes in enumerate(kept) for _ in nodes]
        src = [start + i for nodes in kept for i in nodes]
        dst = [self.row_lengths[b] + j for b, nodes in enumerate(kept) for j in range(len(nodes))]
        if src != dst:
            b_idx, src_idx, dst_idx = (torch.tensor(x, dtype=torch.long, device=self.device)
                                       for x in (rows, src, dst))
            self.kv[:, :, b_idx, :, dst_idx] = self.kv[:, :, b_idx, :, src_idx]   # gathered before scattered
        self.row_lengths = [n + len(nodes) for n, nodes in zip(self.row_lengths, kept, strict=True)]

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def forward(self, trees: Sequence[DraftTree]) -> torch.Tensor:
        """Logits [B, T, vocab] (float32, T = the largest tree) of every row's tree, appended at the shared end."""
        if len(trees) != self.rows:
            raise ValueError(f"{len(trees)} trees for {self.rows} rows")
        start, width = self.get_seq_length(), max(len(t) for t in trees)
        shape = (bucket(len(trees)), bucket(width), max(MIN_KEYS, bucket(start + bucket(width))))
        self._ensure(shape[0], shape[2])
        inputs = self._inputs_for(shape)
        self._fill(inputs, trees, start)
        graph = self._graph(shape, inputs) if self.graphs else None
        if graph is None:
            return self._step(inputs)[0][: len(trees), :width].float()
        graph[0].replay()
        tap = norm_tap(self.model)
        if tap is not None:   # a replay runs no hooks: hand the proposers this step's features ourselves
            tap.last = graph[2][: len(trees), :width].clone()
        # the output lives in the graphs' shared pool: copied out before another graph can reuse it
        return graph[1][: len(trees), :width].float().clone()

    @torch.inference_mode()
    def verify(self, tree: DraftTree, params: SamplingParams, gen: torch.Generator | None,
               process: Process | None = None) -> tuple[Verdict, torch.Tensor]:
        """`verify.verify` for a store holding one row: forward, acceptance, compaction."""
        start = self.get_seq_length()
        logits = self.forward([tree])[0, : len(tree)]
        verdict = accept(tree, logits, params, gen, process)
        self.keep_rows(start, [[0, *verdict.accepted]])
        return verdict, logits

    def _inputs_for(self, shape: tuple[int, int, int]) -> _Inputs:
        inputs = self._inputs.get(shape)
        if inputs is None:
            rows, width, keys = shape
            long = {"dtype": torch.long, "device": self.device}
            inputs = _Inputs(ids=torch.zeros(rows, width, **long), pos=torch.zeros(rows, width, **long),
                             lens=torch.zeros(rows, **long), start=torch.zeros(1, **long),
                             anc=torch.zeros(rows, width, width, dtype=torch.bool, device=self.device), keys=keys)
            self._inputs[shape] = inputs
        return inputs

    def _fill(self, inputs: _Inputs, trees: Sequence[DraftTree], start: int) -> None:
        """Write this step's trees into the shape's buffers (host tensors, one copy each)."""
        rows, width = inputs.ids.shape
        ids = torch.zeros(rows, width, dtype=torch.long)
        pos = torch.zeros(rows, width, dtype=torch.long)
        lens = torch.zeros(rows, dtype=torch.long)
        anc = torch.eye(width, dtype=torch.bool).repeat(rows, 1, 1)     # padding sees only itself
        for b, tree in enumerate(trees):
            n, length = len(tree), self.row_lengths[b]
            ids[b, :n] = torch.tensor(tree.tokens)
            ids[b, n:] = tree.tokens[0]
            pos[b, :n] = torch.tensor(tree.depths()) + length
            pos[b, n:] = length
            lens[b] = length
            anc[b, :n, :n] = tree.ancestor_mask()
        for buf, host in ((inputs.ids, ids), (inputs.pos, pos), (inputs.lens, lens), (inputs.anc, anc)):
            buf.copy_(host, non_blocking=True)
        inputs.start.fill_(start)

    def _graph(self, shape: tuple[int, int, int], inputs: _Inputs
               ) -> tuple[Any, torch.Tensor, torch.Tensor] | None:
        """The captured step for this shape (capturing it now if there is room), or None: run eagerly."""
        graph = self._captured.get(shape)
        if graph is not None or len(self._captured) >= self.max_graphs:
            return graph
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):      # warm-up off the capture (lazy inits, cuBLAS workspaces)
            for _ in range(2):
                self._step(inputs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        cuda_graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA work (a service's event loop, a test) must not void the capture
        with torch.cuda.graph(cuda_graph, pool=self._pool, capture_error_mode="thread_local"):
            logits, normed = self._step(inputs)
        self._captured[shape] = (cuda_graph, logits, normed)
        return self._captured[shape]

    def _step(self, inputs: _Inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The static forward: logits [Bb, Tb, vocab] (model dtype) and the features [Bb, Tb, F] (the final norm's
        output, with the tapped layers' before it: `decoding.features`);
        writes K/V at S .. S + Tb of every slot."""
        inner = self.model.model
        rows, width = inputs.ids.shape
        hidden = F.embedding(inputs.ids, inner.embed_tokens.weight)                   # [Bb, Tb, H]
        cos, sin = (t[:, None] for t in inner.rotary_emb.forward(hidden, inputs.pos))  # [Bb, 1, Tb, D]
        mask = _tree_mask(inputs, hidden.dtype)                                       # [Bb, 1, Tb, Kb]
        write = inputs.start + torch.arange(width, device=self.device)                # [Tb]
        keepers = layer_keepers(inner)   # a fused EAGLE head reads some layers' outputs (`decoding.features`)
        for i, (layer, store) in enumerate(zip(inner.layers, self.kv, strict=True)):
            hidden = _layer(layer, store[:, :rows], hidden, (cos, sin), mask, write, inputs.keys)
            for keeper in keepers:
                keeper.keep(i, hidden)
        normed = inner.norm(hidden)
        tap = norm_tap(self.model)   # its hook just stacked the tapped layers before `normed`: a replay hands that
        return self.model.lm_head(normed), tap.last if tap is not None and tap.layers else normed


def _tree_mask(inputs: _Inputs, dtype: torch.dtype) -> torch.Tensor:
    """Additive [Bb, 1, Tb, Kb]: a node sees its row's committed keys and its own tree path, nothing else."""
    width = inputs.ids.shape[1]
    key = torch.arange(inputs.keys, device=inputs.ids.device)                       # [Kb]
    committed = key[None, None, :] < inputs.lens[:, None, None]                     # [Bb, 1, Kb]
    rel = key - inputs.start                                                        # [Kb]: slot in the tree
    in_tree = (rel >= 0) & (rel < width)
    path = inputs.anc.index_select(2, rel.clamp(0, width - 1)) & in_tree            # [Bb, Tb, Kb]
    visible = committed | path
    zero = torch.zeros((), dtype=dtype, device=key.device)
    return torch.where(visible, zero, torch.finfo(dtype).min)[:, None]


def _layer(layer: torch.nn.Module, store: torch.Tensor, hidden: torch.Tensor,
           rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor, write: torch.Tensor,
           keys: int) -> torch.Tensor:
    """`fast_forward._layer` on the static store [2, Bb, kv_heads, capacity, D]: new K/V written at `write`."""
    attn = layer.self_attn
    batch, length = hidden.shape[:2]
    x = fast_forward._rms(hidden, layer.input_layernorm)
    shape = (batch, length, -1, attn.head_dim)
    q, k, v = (t.view(shape).transpose(1, 2) for t in projections(attn, QKV, x))
    cos, sin = rope
    q, k = fast_forward._rotate(q, cos, sin), fast_forward._rotate(k, cos, sin)
    store[0].index_copy_(2, write, k)
    store[1].index_copy_(2, write, v)
    o = F.scaled_dot_product_attention(q, store[0, :, :, :keys], store[1, :, :, :keys], attn_mask=mask,
                                       scale=attn.scaling, enable_gqa=True)   # [Bb, H, Tb, D]
    o = o.transpose(1, 2).reshape(batch, length, -1)
    return fast_forward._mlp_block(layer, hidden + attn.o_proj.forward(o))


_SHARED: weakref.WeakKeyDictionary[torch.nn.Module, dict[int, StaticRows]] = weakref.WeakKeyDictionary()


def shared_rows(model: torch.nn.Module, slots: int, graphs: bool) -> StaticRows:
    """A store for `model` kept across requests (its graphs are captured once), or a fresh one when the
    kept one is in use (two decoders of one model running at once)."""
    kept = _SHARED.setdefault(model, {})
    rows = kept.get(slots)
    if rows is None or rows.graphs != (graphs and rows.device.type == "cuda"):
        rows = kept[slots] = StaticRows(model, slots, graphs=graphs)
    if rows.in_use:
        return StaticRows(model, slots, graphs=graphs)
    return rows
