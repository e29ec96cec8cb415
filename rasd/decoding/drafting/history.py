"""ResponseHistory: earlier answers as a drafting source (SuffixDecoding, arXiv 2411.04975).

A document-QA service answers the same and similar questions again and again; SuffixDecoding (ArcticInference's
suffix decoding in vLLM / SGLang) drafts from a tree of earlier *responses* across requests. This store keeps
finished responses, each behind the last `prompt_tail` tokens of its prompt (a match may start in the prompt's
tail, e.g. the question, and continue into the answer), bounded by `max_mb` with least-recently-used eviction
(a store or a match counts as a use).

Lookup finds the longest suffix of the current context (up to `max_match` tokens) that occurs in a stored
sequence and returns what followed each occurrence, with how often that sequence was stored, so the proposer
can count them into a tree. Instead of the paper's suffix tree (a node per token per suffix depth: kilobytes
per token as Python objects) it is an n-gram hash index over sparse lengths `LEVELS` (1, 2, 3, 4, 6, 8, 12,
16, 24, ...). Whether a suffix occurs is monotone in its length, so a binary search over the levels finds the
longest level that occurs in a few dict probes; the exact length between two levels comes from comparing
that level's (few) occurrences backwards. Adding a response indexes only its own tokens, evicting removes
only its own entries: nothing is ever rebuilt.

Identical sequences are stored once with a weight (the same answer given ten times counts ten times, as in
the paper's counted tree, at the memory of one). Pickling carries the sequences only (`state()`), and the
index is rebuilt where it lands, so the store is cheap to ship to a Ray actor shared across replicas.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

LEVELS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)   # n-gram lengths indexed (below max_match, plus it)
OFFSET_BITS = 24                                       # a position is (sequence id << 24) | offset
MAX_SEQUENCE = 1 << OFFSET_BITS
# Measured with tracemalloc (tests/decoding/test_history.py checks it): one index entry (key int, dict slot,
# position int, its share of a list) ≈ 110 B; each token has one entry per level up to its depth, so with the
# default 24-token match (9 levels) ≈ 1 KB per token, plus 4 B for the token itself.
BYTES_PER_ENTRY = 110
BYTES_PER_SEQUENCE = 400   # the entry object, its array header, the LRU and duplicate-map slots


@dataclass(frozen=True)
class HistoryMatch:
    """The longest matched suffix (`length` tokens; 0: none) and the continuations after its occurrences
    (most recent first), each with its sequence's `weights` (times stored)."""

    length: int = 0
    continuations: list[list[int]] = field(default_factory=list)
    weights: list[int] = field(default_factory=list)


class _Entry:
    __slots__ = ("tokens", "weight", "digest")

    def __init__(self, tokens: array, digest: int):
        self.tokens, self.weight, self.digest = tokens, 1, digest


class ResponseHistory:
    """A bounded, thread-safe store of finished responses, searchable by the longest suffix of a context."""

    def __init__(self, max_mb: float = 64.0, prompt_tail: int = 32, max_match: int = 24):
        if max_match < 1 or prompt_tail < 0 or max_mb <= 0:
            raise ValueError("ResponseHistory needs max_match >= 1, prompt_tail >= 0 and max_mb > 0")
        self.max_mb, self.prompt_tail, self.max_match = float(max_mb), int(prompt_tail), int(max_match)
        self.max_bytes = int(self.max_mb * 1024 * 1024)
        self.levels = tuple(n for n in LEVELS if n < max_match) + (max_match,)
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._seqs: OrderedDict[int, _Entry] = OrderedDict()   # sequence id -> entry, least recently used first
        self._table: dict[int, int | list[int]] = {}          # n-gram hash -> position(s), oldest first
        self._by_digest: dict[int, int] = {}                   # hash of a whole sequence -> its id (duplicates)
        self._next_id = 0
        self.bytes_used = 0
        self.num_tokens = 0

    # ---------------------------------------------------------------------------------------------- size

    def __len__(self) -> int:
        return len(self._seqs)

    def cost(self, num_tokens: int) -> int:
        """Bytes a sequence of `num_tokens` takes here: its tokens, its index entries, its bookkeeping."""
        entries = sum(max(num_tokens - n, 0) for n in self.levels)   # n-grams with a following token
        return BYTES_PER_SEQUENCE + 4 * num_tokens + BYTES_PER_ENTRY * entries

    def clear(self) -> None:
        """Forget every response (e.g. after a benchmark's warm-up, which must not be remembered)."""
        with self._lock:
            self._reset()

    # ---------------------------------------------------------------------------------------------- add

    def add(self, prompt_tail: list[int], response: list[int]) -> bool:
        """Store a finished response behind the last `prompt_tail` tokens of its prompt; False when it is too
        short to ever be drafted from or larger than the whole store."""
        tail = list(prompt_tail)[-self.prompt_tail:] if self.prompt_tail else []
        seq = array("i", tail + [int(t) for t in response])
        if len(seq) < 2 or not response or len(seq) >= MAX_SEQUENCE:
            return False
        cost = self.cost(len(seq))
        if cost > self.max_bytes:
            return False
        digest = hash(tuple(seq))
        with self._lock:
            same = self._by_digest.get(digest)
            if same is not None and self._seqs[same].tokens == seq:
                self._seqs[same].weight += 1
                self._seqs.move_to_end(same)
                return True
            while self._seqs and self.bytes_used + cost > self.max_bytes:
                self._evict_oldest()
            sid, self._next_id = self._next_id, self._next_id + 1
            self._seqs[sid] = _Entry(seq, digest)
            self._by_digest.setdefault(digest, sid)
            self._index(sid, seq, insert=True)
            self.bytes_used += cost
            self.num_tokens += len(seq)
        return True

    def _evict_oldest(self) -> None:
        sid, entry = self._seqs.popitem(last=False)
        if self._by_digest.get(entry.digest) == sid:
            del self._by_digest[entry.digest]
        self._index(sid, entry.tokens, insert=False)
        self.bytes_used -= self.cost(len(entry.tokens))
        self.num_tokens -= len(entry.tokens)

    def _index(self, sid: int, seq: array, insert: bool) -> None:
        """Add (or remove) every indexed n-gram of `seq` that has a token after it."""
        table = self._table
        for off in range(len(seq) - 1):
            code = (sid << OFFSET_BITS) | off
            for n in self.levels:
                if n > off + 1:
                    break
                key = hash(tuple(seq[off - n + 1: off + 1]))
                if insert:
                    _insert(table, key, code)
                else:
                    _remove(table, key, code)

    # ---------------------------------------------------------------------------------------------- lookup

    def lookup(self, context: list[int], max_continuations: int = 32, max_len: int = 16, min_match: int = 1,
               max_match: int | None = None) -> HistoryMatch:
        """The longest suffix of `context` (`min_match`..`max_match` tokens) found in a stored sequence, and
        up to `max_continuations` continuations (`max_len` tokens each) after its most recent occurrences."""
        limit = min(max_match or self.max_match, self.max_match, len(context))
        if limit < max(min_match, 1) or max_len < 1 or max_continuations < 1:
            return HistoryMatch()
        with self._lock:
            levels = [n for n in self.levels if n <= limit]
            level = self._longest_level(context, levels)
            if level < 0:
                return HistoryMatch()
            upper = levels[level + 1] - 1 if level + 1 < len(levels) else limit
            length, codes = self._best_occurrences(context, levels[level], upper, max_continuations)
            if length < min_match:
                return HistoryMatch()
            return self._continuations(codes, length, max_len)

    def _longest_level(self, context: list[int], levels: list[int]) -> int:
        """Index into `levels` of the longest n whose context suffix occurs (binary search: occurrence is
        monotone in n, every occurrence of a suffix contains the shorter ones); -1 when none does."""
        lo, hi, best = 0, len(levels) - 1, -1
        while lo <= hi:
            mid = (lo + hi) // 2
            if self._occurs(context, levels[mid]):
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        return best

    def _occurs(self, context: list[int], n: int) -> bool:
        return any(self._match_length(code, context, n) >= n for code in reversed(self._codes(context, n)))

    def _codes(self, context: list[int], n: int) -> list[int]:
        found = self._table.get(hash(tuple(context[-n:])))
        return [] if found is None else [found] if isinstance(found, int) else found

    def _match_length(self, code: int, context: list[int], upper: int) -> int:
        """How many tokens before (and at) a stored position equal the end of `context`, up to `upper` (a hash
        collision gives fewer than the level's n: the caller drops it)."""
        seq, off = self._seqs[code >> OFFSET_BITS].tokens, code & (MAX_SEQUENCE - 1)
        upper = min(upper, off + 1)
        k = 0
        while k < upper and seq[off - k] == context[-1 - k]:
            k += 1
        return k

    def _best_occurrences(self, context: list[int], n: int, upper: int, wanted: int) -> tuple[int, list[int]]:
        """(the exact longest match in [n, upper], the most recent positions with it, at most `wanted`)."""
        best, found = 0, []
        for code in reversed(self._codes(context, n)):            # most recent first
            length = self._match_length(code, context, upper)
            if length < n or length < best:
                continue
            if length > best:
                best, found = length, []
            if len(found) < wanted:
                found.append(code)
            elif best == upper:
                break                                               # nothing can beat it: enough found
        return best, found

    def _continuations(self, codes: list[int], length: int, max_len: int) -> HistoryMatch:
        conts, weights = [], []
        for code in codes:
            sid, off = code >> OFFSET_BITS, code & (MAX_SEQUENCE - 1)
            entry = self._seqs[sid]
            conts.append(entry.tokens[off + 1: off + 1 + max_len].tolist())
            weights.append(entry.weight)
            self._seqs.move_to_end(sid)                             # matched: recently used
        return HistoryMatch(length, conts, weights)

    # ---------------------------------------------------------------------------------------------- state

    def state(self) -> dict[str, Any]:
        """Plain data: the sequences as int32 bytes with their weights, oldest stored first (lookups prefer the
        most recent), and `lru`, their indices least recently used first. Cheap to pickle or send to an actor;
        `from_state` rebuilds the index."""
        with self._lock:
            ids = sorted(self._seqs)
            rank = {sid: i for i, sid in enumerate(ids)}
            seqs = [(self._seqs[sid].tokens.tobytes(), self._seqs[sid].weight) for sid in ids]
            lru = [rank[sid] for sid in self._seqs]
        return {"version": 1, "max_mb": self.max_mb, "prompt_tail": self.prompt_tail,
                "max_match": self.max_match, "sequences": seqs, "lru": lru}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> ResponseHistory:
        out = cls(state["max_mb"], state["prompt_tail"], state["max_match"])
        out._load(state)
        return out

    def _load(self, state: dict[str, Any]) -> None:
        """Re-add the sequences in their order, then restore the use order."""
        for raw, weight in state["sequences"]:
            tokens = array("i")
            tokens.frombytes(raw)
            entry = _Entry(tokens, hash(tuple(tokens)))
            entry.weight = weight
            sid, self._next_id = self._next_id, self._next_id + 1
            self._seqs[sid] = entry
            self._by_digest.setdefault(entry.digest, sid)
            self._index(sid, tokens, insert=True)
            self.bytes_used += self.cost(len(tokens))
            self.num_tokens += len(tokens)
        for sid in state.get("lru", range(len(self._seqs))):
            self._seqs.move_to_end(sid)

    def __getstate__(self) -> dict[str, Any]:
        return self.state()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["max_mb"], state["prompt_tail"], state["max_match"])   # type: ignore[misc]
        self._load(state)


def _insert(table: dict[int, int | list[int]], key: int, code: int) -> None:
    """Positions stay in insertion order (oldest first); a single one is stored bare (no list: most long
    n-grams occur once, and a list costs ~90 B more)."""
    found = table.get(key)
    if found is None:
        table[key] = code
    elif isinstance(found, int):
        table[key] = [found, code]
    else:
        found.append(code)


def _remove(table: dict[int, int | list[int]], key: int, code: int) -> None:
    found = table[key]
    if isinstance(found, int):
        del table[key]
        return
    found.remove(code)
    if len(found) == 1:
        table[key] = found[0]
