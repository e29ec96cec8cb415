"""RASD (arXiv 2503.03434): prune the retrieval tree with a probability source, fuse it into the draft tree.

Pruning. A retrieval tree is a set of branches, one per distinct first token. Retrieved continuations are
often irrelevant (a 2-token suffix match in a large datastore), and every extra node costs verification
compute, so each branch is scored by how likely its first token is under a cheap probability source (the
draft model's next-token distribution) times its retrieval count share; branches whose first token is outside
the source's top-k or under a probability floor are dropped, and at most `max_branches` survive. The
probability source is any `probs_fn(context) -> first-token probabilities [vocab]` (a draft model today;
Token Recycling's adjacency matrix can plug in later). Without one, branches are pruned by counts alone.

Fusion. Each kept retrieval path is walked down the draft tree by token equality and the unmatched rest is
grafted under the deepest match (longest-prefix matching), best-scored nodes first, until a total node
budget is spent. Siblings never repeat a token. The draft tree is the base and is never cut: under sampling
its nodes were drawn from q and must stay first among their siblings with their q, for exactness (the
retrieval nodes are deterministic candidates, which may follow in any number).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from rasd.decoding.step.tree import DraftTree

ProbsFn = Callable[[list[int]], torch.Tensor | None]   # context -> next-token probabilities [vocab]


@dataclass(frozen=True)
class PruneConfig:
    """Which retrieval branches survive pruning.

    With probabilities: a branch is kept when its first token is among the `top_k` most likely tokens and
    has probability >= `min_prob`. Without: when its count share is >= `min_share`. Either way at most
    `max_branches` branches, ranked by probability × count share (by count share alone without
    probabilities).

    `max_branches=4` was the best of 2, 4 and 8 measured with counts only (the embedded model has no draft
    model): mean accepted 1.39, 1.51, 1.49 on LongBench document QA (bench/measure_retrieval.py). `top_k=8` and
    `min_prob=0` are unmeasured guesses: no draft model sharing the embedded model's tokenizer exists here.
    """

    top_k: int = 8
    min_prob: float = 0.0
    min_share: float = 0.0
    max_branches: int = 4


def branch_of(tree: DraftTree) -> list[int]:
    """For every node the root child whose subtree holds it (0 for the root)."""
    branch = [0] * len(tree)
    for i in range(1, len(tree)):
        parent = tree.parents[i]
        branch[i] = i if parent == 0 else branch[parent]
    return branch


def rank_branches(tree: DraftTree, first_probs: torch.Tensor | None, config: PruneConfig) -> list[int]:
    """The root children to keep, best first."""
    children = tree.children(0)
    if first_probs is None:
        scored = [(tree.scores[c], c) for c in children if tree.scores[c] >= config.min_share]
    else:
        probs = first_probs.float()                                     # [vocab]
        k = min(config.top_k, probs.numel())
        top = set(probs.topk(k).indices.tolist()) if k > 0 else set()
        scored = [(float(probs[tree.tokens[c]]) * tree.scores[c], c) for c in children
                  if tree.tokens[c] in top and float(probs[tree.tokens[c]]) >= config.min_prob]
    scored.sort(key=lambda s: (-s[0], s[1]))
    return [c for _, c in scored[: config.max_branches]]


def prune(tree: DraftTree, first_probs: torch.Tensor | None, config: PruneConfig) -> tuple[DraftTree, int]:
    """(the tree with only the kept branches, how many nodes were dropped).

    With probabilities, kept nodes' scores are multiplied by their branch's first-token probability, so
    that scores rank nodes across branches and sources like path probabilities do.
    """
    keep = set(rank_branches(tree, first_probs, config))
    branch = branch_of(tree)
    kept_nodes = [i for i in range(1, len(tree)) if branch[i] in keep]
    out = tree.subtree(kept_nodes)
    if first_probs is not None:
        out_branch = branch_of(out)
        for i in range(1, len(out)):
            out.scores[i] *= float(first_probs[out.tokens[out_branch[i]]])
    return out, tree.num_draft_tokens - len(kept_nodes)


def graft_within(base: DraftTree, other: DraftTree, max_nodes: int | None = None,
                 claim: Collection[str] = ()) -> DraftTree:
    """Merge `other` into `base` in place by longest-prefix matching, adding at most up to `max_nodes` nodes.

    `other`'s nodes go in best-score first (monotone scores: a parent always precedes its children), so a
    tight budget keeps the likeliest part of `other`. A node whose token already sits under the matched
    parent merges into it (no duplicate siblings), keeping the larger score and the base's source, or taking
    `other`'s where the base's is one of `claim`. `other` must not hold sampled nodes (q): those belong in the
    base, before any deterministic sibling (a claimed node keeps its q: only the tag moves).
    """
    if other.tokens[0] != base.tokens[0]:
        raise ValueError("cannot merge trees with different roots")
    if other.q:
        raise ValueError("graft sampled (q) nodes as the base tree, never into another tree")
    index = {(base.parents[i], base.tokens[i]): i for i in range(1, len(base))}
    scores = other.monotone_scores()
    remap = {0: 0}
    for i in sorted(range(1, len(other)), key=lambda j: (-scores[j], j)):
        parent = remap.get(other.parents[i])
        if parent is None:
            continue                      # its parent did not fit in the budget
        key = (parent, other.tokens[i])
        node = index.get(key)
        if node is None:
            if max_nodes is not None and base.num_draft_tokens >= max_nodes:
                continue
            node = index[key] = len(base)
            base.tokens.append(other.tokens[i])
            base.parents.append(parent)
            base.sources.append(other.sources[i])
            base.scores.append(other.scores[i])
        else:
            base.scores[node] = max(base.scores[node], other.scores[i])
            if base.sources[node] in claim:
                base.sources[node] = other.sources[i]
        remap[i] = node
    return base


def merge_trees(root_token: int, trees: Sequence[DraftTree], max_nodes: int) -> DraftTree:
    """One tree from several deterministic candidate trees: union by longest prefix, then the top nodes.

    Earlier trees own shared nodes (their source tag wins), so pass the most trusted source first.
    """
    out = DraftTree.root_only(root_token)
    for tree in trees:
        graft_within(out, tree)
    return out.top_nodes(max_nodes)


def fuse(draft: DraftTree, retrieved: DraftTree, max_nodes: int, drafted: Collection[str] = ("draft",)
         ) -> DraftTree:
    """RASD fusion: graft the (pruned) retrieval tree into the draft tree within a total node budget.

    The draft tree is kept whole (its proposer already respected the budget); retrieval nodes fill the
    remaining room. A token both propose is tagged with the retrieval source (`drafted`: the draft's source
    tags, which a retrieval source takes over; a node already claimed stays with the first). Why: retrieval
    costs nothing a step and the draft a forward a layer, so the draft's learnt acceptance (`sizing.sizers`,
    which decides whether its forwards pay) must count only what it adds; tagged "draft", its nodes were
    credited with the request's own text they repeated (LongBench docqa). Returns `draft`, modified in place.
    """
    return graft_within(draft, retrieved, max_nodes, claim=drafted)
