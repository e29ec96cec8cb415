"""Batched verification: the draft trees of many requests in ONE target forward (continuous batching).

Memory traffic decides a forward's cost on CPU and small GPUs alike: the weights are read once whether the
forward carries one token or sixty. So several requests decoding at once should share their forwards.

Layout: one right-padded cache [B, kv_heads, capacity, head_dim] with a length
per row. Every step appends each row's tree at the shared end S = max(row lengths); the 4-D mask lets a
row's nodes see only that row's own entries [0, len_b) and their tree ancestors, so a row's gap
[len_b, S) is invisible, and RoPE positions come from `position_ids` (len_b + depth), so a key's slot
does not matter. After acceptance each row's accepted entries move down to its own length and the shared
end is cropped to the longest row. Requests join (their prefill runs alone, then the row is copied in)
and leave between steps; each costs one copy of the batch cache, never a copy per step.

Each request keeps its own `GenerationStream` (proposer, sizer, stop checker, statistics): the batch only
replaces the one `verify` call of the single-request loop, so both paths run the same per-request code.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from rasd.decoding.model import fast_forward
from rasd.decoding.model.features import row_features
from rasd.decoding.model.kernels import fast_kernels, prefill_products
from rasd.decoding.model.static_step import StaticRows, StepConfig
from rasd.decoding.model.target import TargetModel
from rasd.decoding.runtime.engine import GenerationStream
from rasd.decoding.runtime.prefix_cache import PrefixCache
from rasd.decoding.sizing.batch_width import BatchSizer
from rasd.decoding.sizing.cost import CostCurve
from rasd.decoding.step.cache import MIN_CAPACITY, GrowableLayer, TreeCache, drop_rows
from rasd.decoding.step.row_store import SlotStore
from rasd.decoding.step.tree import DraftTree
from rasd.decoding.step.verify import accept, batch_inputs

log = logging.getLogger(__name__)


class SlotLayer(GrowableLayer):
    """One layer's rows inside a store with spare row slots: store [slots, kv_heads, capacity, head_dim].

    `_kbuf`/`_vbuf` are views of the first `rows` slots, so everything `GrowableLayer` does (appending a
    step, cropping, the views handed to attention) works on the active rows unchanged; a row joins by one
    row copy into a free slot and leaves by moving the last row into its slot.
    """

    def setup(self, like: torch.Tensor, slots: int, capacity: int) -> None:
        self.device = like.device
        self.length, self.rows = 0, 0
        # zeroed: exact attention reads masked slots past the shared end (`GrowableLayer.window`)
        self._kstore = like.new_zeros((slots, like.shape[1], capacity, like.shape[-1]))
        self._vstore = torch.zeros_like(self._kstore)
        self.is_initialized = True
        self._point()

    def _point(self) -> None:
        self._kbuf, self._vbuf = self._kstore[: self.rows], self._vstore[: self.rows]
        self._refresh_views()

    def _ensure_capacity(self, needed: int) -> None:
        """Grow the store (all slots) when the shared end outgrows it."""
        self.ensure_slots(self._kstore.shape[0], max(MIN_CAPACITY, needed))

    def ensure_slots(self, rows: int, capacity: int) -> None:
        """Room for `rows` rows of `capacity` entries; each dimension that grows at least doubles."""
        slots, _, current, _ = self._kstore.shape
        if rows > slots or capacity > current:
            self._regrow(max(rows, 2 * slots) if rows > slots else slots,
                         max(capacity, 2 * current) if capacity > current else current)

    def _regrow(self, slots: int, capacity: int) -> None:
        for name in ("_kstore", "_vstore"):
            old = getattr(self, name)
            new = old.new_zeros((slots, old.shape[1], capacity, old.shape[-1]))
            new[: self.rows, :, : self.length] = old[: self.rows, :, : self.length]
            setattr(self, name, new)
        self._point()

    def put_row(self, row: int, src: GrowableLayer, length: int, shared: int) -> None:
        """Slot `row` := src's first `length` entries, zeros up to the shared end (masked, but must be finite).

        A row longer than the others moves the shared end: the other rows' new gap [shared, length) is
        zeroed too (the store is uninitialised memory, and a NaN there would survive the additive mask).
        """
        for store, part in ((self._kstore, src._kbuf), (self._vstore, src._vbuf)):
            store[row, :, :length] = part[0, :, :length]
            store[row, :, length:shared] = 0
            store[:row, :, shared:length] = 0

    def move_row(self, src: int, dst: int, length: int) -> None:
        self._kstore[dst, :, :length] = self._kstore[src, :, :length]
        self._vstore[dst, :, :length] = self._vstore[src, :, :length]


class BatchCache(TreeCache, SlotStore):
    """A `TreeCache` with B rows of different lengths; rows join, leave and compact independently (`SlotStore`).

    Joining and leaving copy one row, never the whole batch: the old layout rebuilt every layer's buffer
    for each join and leave, a tenth of a load test's wall time (docs/lab-notes/decoding-speed.md, "KV stores").
    Leaving moves the last row into the freed slot, so rows change order: `remove_rows` returns the order.
    """

    def __init__(self, num_layers: int, slots: int = 1):
        """`slots`: rows to make room for at the first join (more are added by doubling when needed)."""
        super(DynamicCache, self).__init__(layers=[SlotLayer() for _ in range(num_layers)])
        self.row_lengths: list[int] = []
        self.slots = slots

    @classmethod
    def for_model(cls, model: torch.nn.Module, slots: int = 1) -> BatchCache:
        config = model.config.get_text_config(decoder=True)
        return cls(int(config.num_hidden_layers), slots)

    @property
    def rows(self) -> int:
        return len(self.row_lengths)

    def add_row(self, single: TreeCache) -> int:
        """Copy a one-row cache (a finished prefill) into the next free slot; returns its row index."""
        length = single.get_seq_length()
        row = self.rows
        shared = max(self.row_lengths, default=0)
        for layer, src in zip(self.layers, single.layers, strict=True):
            if not layer.is_initialized:
                layer.setup(src._kbuf, slots=self.slots, capacity=max(2 * length, MIN_CAPACITY))
            layer.ensure_slots(row + 1, max(length, shared))
            layer.put_row(row, src, length, shared)
            layer.rows = row + 1
        self.row_lengths.append(length)
        self._sync_length()
        return row

    def remove_rows(self, rows: Sequence[int]) -> list[int]:
        """Drop the given rows; returns, for each remaining row position, the old row index now there."""
        def move(src: int, dst: int, length: int) -> None:
            for layer in self.layers:
                layer.move_row(src, dst, length)

        order = drop_rows(self.row_lengths, rows, move)
        for layer in self.layers:
            if not self.row_lengths:        # idle: give the memory back
                layer.is_initialized = False
                layer._kstore = layer._vstore = layer._kbuf = layer._vbuf = layer.keys = layer.values = None
                continue
            layer.rows = len(order)
        self._sync_length()
        return order

    def keep_rows(self, start: int, kept: Sequence[Sequence[int]]) -> None:
        """After a batched tree step appended at `start`, keep row b's tree nodes `kept[b]` at its own length."""
        # one gather and one scatter per buffer for all rows (per-row copies were ~500 small ops a step)
        rows = [b for b, nodes in enumerate(kept) for _ in nodes]
        src = [start + i for nodes in kept for i in nodes]
        dst = [self.row_lengths[b] + j for b, nodes in enumerate(kept) for j in range(len(nodes))]
        if rows and self.layers[0].is_initialized:
            device = self.layers[0]._kbuf.device
            b_idx, src_idx, dst_idx = (torch.tensor(x, dtype=torch.long, device=device) for x in (rows, src, dst))
            for layer in self.layers:
                for buf in (layer._kbuf, layer._vbuf):      # [B, kv_heads, capacity, head_dim]
                    buf[b_idx, :, dst_idx] = buf[b_idx, :, src_idx]     # the gather copies before the scatter
        self.row_lengths = [length + len(nodes) for length, nodes in zip(self.row_lengths, kept, strict=True)]
        self._sync_length()

    def _sync_length(self) -> None:
        """The shared end is the longest row; shorter rows' tails are masked, not copied."""
        shared = max(self.row_lengths, default=0)
        for layer in self.layers:
            if layer.is_initialized:
                layer.length = shared
                layer._point()


@dataclass
class PrefillJob:
    """A request whose prompt is prefilled chunk by chunk alongside the batch's steps."""

    stream: GenerationStream
    cache: TreeCache
    done: int = 0            # prompt tokens already in `cache`

    def next_chunk(self, size: int) -> tuple[list[int], bool]:
        """The next prompt tokens to prefill, and whether they are the last."""
        prompt = self.stream.prompt_ids
        chunk = prompt[self.done: self.done + size]
        return chunk, self.done + len(chunk) >= len(prompt)


class BatchDecoder:
    """Steps many `GenerationStream`s together: per-request proposing and committing, one shared forward.

    With `chunk_tokens` > 0, a request that joins while others decode is prefilled in chunks, each stacked
    onto a step's forward (`fast_forward.forward_mixed`) instead of stopping every running request for a whole
    prefill: the running requests keep streaming and the chunk shares the
    step's weight reads. Its first token comes out of the step that runs its last chunk. Off by default: in
    the 8-concurrent load test it did not raise throughput (the joining requests reach the batch later,
    so steps carry fewer rows) and it lengthens the joining request's time to first token.
    """

    def __init__(self, model: torch.nn.Module, fast: bool = True, max_batch_tokens: int = 128, slots: int = 8,
                 chunk_tokens: int = 0, prefix_cache: PrefixCache | None = None, step: StepConfig | None = None):
        """`slots`: requests the cache makes room for up front (the scheduler's `max_batch`); `chunk_tokens`:
        prompt tokens prefilled per step while others decode (0: a joining request prefills at once);
        `prefix_cache`: reuse the K/V of prompt prefixes earlier requests computed (None: off); `step`: how
        the forwards run (default: static shapes in CUDA graphs on CUDA, the dynamic lean path on CPU)."""
        self.model = model
        self.fast = fast
        self.device = next(model.parameters()).device
        self.step_config = step or StepConfig.for_device(self.device)
        self.target = TargetModel.of(model)
        self.static = self.target.runs_static(self.step_config.static)
        # Rows are padded to the largest tree, so one big tree makes every row pay for it: with several
        # requests one width is chosen for the whole step (`sizing.batch`), never more than this many tree
        # tokens in all; the single-request sizer alone decides when the batch holds one request.
        self.max_batch_tokens = max_batch_tokens
        self.sizer = BatchSizer(max_tokens=max_batch_tokens)
        self.slots = slots
        self.cache = self._new_cache()
        self.streams: list[GenerationStream] = []
        self.prefilling: deque[PrefillJob] = deque()
        # requests whose own part of a step (proposing, committing) raised: out of the batch, for the caller to
        # end with an error (`take_failed`); the other rows go on
        self.failed: list[tuple[GenerationStream, Exception]] = []
        self.chunk_tokens = chunk_tokens
        self.prefix_cache = prefix_cache

    def _new_cache(self) -> BatchCache | StaticRows:
        """The rows' K/V: a growable batch cache, or a static store whose graphs outlive its rows."""
        if self.static:
            return StaticRows(self.model, self.slots, graphs=self.step_config.graphs)
        return BatchCache.for_model(self.model, self.slots)

    def __len__(self) -> int:
        """Requests in the batch: decoding, or still being prefilled."""
        return len(self.streams) + len(self.prefilling)

    @torch.inference_mode()
    def add(self, stream: GenerationStream) -> list[int] | None:
        """Join a new request; returns its first block, or None when a later step will (chunked prefill).

        Alone (or without chunking, or where the lean forward does not apply) the prompt is prefilled at
        once; while other requests decode it is queued and prefilled a chunk per step.
        """
        if stream.decoder.model is not self.model:
            raise ValueError("a batch shares one target model: the stream was built for another")
        single = TreeCache.for_model(self.model)
        grid = fast_forward.prompt_grid(self.model)
        cached = self.prefix_cache.fill(single, stream.prompt_ids, grid) if self.prefix_cache is not None else 0
        if self.streams and self.chunk_tokens > 0 and self.target.chunks_prefill(self.fast, self.device, self.static):
            stream.start()
            stream.stats.cached_prompt_tokens = cached
            self.prefilling.append(PrefillJob(stream, single, done=cached))
            return None
        with fast_kernels(self.fast):
            first = stream.begin(single, cached)
        return self._joined(stream, single, first)

    def _joined(self, stream: GenerationStream, single: TreeCache, first: list[int]) -> list[int]:
        """A prefilled request enters the batch (unless its first token already ended it)."""
        if self.prefix_cache is not None:
            self.prefix_cache.store(stream.prompt_ids, single)
        if stream.reason is not None:
            stream.finish()
            return first
        self.cache.add_row(single)
        self.streams.append(stream)
        return first

    @torch.inference_mode()
    def remove(self, stream: GenerationStream) -> None:
        """Drop a request between steps (cancelled by its caller)."""
        if stream in self.streams:
            self._drop([self.streams.index(stream)])
        self.prefilling = deque(job for job in self.prefilling if job.stream is not stream)

    def clear(self) -> None:
        """Drop every request and start from an empty cache.

        Why not `remove` each: after a step failed half-way (a proposer bug, out of memory) the rows'
        cache entries may not match their streams any more; a fresh cache is the only state known good.
        The prefix cache is emptied too: a failure inside its store may have left a half-written block.
        """
        self.streams = []
        self.prefilling.clear()
        if self.static:   # the store is kept: its graphs stay valid; stale K/V is finite and masked
            self.cache.clear()
        else:
            self.cache = self._new_cache()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    @torch.inference_mode()
    def step(self) -> list[tuple[GenerationStream, list[int]]]:
        """One batched round; returns each stream's committed block. Finished streams leave the batch.

        A request whose last prompt chunk ran in this round is among them with its first block.
        """
        with fast_kernels(self.fast):
            if not self.streams:
                return self._prefill_rest()
            return self._step()

    def _prefill_rest(self) -> list[tuple[GenerationStream, list[int]]]:
        """Nothing decodes: finish the next queued prefill in one forward instead of chunk by chunk."""
        if not self.prefilling:
            return []
        job = self.prefilling.popleft()
        rest = job.stream.prompt_ids[job.done:]
        ids = torch.tensor([rest], dtype=torch.long, device=self.device)
        pos = torch.arange(job.done, job.done + len(rest), device=self.device)[None]
        with prefill_products():   # as a whole-prompt prefill computes it (`GenerationStream.begin`)
            logits = fast_forward.forward(self.model, job.cache, ids, pos, last_only=True)
        job.stream.feed_features(job.done, row_features(self.model))
        return [(job.stream, self._joined(job.stream, job.cache, job.stream.first_token(logits[0, -1])))]

    def _step(self) -> list[tuple[GenerationStream, list[int]]]:
        t0 = time.perf_counter()
        batched = len(self.streams) > 1
        tried = [self._isolated(stream, self._propose, stream, batched) for stream in self.streams]
        failed = [b for b, p in enumerate(tried) if p is None]
        stopped = [b for b, p in enumerate(tried) if p is not None and p[0] is None]   # reached the context
        results: list[tuple[GenerationStream, list[int]]] = [(self.streams[b], []) for b in stopped]
        proposals = [p for p in (tried[b] for b in self._drop(failed + stopped)) if p is not None]
        trees = [tree for tree, _ in proposals]
        draft_s = [s for _, s in proposals]
        if self.streams:
            context_sum = sum(len(stream.context) for stream in self.streams)
            # proposed uncut when batched: sized here even if only one row is left this step
            curve = self._curve(context_sum) if batched else None
            if batched:
                trees = self._size(trees, curve, context_sum)
            forward_s = [0.0]
            job = self.prefilling[0] if self.prefilling else None
            results += self._verify_and_commit(trees, draft_s, forward_s, job)
            if curve is not None and job is None:   # a step carrying a prompt chunk would mislead the cost model
                overhead = time.perf_counter() - t0 - forward_s[0]
                self.sizer.observe(curve, len(trees), max(len(t) for t in trees), context_sum, forward_s[0],
                                   overhead)
        gone = {id(stream) for stream, _ in self.failed}
        self._drop([b for b, stream in enumerate(self.streams) if stream.reason is not None or id(stream) in gone])
        for stream, _ in results:
            if stream.reason is not None and stream.output is None:
                stream.finish()
        return results

    def _isolated(self, stream: GenerationStream, work: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`work(*args, **kwargs)` for one request; if it raises, that request alone fails (`failed`), None.

        Why: a request's own drafting and bookkeeping (its proposer, its sampling options, its stop rules)
        cannot spoil another row's tokens, so a bug there ends that request, not every request in the batch;
        only the shared forward fails them all (the scheduler's `work_once`)."""
        try:
            return work(*args, **kwargs)
        except Exception as exc:   # noqa: BLE001 - reported to that request's caller, with the exception
            log.exception("a request's step failed; it ends with an error, the batch goes on")
            self.failed.append((stream, exc))
            return None

    def take_failed(self) -> list[tuple[GenerationStream, Exception]]:
        """The requests that failed since the last call (already out of the batch), with why."""
        failed, self.failed = self.failed, []
        return failed

    @staticmethod
    def _propose(stream: GenerationStream, batched: bool) -> tuple[DraftTree | None, float]:
        """A row's tree and the time it took; left uncut when the batch sizes it with the others."""
        t0 = time.perf_counter()
        tree = stream.propose()
        if tree is not None:
            batch_sized = batched and stream.decoder.sizer.batch_sized
            tree = tree.top_nodes(stream.budget) if batch_sized else stream.size(tree)
        return tree, time.perf_counter() - t0

    def _curve(self, context_sum: int) -> CostCurve | None:
        """The single-row cost curve at the batch's mean context (None when no row sizes by cost)."""
        sizers = [s.decoder.sizer for s in self.streams if s.decoder.sizer.batch_sized]
        if not sizers:
            return None
        return sizers[0].curve_for(context_sum // len(self.streams))

    def _size(self, trees: list[DraftTree], curve: CostCurve | None, context_sum: int) -> list[DraftTree]:
        """One width for the step (`sizing.batch`); without any cost-aware row, an equal share per row."""
        if curve is not None:
            return self.sizer.cut(trees, [s.decoder.sizer for s in self.streams], curve, context_sum)
        share = max(1, self.max_batch_tokens // len(trees))
        # trees holding sampled (q) nodes are left whole: cutting them by score would bias sampling
        return [tree if tree.q else tree.top_nodes(share - 1) for tree in trees]

    def _verify_and_commit(self, trees: list[DraftTree], draft_s: list[float], forward_s: list[float],
                           job: PrefillJob | None = None) -> list[tuple[GenerationStream, list[int]]]:
        """One forward over every row's tree (and `job`'s next prompt chunk), then each row's verdict and
        commit; `forward_s[0]` gets the forward's time."""
        cache = self.cache
        past_len = cache.get_seq_length()
        t0 = time.perf_counter()
        first: list[int] | None = None
        if self.static:
            logits = cache.forward(trees)                                             # [B, T, vocab]
        else:
            param = next(self.model.parameters())
            ids, pos, mask = batch_inputs(trees, cache.row_lengths, past_len, param.dtype, param.device)
            if job is None:
                logits = fast_forward.forward(self.model, cache, ids, pos, mask).float()
            else:
                logits, first = self._forward_with_chunk(job, ids, pos, mask)
        forward_s[0] = time.perf_counter() - t0
        verdicts = [accept(tree, logits[b, : len(tree)], stream.sampling, stream.gen, stream.process)
                    for b, (stream, tree) in enumerate(zip(self.streams, trees, strict=True))]
        cache.keep_rows(past_len, [[0, *v.accepted] for v in verdicts])
        verify_s = (time.perf_counter() - t0) / len(trees)   # each request's share of the shared forward
        alone = verify_s if len(trees) == 1 and job is None else None   # a forward of this row's tree only
        width = max(len(tree) for tree in trees)
        results = []
        for b, (stream, tree, verdict) in enumerate(zip(self.streams, trees, verdicts, strict=True)):
            block = self._isolated(stream, stream.commit, tree, verdict, logits[b, : len(tree)], draft_s[b],
                                   verify_s, alone, hidden=row_features(self.model, b, width, len(tree)))
            if block is not None:
                results.append((stream, block))
        if job is not None and first is not None:   # after the rows' compaction: the new row joins at the end
            self.prefilling.popleft()
            results.append((job.stream, self._joined(job.stream, job.cache, first)))
        return results

    def _forward_with_chunk(self, job: PrefillJob, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor
                            ) -> tuple[torch.Tensor, list[int] | None]:
        """Rows' logits [B, T, vocab] from a forward that also prefilled `job`'s next chunk; the job's first
        block when that chunk was its last."""
        grid = fast_forward.prompt_grid(self.model)   # a row-exact model's chunks: its prompt grid, on it
        chunk, last = job.next_chunk(grid if grid > 1 else self.chunk_tokens)
        chunk_ids = torch.tensor([chunk], dtype=torch.long, device=self.device)
        out = fast_forward.forward_mixed(self.model, self.cache, ids, pos, mask, job.cache, chunk_ids, last).float()
        job.done += len(chunk)
        rows = ids.shape[0] * ids.shape[1]
        chunk_features = row_features(self.model, 0, rows + len(chunk))
        job.stream.feed_features(job.done - len(chunk), None if chunk_features is None else chunk_features[rows:])
        first = job.stream.first_token(out[rows]) if last else None
        return out[:rows].view(*ids.shape, -1), first

    def _drop(self, rows: list[int]) -> list[int]:
        """Remove rows from the batch; returns the old index of each remaining row, in its new order."""
        if not rows:
            return list(range(len(self.streams)))
        order = self.cache.remove_rows(rows)
        self.streams = [self.streams[b] for b in order]
        return order
