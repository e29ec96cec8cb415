"""The simple tree-size policies: `fixed` (a node count), `heuristic` (HF's assisted-generation depth
schedule) and `threshold` (a path-confidence cut). None of them needs the target's cost curve.

- `fixed`: the `max_nodes` nodes with the best proposer scores; learns nothing.
- `heuristic`: Hugging Face's assisted-generation schedule as a depth limit: +2 after a step in which every
  drafted token on the accepted path was accepted (the path ended at a leaf of the verified tree), −1
  otherwise, never below 1.
- `threshold`: keep nodes whose path confidence (the proposer's p̂, made monotone) is at least τ = 0.3; a
  sampled node by its parent's confidence (drafting it was decided before it was drawn).

Why their defaults: docs/lab-notes/sizing.md, "simple".
"""

from __future__ import annotations

from typing import Any

from rasd.decoding.sizing.protocol import SizerDefaults
from rasd.decoding.step.tree import DraftTree


class FixedSizer(SizerDefaults):
    """Keep at most `max_nodes` nodes by proposer score: no cost model (for tests and GPUs)."""

    def __init__(self, max_nodes: int = 32):
        self.max_nodes = max_nodes

    def budget(self, context_len: int) -> int:
        return self.max_nodes

    def cut(self, tree: DraftTree, context_len: int) -> DraftTree:
        return tree.top_nodes(self.max_nodes)

    def observe(self, tree: DraftTree, accepted: list[int], overhead_s: float,
                verify_s: float | None = None) -> None:
        """Fixed sizing learns nothing."""



def depth_cut(tree: DraftTree, limit: int) -> DraftTree:
    """The nodes at depth <= `limit` (prefix-closed: an ancestor is never deeper than its descendant)."""
    depths = tree.depths()
    if max(depths) <= limit:
        return tree
    return tree.subtree(i for i in range(1, len(tree)) if depths[i] <= limit)


def ended_at_leaf(tree: DraftTree, accepted: list[int]) -> bool:
    """Whether the accepted path ran out of draft rather than being rejected.

    True when the last accepted node (the root if none) has no children in the verified tree: every
    drafted token the target looked at on that path was accepted, HF's "all draft tokens accepted".
    """
    last = accepted[-1] if accepted else 0
    return not tree.children(last)


class HeuristicSizer(SizerDefaults):
    """HF's `num_assistant_tokens_schedule="heuristic"` as a depth limit on the tree.

    HF starts at 20 assistant tokens for GPU-sized models; `initial=5` here because a CPU pays for every
    token of a tree. `max_depth` caps the growth when proposers stay short.
    """

    def __init__(self, max_nodes: int = 64, initial: int = 5, max_depth: int = 32):
        self.max_nodes, self.max_depth = max_nodes, max_depth
        self.depth = max(1, min(initial, max_depth))

    def budget(self, context_len: int) -> int:
        return self.max_nodes

    def cut(self, tree: DraftTree, context_len: int) -> DraftTree:
        return depth_cut(tree, self.depth).top_nodes(self.max_nodes)

    def observe(self, tree: DraftTree, accepted: list[int], overhead_s: float,
                verify_s: float | None = None) -> None:
        """+2 when all drafted tokens on the path were accepted, −1 otherwise (min 1); no draft: no change."""
        if tree.num_draft_tokens == 0:
            return
        if ended_at_leaf(tree, accepted):
            self.depth = min(self.depth + 2, self.max_depth)
        else:
            self.depth = max(self.depth - 1, 1)

    def state(self) -> dict[str, Any]:
        """The depth limit the schedule has reached."""
        return {"depth": self.depth}

    def load_state(self, state: dict[str, Any]) -> None:
        self.depth = int(state["depth"])


class ThresholdSizer(SizerDefaults):
    """Keep the nodes whose path confidence is at least `threshold` (AdaEAGLE/EAGLE-2-style cut).

    0.3 by default: a node is worth verifying when it is accepted in roughly one step in three, about what
    one more tree token costs relative to a plain step on a CPU (docs/lab-notes/sizing.md).
    """

    def __init__(self, max_nodes: int = 64, threshold: float = 0.3):
        self.max_nodes, self.threshold = max_nodes, threshold

    def budget(self, context_len: int) -> int:
        return self.max_nodes

    def cut(self, tree: DraftTree, context_len: int) -> DraftTree:
        scores = tree.monotone_scores()
        keep = [i for i in range(1, len(tree))
                if scores[tree.parents[i] if i in tree.q else i] >= self.threshold]
        return tree.subtree(keep).top_nodes(self.max_nodes)

    def observe(self, tree: DraftTree, accepted: list[int], overhead_s: float,
                verify_s: float | None = None) -> None:
        """A fixed threshold learns nothing."""


