"""OPT-Tree (arXiv 2406.17276): the draft tree that maximises expected acceptance length under a node budget.

Every node's p̂ is the product of the draft probabilities along its path (root = 1), and the expected number
of accepted draft tokens of a tree is E[A] = Σ p̂ over its nodes. Because p̂ never grows along a path, the
n nodes with the largest p̂ always form a connected (prefix-closed) subtree, so "the best tree of n nodes" is
simply "the n largest p̂". The tree is grown layer by layer:

1. one draft forward over the frontier (the layer added last) gives every frontier node's next-token row;
2. of all children of the frontier, the n with the largest p̂ become the next layer (equivalently: each
   node's top-n children, then the global top-n);
3. E[A]_d = the sum of the n largest p̂ among all nodes grown so far; another layer (another draft forward)
   is grown only while E[A]_d − E[A]_{d−1} > δ, and never past `max_depth` layers;
4. the result is the n nodes with the largest p̂.

Every node of the true top-n (over all token paths of the depth reached) is grown: its ancestors are at
least as likely, so fewer than n nodes of their layer and fewer than n of their siblings beat them.

How n and δ are tied to the engine:
- n is the node budget the sizer passes to `propose(context, max_nodes)`. With the cost-aware sizer that
  budget comes from the measured verification cost curve (a CPU gets a small tree, a GPU a large one), and
  the sizer may still cut the tree further with its learnt acceptance estimates.
- δ compares the two sides of one more layer in the same unit: it adds ΔE[A] expected tokens, and costs one
  draft forward, which is t_draft / t_target plain decoding steps (a plain step yields one token). So the
  default δ is the measured ratio of a draft forward to a target plain step (the paper recommends a δ
  between that ratio and 1), clamped to [0.01, 1]; before both times are known, δ = 0.5 (the OPT-Tree
  repository's default).

The core, `grow_opt_tree`, is a pure function of an `expand` callable, so it is tested on hand-made
distributions; `DraftModelProposer(shape="optree")` supplies a batched draft-model forward with a tree mask.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rasd.decoding.step.tree import DraftTree

DEFAULT_DELTA = 0.5
DEFAULT_MAX_DEPTH = 10
DELTA_RANGE = (0.01, 1.0)

# (tree grown so far, frontier node indices: always the last nodes added) -> next-token probabilities
# [len(frontier), vocab], one row per frontier node, in frontier order.
Expand = Callable[[DraftTree, list[int]], torch.Tensor]


@dataclass
class OptTreeResult:
    """The chosen tree, and how it was grown (for statistics and tests)."""

    tree: DraftTree                   # the n largest-p̂ nodes (prefix-closed)
    grown: DraftTree                  # every node grown, before the final top-n
    expected: list[float] = field(default_factory=list)   # E[A] after each layer (sum of the n largest p̂)

    @property
    def layers(self) -> int:
        """Layers grown = calls of `expand` (draft forwards)."""
        return len(self.expected)


def delta_from_times(draft_forward_s: float | None, target_step_s: float | None) -> float:
    """δ = t_draft / t_target clamped to DELTA_RANGE; the default 0.5 while either time is unknown."""
    if not draft_forward_s or not target_step_s or draft_forward_s <= 0 or target_step_s <= 0:
        return DEFAULT_DELTA
    lo, hi = DELTA_RANGE
    return min(max(draft_forward_s / target_step_s, lo), hi)


def grow_opt_tree(root_token: int, expand: Expand, n: int, delta: float = DEFAULT_DELTA,
                  max_depth: int = DEFAULT_MAX_DEPTH, source: str = "optree") -> OptTreeResult:
    """Grow layers while the gain in E[A] exceeds δ; return the n largest-p̂ nodes (see module docstring)."""
    grown = DraftTree.root_only(root_token)
    if n <= 0 or max_depth <= 0:
        return OptTreeResult(tree=grown, grown=grown)
    best: list[float] = []            # min-heap of the n largest p̂ so far
    expected: list[float] = []
    frontier = [0]
    for _ in range(max_depth):
        probs = expand(grown, frontier)                      # [F, vocab]
        layer = best_children(grown, frontier, probs, n)
        if not layer:
            break
        first = len(grown)
        for score, parent, token in layer:
            grown.add(parent, token, source, score)
        frontier = list(range(first, len(grown)))
        total = _push_largest(best, [score for score, _, _ in layer], n)
        gain = total - (expected[-1] if expected else 0.0)
        expected.append(total)
        if gain <= delta:
            break
    return OptTreeResult(tree=grown.top_nodes(n), grown=grown, expected=expected)


def best_children(tree: DraftTree, frontier: list[int], probs: torch.Tensor, n: int
                  ) -> list[tuple[float, int, int]]:
    """The n children of the frontier with the largest p̂, as (p̂, parent, token), most likely first.

    The global top-n over all children equals the global top-n of each node's top-n children. Children
    with p̂ = 0 are never proposed (they can never be accepted). One (parent, token) pair appears once, so
    siblings never repeat a token.
    """
    k = min(n, probs.shape[-1])
    row_p, row_tok = (t.cpu() for t in probs.topk(k, dim=-1))                               # [F, k] each, host
    parent_scores = torch.tensor([tree.scores[f] for f in frontier], dtype=torch.float64)   # [F]
    scores = (parent_scores[:, None] * row_p.to(torch.float64)).reshape(-1)                 # [F * k]
    top = scores.topk(min(n, scores.numel()))
    tokens = row_tok.reshape(-1)[top.indices].tolist()
    out = []
    for score, flat, token in zip(top.values.tolist(), top.indices.tolist(), tokens, strict=True):
        if score <= 0.0:
            break
        out.append((score, frontier[flat // k], int(token)))
    return out


def _push_largest(heap: list[float], values: list[float], n: int) -> float:
    """Keep the n largest values seen in `heap` (a min-heap) and return their sum."""
    for v in values:
        if len(heap) < n:
            heapq.heappush(heap, v)
        elif v > heap[0]:
            heapq.heapreplace(heap, v)
    return sum(heap)
