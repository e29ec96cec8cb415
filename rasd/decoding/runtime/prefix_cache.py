"""Automatic prefix caching: a new request reuses the K/V of prompt blocks an earlier request computed.

Why: every document-QA prompt starts with the same chat template and system message, chats resend their
whole history each turn, and a question asked twice retrieves the same sources. vLLM ("automatic prefix
caching") and SGLang (RadixAttention) skip that prefill; so does the service here.

How, in the style of vLLM's block hashing: the prompt is cut into blocks of `block_tokens`; a block's key
is (its parent block's id, its own tokens), so it matches only after the same full prefix. The keys are
compared exactly (no hash can collide into wrong K/V). A block's K/V for every layer lives in one slot of
a pool allocated once (`max_bytes`), so storing a prompt is one copy per layer into memory already touched,
not fresh allocations (those cost more than the prefill they save). When the pool is full the least
recently used blocks go first (a child is always used no later than its parent, so a parent never goes
before its children).

Lossless: a prompt token's K/V depends only on the tokens before it, and on the embedded model a block
computed inside another prompt's prefill is bit-identical to the same block of a full prefill
(`tests/test_prefix_cache.py` checks the logits). At least `min_suffix` prompt tokens are always prefilled,
so the first new token comes from the same kind of forward as without the cache.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rasd.decoding.step.cache import TreeCache

BlockKey = tuple[int, tuple[int, ...]]   # (parent block id, this block's tokens); parent id 0 = the prompt start


@dataclass
class _Block:
    """One cached block: its id (its children's parent id) and its slot in the pool."""

    id: int
    slot: int


@dataclass
class PrefixStats:
    """Prompt tokens looked up and found, as vLLM's prefix_cache_queries / prefix_cache_hits count them."""

    queries: int = 0
    hits: int = 0
    evicted_blocks: int = 0


class PrefixCache:
    """K/V of prompt prefixes in fixed blocks, shared by every request of one target model."""

    def __init__(self, max_bytes: int, block_tokens: int = 16, min_suffix: int = 16):
        if block_tokens < 1 or max_bytes < 0 or min_suffix < 1:
            raise ValueError("need block_tokens >= 1, max_bytes >= 0 and min_suffix >= 1")
        self.max_bytes, self.block_tokens, self.min_suffix = max_bytes, block_tokens, min_suffix
        self._blocks: OrderedDict[BlockKey, _Block] = OrderedDict()   # least recently used first
        self._pool: torch.Tensor | None = None    # [slots, layers, 2, heads_kv, block_tokens, head_dim]
        self._free: list[int] = []
        self._next_id = 1
        self.stats = PrefixStats()

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def bytes(self) -> int:
        """Memory the cached blocks take (the pool itself is allocated once, at the first store)."""
        if self._pool is None:
            return 0
        return len(self._blocks) * self._pool[0].numel() * self._pool.element_size()

    def _keys(self, prompt: Sequence[int], limit: int) -> list[tuple[int, ...]]:
        """The tokens of each whole block within prompt[:limit]."""
        size = self.block_tokens
        return [tuple(prompt[s: s + size]) for s in range(0, limit - size + 1, size)]

    def _chain(self, keys: list[tuple[int, ...]]) -> list[BlockKey]:
        """The keys of the cached blocks that start this sequence of blocks."""
        found, parent = [], 0
        for tokens in keys:
            block = self._blocks.get((parent, tokens))
            if block is None:
                break
            found.append((parent, tokens))
            parent = block.id
        return found

    def _touch(self, chain: list[BlockKey]) -> None:
        """Mark a chain used, the deepest block first, so that parents are the more recent."""
        for key in reversed(chain):
            self._blocks.move_to_end(key)

    def fill(self, cache: TreeCache, prompt: Sequence[int], align: int = 1) -> int:
        """Load the longest cached prefix of `prompt` into the empty `cache`; returns its length in tokens.

        At least `min_suffix` prompt tokens are left out, for the caller to prefill. `align`: the hit is cut to a
        multiple of it (a row-exact model's prompt grid, `fast_forward.prompt_grid`).
        """
        self.stats.queries += len(prompt)
        chain = self._chain(self._keys(prompt, len(prompt) - self.min_suffix))
        step = math.lcm(align, self.block_tokens)   # whole blocks, ending on the grid
        chain = chain[: len(chain) * self.block_tokens // step * step // self.block_tokens]
        if not chain or self._pool is None:
            return 0
        self._touch(chain)
        slots = torch.tensor([self._blocks[key].slot for key in chain], device=self._pool.device)
        kv = self._pool.index_select(0, slots)            # [n, layers, 2, heads_kv, block_tokens, head_dim]
        n, _, _, heads, size, dim = kv.shape
        for index, layer in enumerate(cache.layers):
            keys, values = (kv[:, index, j].transpose(0, 1).reshape(1, heads, n * size, dim) for j in (0, 1))
            layer.update(keys, values)
        hit = n * size
        self.stats.hits += hit
        return hit

    def store(self, prompt: Sequence[int], cache: TreeCache) -> None:
        """Keep the whole blocks of `prompt` whose K/V `cache` (one row, after its prefill) holds."""
        if self.max_bytes == 0:
            return
        keys = self._keys(prompt, min(len(prompt), cache.get_seq_length()))
        chain = self._chain(keys)
        self._touch(chain)
        pool = self._pool if self._pool is not None else self._allocate(cache)
        new = keys[len(chain): len(chain) + max(0, pool.shape[0] - len(chain))]
        if not new:
            return
        slots = self._take(len(new))
        self._copy(cache, len(chain) * self.block_tokens, len(new), slots)
        parent = self._blocks[chain[-1]].id if chain else 0
        for tokens, slot in zip(new, slots, strict=True):
            self._blocks[(parent, tokens)] = _Block(self._next_id, slot)
            parent, self._next_id = self._next_id, self._next_id + 1
        self._touch(self._chain(keys))

    def _allocate(self, cache: TreeCache) -> torch.Tensor:
        """The pool, shaped after the first cache stored: as many block slots as `max_bytes` holds."""
        first = cache.layers[0].keys                       # [1, heads_kv, length, head_dim]
        shape = (len(cache.layers), 2, first.shape[1], self.block_tokens, first.shape[-1])
        per_block = first.element_size() * len(cache.layers) * 2 * first.shape[1] * self.block_tokens \
            * first.shape[-1]
        self._pool = torch.empty((self.max_bytes // per_block, *shape), dtype=first.dtype, device=first.device)
        self._free = list(range(self._pool.shape[0]))[::-1]
        return self._pool

    def _take(self, count: int) -> list[int]:
        """`count` free slots, evicting the least recently used blocks for them."""
        while len(self._free) < count:
            _, block = self._blocks.popitem(last=False)
            self._free.append(block.slot)
            self.stats.evicted_blocks += 1
        return [self._free.pop() for _ in range(count)]

    def _copy(self, cache: TreeCache, start: int, count: int, slots: list[int]) -> None:
        """Copy `count` blocks of the cache from token `start` into `slots`: one copy per layer and K/V."""
        assert self._pool is not None
        index = torch.tensor(slots, device=self._pool.device)
        end, size = start + count * self.block_tokens, self.block_tokens
        for i, layer in enumerate(cache.layers):
            for j, source in enumerate((layer.keys, layer.values)):
                heads, dim = source.shape[1], source.shape[-1]
                blocks = source[0, :, start:end].reshape(heads, count, size, dim).transpose(0, 1)
                self._pool[:, i, j].index_copy_(0, index, blocks)

    def clear(self) -> None:
        """Forget every block (the pool stays allocated)."""
        if self._pool is not None:
            self._free = list(range(self._pool.shape[0]))[::-1]
        self._blocks.clear()
