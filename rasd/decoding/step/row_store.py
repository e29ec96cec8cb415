"""The row-store API: the K/V of one or more requests' committed tokens, onto which a verification step appends
its draft trees, and which then keeps only each row's accepted path.

Three stores share it: `TreeCache` (one request, `step.cache`), `BatchCache` (many requests in one right-padded
cache, `step.batch_decoder`) and `StaticRows` (many requests in a static, graph-friendly store,
`model.static_step`). A step appends every row's tree at the shared end S = `get_seq_length()`; `keep_rows`
then moves row b's accepted nodes down to that row's own length, dropping the rest (keeping only the root
crops the whole tree). The stores with several rows also take rows in and out between steps (`SlotStore`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from transformers.cache_utils import DynamicCache


@runtime_checkable
class RowStore(Protocol):
    """What a verification step needs from the K/V it appends to."""

    @property
    def rows(self) -> int:
        """How many requests' rows the store holds (B)."""
        ...

    def get_seq_length(self) -> int:
        """The shared end S: where the next step writes every row's tree (the longest row's length). Read it
        before a step: between a step and its `keep_rows` the dynamic stores count the trees, the static one
        does not."""
        ...

    def keep_rows(self, start: int, kept: Sequence[Sequence[int]]) -> None:
        """After a step that wrote its trees at `start`, keep row b's tree nodes `kept[b]` (sorted, the root 0
        first) at row b's own length; the rows' other tree entries are dropped."""
        ...


@runtime_checkable
class SlotStore(RowStore, Protocol):
    """A row store whose rows join and leave between steps (continuous batching)."""

    row_lengths: list[int]   # [B]: committed entries of each row

    def add_row(self, single: DynamicCache) -> int:
        """Copy a prefilled one-row cache (a `step.cache.TreeCache`) into the next free row; returns its row
        index."""
        ...

    def remove_rows(self, rows: Sequence[int]) -> list[int]:
        """Drop rows (the last row moves into a freed slot); returns the old index now at each position."""
        ...
