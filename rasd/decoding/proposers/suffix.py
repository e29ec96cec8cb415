"""`suffix`: SuffixDecoding (arXiv 2411.04975) — drafts from earlier responses across requests.

The longest suffix of the context that occurs in the `ResponseHistory` (earlier answers behind their prompts'
tails) is looked up; what followed its occurrences is counted into a tree, each node scored by the share of
occurrences through it (the paper's path probability: the product of count(child) / count(parent) down the
path). SuffixDecoding's two rules size the tree: at most `max_spec_factor * match_length + max_spec_offset`
nodes (a long match is a confident one: an answer being repeated; a one-token match earns almost nothing),
and no node whose path probability is below `min_token_prob`. Nodes are tagged "history".

Like the paper's per-request tree, the request's own prompt and output are searched too (`use_context`,
`pld`'s n-gram lookup, tagged "context"); the two trees are merged longest match first. `candidate_tree`
gives the history tree alone, for `RasdProposer` to fuse with its other sources.
"""

from __future__ import annotations

import torch

from rasd.decoding.drafting.fusion import merge_trees
from rasd.decoding.drafting.history import HistoryMatch, ResponseHistory
from rasd.decoding.proposers.base import ProposerBase
from rasd.decoding.proposers.pld import PromptLookupProposer, count_trie
from rasd.decoding.proposers.retrieval import match_class
from rasd.decoding.step.sampling import SamplingParams
from rasd.decoding.step.tree import DraftTree
from rasd.decoding.step.verify import Verdict

HISTORY = "history"


def spec_budget(match_length: int, max_spec_factor: float, max_spec_offset: float, max_nodes: int) -> int:
    """Nodes a match of `match_length` tokens may draft (SuffixDecoding's adaptive speculation length)."""
    return max(min(int(max_spec_factor * match_length + max_spec_offset), max_nodes), 0)


def weighted_tree(root_token: int, match: HistoryMatch, source: str, min_prob: float, budget: int) -> DraftTree:
    """Count the continuations (weighted) into a trie; keep nodes with path probability >= `min_prob`, then the
    `budget` likeliest. A child's count never exceeds its parent's, so both cuts keep a connected tree."""
    tree = count_trie(root_token, match.continuations, source, match.weights)
    likely = [i for i in range(1, len(tree)) if tree.scores[i] >= min_prob]
    return tree.subtree(likely).top_nodes(budget)


class SuffixProposer(ProposerBase):
    """Drafts from the response history (and, by default, the request's own text), SuffixDecoding's rules."""

    name = "suffix"

    def __init__(self, history: ResponseHistory, max_spec_factor: float = 1.0, max_spec_offset: float = 0.0,
                 min_token_prob: float = 0.1, max_match: int = 24, min_match: int = 1, max_continuations: int = 32,
                 max_len: int = 32, use_context: bool = True, source: str = HISTORY):
        """Defaults are ArcticInference's (factor 1, offset 0, min_token_prob 0.1); `max_len` caps a branch's
        depth, `max_continuations` the occurrences counted (the most recent)."""
        if history is None:
            raise ValueError("SuffixProposer needs a ResponseHistory (build_decoder gives an empty one)")
        self.history = history   # the engine adds each finished response here (`GenerationStream.finish`)
        self.max_spec_factor, self.max_spec_offset = max_spec_factor, max_spec_offset
        self.min_token_prob = min_token_prob
        self.max_match, self.min_match = max_match, min_match
        self.max_continuations, self.max_len, self.source = max_continuations, max_len, source
        self.context = PromptLookupProposer() if use_context else None

    def start(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        if self.context is not None:
            self.context.start(prompt_ids, sampling)

    def propose(self, context: list[int], max_nodes: int) -> DraftTree:
        if max_nodes <= 0:
            return DraftTree.root_only(context[-1])
        trees = [self.candidate_tree(context, max_nodes)]
        if self.context is not None:
            trees.append(self.context.propose(context, max_nodes))
        trees = sorted((t for t in trees if t.num_draft_tokens), key=lambda t: -t.bucket)
        tree = merge_trees(context[-1], trees, max_nodes)
        tree.bucket = match_class(trees[0].bucket) if trees else 0
        return tree

    def candidate_tree(self, context: list[int], max_nodes: int) -> DraftTree:
        """The history's tree alone (root only when nothing matched); `bucket` = the raw match length."""
        budget = spec_budget(self.max_match, self.max_spec_factor, self.max_spec_offset, max_nodes)
        match = self.history.lookup(context, self.max_continuations, min(self.max_len, budget),
                                    self.min_match, self.max_match) if budget > 0 else HistoryMatch()
        budget = spec_budget(match.length, self.max_spec_factor, self.max_spec_offset, max_nodes)
        if not match.length or budget <= 0:
            return DraftTree.root_only(context[-1])
        tree = weighted_tree(context[-1], match, self.source, self.min_token_prob, budget)
        tree.bucket = match.length
        return tree

    def observe(self, context: list[int], tree: DraftTree, verdict: Verdict, logits: torch.Tensor) -> None:
        """The history learns when a request ends (the engine adds the response), not per step."""
