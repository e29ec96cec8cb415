"""`pld`: prompt lookup — continue the current suffix the way it continued earlier in prompt + output.

The longest n-gram (max_ngram down to min_ngram) ending at the root that occurred before is looked up in an
incremental hash index (O(1) per committed token, no rescan of the context). Its most recent
`max_matches` occurrences give continuations of up to `max_len` tokens, counted into a trie: the tree
holds the most frequent distinct continuations, each node scored by the share of matches through it.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from rasd.decoding.proposers.base import ProposerBase
from rasd.decoding.step.sampling import SamplingParams
from rasd.decoding.step.tree import ROOT, DraftTree
from rasd.decoding.step.verify import Verdict

SOURCE = "context"


class NgramIndex:
    """For every n in [1, max_ngram]: n-gram -> positions right after its occurrences (ascending)."""

    def __init__(self, max_ngram: int):
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.table: list[dict[tuple[int, ...], list[int]]] = [defaultdict(list) for _ in range(max_ngram + 1)]

    def extend(self, context: list[int]) -> None:
        """Index tokens of `context` not seen yet (context only grows within a request)."""
        for pos in range(len(self.tokens), len(context)):
            self.tokens.append(context[pos])
            for n in range(1, min(self.max_ngram, pos + 1) + 1):
                self.table[n][tuple(self.tokens[pos - n + 1: pos + 1])].append(pos + 1)

    def continuations(self, n: int, max_matches: int, max_len: int) -> list[list[int]]:
        """Continuations after the most recent earlier occurrences of the last n tokens."""
        if n > len(self.tokens):
            return []
        starts = self.table[n].get(tuple(self.tokens[-n:]), [])
        out = []
        for start in reversed(starts):
            if start >= len(self.tokens):
                continue   # the suffix itself: nothing follows it yet
            out.append(self.tokens[start: start + max_len])
            if len(out) == max_matches:
                break
        return out


def counted_trie(root_token: int, continuations: list[list[int]], source: str, max_nodes: int) -> DraftTree:
    """Count continuations into a trie and keep the `max_nodes` most frequent nodes (prefix-closed).

    A node's score is the share of continuations passing through it, so deeper nodes never score higher
    than their parents and `top_nodes` keeps a connected tree. The trie is built with a (parent, token)
    dict rather than `DraftTree.add` (a linear sibling scan): a datastore lookup counts up to hundreds of
    continuations per step, and a quadratic build would cost more than a verification forward.
    """
    return count_trie(root_token, continuations, source).top_nodes(max_nodes)


def count_trie(root_token: int, continuations: list[list[int]], source: str,
               weights: list[int] | None = None) -> DraftTree:
    """The whole counted trie (`counted_trie` without the cut); `weights`: how often each continuation counts."""
    weights = [1] * len(continuations) if weights is None else weights
    tokens, parents, counts = [int(root_token)], [-1], [0]
    index: dict[tuple[int, int], int] = {}
    for cont, weight in zip(continuations, weights, strict=True):
        node = 0
        for tok in cont:
            child = index.get((node, tok))
            if child is None:
                child = index[(node, tok)] = len(tokens)
                tokens.append(int(tok))
                parents.append(node)
                counts.append(0)
            counts[child] += weight
            node = child
    total = max(sum(weights), 1)
    return DraftTree(tokens=tokens, parents=parents, sources=[ROOT] + [source] * (len(tokens) - 1),
                     scores=[1.0] + [c / total for c in counts[1:]])


class PromptLookupProposer(ProposerBase):
    """n-gram lookup in the request's own prompt and generated text."""

    name = "pld"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, max_len: int = 10, max_matches: int = 8,
                 source: str = SOURCE):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.max_len, self.max_matches, self.source = max_len, max_matches, source
        self.index = NgramIndex(max_ngram)

    def start(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        self.index = NgramIndex(self.max_ngram)
        self.index.extend(prompt_ids)

    def propose(self, context: list[int], max_nodes: int) -> DraftTree:
        """Longest matching n-gram first; the first n with any earlier occurrence wins."""
        self.index.extend(context)
        if max_nodes <= 0:
            return DraftTree.root_only(context[-1])
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            conts = self.index.continuations(n, self.max_matches, self.max_len)
            if conts:
                tree = counted_trie(context[-1], conts, self.source, max_nodes)
                tree.bucket = n   # longer matches are accepted more often: learn rates per match length
                return tree
        return DraftTree.root_only(context[-1])

    def observe(self, context: list[int], tree: DraftTree, verdict: Verdict, logits: torch.Tensor) -> None:
        """The index catches up lazily in `propose`."""
