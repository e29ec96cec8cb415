"""A KV cache that grows in place and can keep an arbitrary subset of its newest entries.

HF's `DynamicCache` concatenates the whole cache on every step (a large share of a CPU decode step:
docs/lab-notes/decoding-speed.md, "KV stores"). `TreeCache` preallocates capacity and doubles it when
full, so an update is one in-place copy of the new keys/values. After tree verification only the accepted
path must stay: `keep()` moves those entries down next to the context and truncates the rest (KV compaction).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from rasd.decoding.step.row_store import RowStore

MIN_CAPACITY = 256


class GrowableLayer(DynamicLayer):
    """One layer's keys/values in a buffer [batch, kv_heads, capacity, head_dim]; `keys` is a view."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.length = 0
        self._kbuf = key_states.new_empty((*key_states.shape[:2], 0, key_states.shape[-1]))
        self._vbuf = value_states.new_empty((*value_states.shape[:2], 0, value_states.shape[-1]))
        self.is_initialized = True
        self._refresh_views()

    def _refresh_views(self) -> None:
        self.keys = self._kbuf[..., : self.length, :]
        self.values = self._vbuf[..., : self.length, :]

    def _ensure_capacity(self, needed: int) -> None:
        """Double the buffer when full: amortised O(1) copies per token instead of O(length)."""
        capacity = self._kbuf.shape[-2]
        if needed <= capacity:
            return
        new_cap = max(MIN_CAPACITY, needed, 2 * capacity)
        for name in ("_kbuf", "_vbuf"):
            old = getattr(self, name)
            new = old.new_zeros((*old.shape[:2], new_cap, old.shape[-1]))   # zeros: see `window`
            new[..., : self.length, :] = old[..., : self.length, :]
            setattr(self, name, new)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new entries after the current length and return views of the whole cache."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        self._ensure_capacity(self.length + n)
        self._kbuf[..., self.length: self.length + n, :] = key_states
        self._vbuf[..., self.length: self.length + n, :] = value_states
        self.length += n
        self._refresh_views()
        return self.keys, self.values

    def window(self, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the first max(span, length) slots, for exact attention's calls, which read keys up to a
        grid past the cache's length (`exact_attention`), masked. Why those slots are finite: buffers are
        allocated zeroed and only ever hold entries, so a masked score is never NaN."""
        self._ensure_capacity(span)
        end = max(span, self.length)
        return self._kbuf[..., :end, :], self._vbuf[..., :end, :]

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest `-tokens_to_remove` entries (HF convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of entries to remove")
        if self.is_initialized and tokens_to_remove:
            self.length = max(0, self.length + tokens_to_remove)
            self._refresh_views()

    def keep(self, start: int, offsets: torch.Tensor) -> None:
        """Keep entries `start + offsets` (sorted) at `start ..`, dropping everything after them."""
        if not self.is_initialized:
            return
        n = offsets.numel()
        src = offsets.to(self._kbuf.device) + start
        self._kbuf[..., start: start + n, :] = self._kbuf.index_select(-2, src)
        self._vbuf[..., start: start + n, :] = self._vbuf.index_select(-2, src)
        self.length = start + n
        self._refresh_views()


class TreeCache(DynamicCache, RowStore):
    """DynamicCache whose layers are `GrowableLayer`s; adds `keep()` for KV compaction. A `RowStore` of one row."""

    def __init__(self, num_layers: int):
        super(DynamicCache, self).__init__(layers=[GrowableLayer() for _ in range(num_layers)])

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> TreeCache:
        """A cache with one layer per decoder layer of `model`."""
        config = model.config.get_text_config(decoder=True)
        return cls(int(config.num_hidden_layers))

    def keep(self, start: int, node_indices: Sequence[int]) -> None:
        """After verifying a tree appended at `start`, keep only the given tree nodes, in order.

        When the kept nodes are already the first ones (a chain accepted from its start) this is only a
        truncation; otherwise the kept entries are gathered down to `start`.
        """
        n = len(node_indices)
        if list(node_indices) == list(range(n)):
            current = self.get_seq_length()
            self.crop(-(current - start - n))
            return
        offsets = torch.as_tensor(list(node_indices), dtype=torch.long)
        for layer in self.layers:
            layer.keep(start, offsets)

    @property
    def rows(self) -> int:
        """One request's cache: one row (`RowStore`)."""
        return 1

    def keep_rows(self, start: int, kept: Sequence[Sequence[int]]) -> None:
        """`keep` for the one row (`RowStore`)."""
        (nodes,) = kept
        self.keep(start, nodes)


def drop_rows(row_lengths: list[int], rows: Sequence[int], move: Callable[[int, int, int], None]) -> list[int]:
    """Remove `rows` from a slotted cache by moving its last row into each freed slot (`move(src, dst,
    length)` copies the entries); edits `row_lengths` and returns the old row index now at each position."""
    order = list(range(len(row_lengths)))
    for b in sorted(set(rows), reverse=True):
        last = len(order) - 1
        if b != last:
            move(last, b, row_lengths[last])
            order[b] = order[last]
            row_lengths[b] = row_lengths[last]
        order.pop()
        row_lengths.pop()
    return order


def cache_kwargs(model: torch.nn.Module, cache: TreeCache) -> dict[str, TreeCache]:
    """Pass the cache under the name this transformers version expects (`cache` from 5.2x on)."""
    return {_cache_arg(type(model)): cache}


@functools.cache
def _cache_arg(model_class: type) -> str:
    """Looked up once per model class: `inspect.signature` on every decoding step costs measurable time."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"
