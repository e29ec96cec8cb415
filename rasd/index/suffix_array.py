"""Token suffix array: REST-style exact-match lookup of "what followed this context in the corpus".

The corpus is one int32 array: documents concatenated, each followed by SEP (-1), so no match or
continuation ever crosses a document boundary. The suffix array is built by libdivsufsort (`pydivsufsort`,
O(n log n)) over the tokens' big-endian bytes: with fixed-width big-endian items, byte order of suffixes that
start on item boundaries equals token order, and pydivsufsort keeps exactly those suffixes.

Query cost is a few binary searches over a memory-mapped array (log2(n) probes each), independent of how
many times a pattern occurs; continuations are read for at most `max_continuations` occurrences, spread
evenly over the matching range so that frequent continuations are counted in proportion.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

SEP = -1   # document separator in the token array; never a real token id


@dataclass
class Match:
    """The longest context suffix found: its length and the suffix-array range [lo, hi) of occurrences."""

    length: int
    lo: int
    hi: int

    @property
    def count(self) -> int:
        return self.hi - self.lo


def build_suffix_array(tokens: np.ndarray) -> np.ndarray:
    """Suffix array (int64 positions) of an int32 token array.

    Why int64: a datastore of 10M tokens is 40M bytes for libdivsufsort; positions fit int32, but int64 keeps
    the file format the same for corpora beyond 2G tokens.
    """
    from pydivsufsort import divsufsort

    tokens = np.ascontiguousarray(tokens, dtype=np.int32)
    if len(tokens) == 0:
        return np.zeros(0, dtype=np.int64)
    return np.asarray(divsufsort(tokens), dtype=np.int64)


def join_documents(docs: list[list[int]] | list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate token lists with SEP after each: (tokens int32 [n], doc_offsets int64 [n_docs + 1])."""
    lengths = np.array([len(d) + 1 for d in docs], dtype=np.int64)
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.full(int(offsets[-1]), SEP, dtype=np.int32)
    for start, doc in zip(offsets[:-1], docs, strict=True):
        tokens[start:start + len(doc)] = np.asarray(doc, dtype=np.int32)
    return tokens, offsets


class SuffixArray:
    """Exact-match lookups over a token array and its suffix array (both may be memory-mapped)."""

    def __init__(self, tokens: np.ndarray, sa: np.ndarray):
        if len(tokens) != len(sa):
            raise ValueError(f"token array ({len(tokens)}) and suffix array ({len(sa)}) differ in length")
        # a memmap indexed element by element (the binary searches below) pays numpy's memmap subclass
        # bookkeeping on every access; a plain ndarray view of the same mapping does not (no copy)
        self.tokens = tokens.view(np.ndarray) if isinstance(tokens, np.memmap) else tokens
        self.sa = sa.view(np.ndarray) if isinstance(sa, np.memmap) else sa

    @classmethod
    def build(cls, tokens: np.ndarray) -> SuffixArray:
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        return cls(tokens, build_suffix_array(tokens))

    @classmethod
    def from_documents(cls, docs: list[list[int]]) -> SuffixArray:
        """A small in-memory datastore (tests, per-request scoped lookups)."""
        return cls.build(join_documents(docs)[0])

    @classmethod
    def load(cls, tokens_path: str | Path, sa_path: str | Path, mmap: bool = True) -> SuffixArray:
        mode = "r" if mmap else None
        return cls(np.load(tokens_path, mmap_mode=mode), np.load(sa_path, mmap_mode=mode))

    def __len__(self) -> int:
        return len(self.tokens)

    def _suffix(self, i: int, k: int) -> list[int]:
        p = int(self.sa[i])
        return self.tokens[p:p + k].tolist()

    def find(self, pattern: list[int]) -> tuple[int, int]:
        """[lo, hi) range of suffixes that start with `pattern` (empty range when absent)."""
        k, n = len(pattern), len(self.sa)
        lo, hi = 0, n
        while lo < hi:                                   # first suffix >= pattern
            mid = (lo + hi) // 2
            if self._suffix(mid, k) < pattern:
                lo = mid + 1
            else:
                hi = mid
        start, hi = lo, n
        while lo < hi:                                   # first suffix whose k-prefix > pattern
            mid = (lo + hi) // 2
            if self._suffix(mid, k) <= pattern:
                lo = mid + 1
            else:
                hi = mid
        return start, lo

    def count(self, pattern: list[int]) -> int:
        lo, hi = self.find(pattern)
        return hi - lo

    def longest_suffix_match(self, context: list[int], max_len: int = 16, min_len: int = 2) -> Match | None:
        """The longest suffix of `context` (between min_len and max_len tokens) that occurs in the corpus.

        Occurrence is monotone in length (if the last k tokens occur, so do the last k-1), so a binary search
        over the length needs about log2(max_len) range searches instead of one per length.
        """
        max_len = min(max_len, len(context))
        if max_len < min_len or len(self.sa) == 0:
            return None
        best: Match | None = None
        lo_len, hi_len = min_len, max_len
        while lo_len <= hi_len:
            k = (lo_len + hi_len) // 2
            lo, hi = self.find(context[-k:])
            if hi > lo:
                best, lo_len = Match(k, lo, hi), k + 1
            else:
                hi_len = k - 1
        return best

    def continuations(self, match: Match, max_continuations: int, length: int) -> list[list[int]]:
        """Up to `max_continuations` token lists of at most `length` that followed the match (SEP cuts them).

        Occurrences are sampled evenly over the range, so continuation counts stay proportional to how often
        each continuation follows the pattern.
        """
        if match.count <= max_continuations:
            rows = np.arange(match.lo, match.hi)
        else:
            rows = np.linspace(match.lo, match.hi - 1, max_continuations).round().astype(np.int64)
        out = []
        for p in np.asarray(self.sa[rows], dtype=np.int64):
            cont = self.tokens[p + match.length:p + match.length + length]
            stop = np.flatnonzero(cont < 0)
            cont = cont[: stop[0]] if len(stop) else cont
            if len(cont):
                out.append(cont.tolist())
        return out

    def lookup(self, context: list[int], max_continuations: int = 64, length: int = 8, max_len: int = 16,
               min_len: int = 2) -> tuple[int, list[list[int]]]:
        """(matched suffix length, continuations) for the longest matching suffix of `context`; (0, []) if none."""
        match = self.longest_suffix_match(context, max_len, min_len)
        if match is None:
            return 0, []
        return match.length, self.continuations(match, max_continuations, length)
