"""DraftTree: the one structure every proposer returns and the verifier consumes.

Node 0 is the root: the last committed token, which is not yet in the target's KV cache. Every other node
is a draft token whose parent index is smaller than its own (topological order), so masks, depths and
paths can be computed in one forward sweep. Siblings never repeat a token: a duplicate sibling would cost
verification compute and could never be accepted twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

ROOT = "root"
GRAMMAR = "grammar"   # the tag of the tokens a request's grammar forces (`engine.GenerationStream.propose`)


@dataclass
class DraftTree:
    """Token ids, parent indices, a source tag and an estimated path probability per node.

    `scores[i]` is the proposer's estimate p̂ that the whole path root→i is accepted (root = 1.0); cost-aware
    sizing keeps the nodes with the largest p̂. `q[i]`, when present, is the full draft distribution
    (shape [vocab]) that node i's token was *sampled* from; exact sampling then uses the SpecInfer residual
    rule for it instead of treating it as a deterministic candidate.
    """

    tokens: list[int]
    parents: list[int]
    sources: list[str]
    scores: list[float]
    q: dict[int, torch.Tensor] = field(default_factory=dict)
    bucket: int = 0   # proposer-defined confidence class of the whole proposal (e.g. matched n-gram length)
    pruned: int = 0   # candidate nodes the proposer's pruning dropped before offering this tree (statistics only)

    @classmethod
    def root_only(cls, root_token: int) -> DraftTree:
        """A tree with only the root: verifying it is one step of plain decoding."""
        return cls(tokens=[int(root_token)], parents=[-1], sources=[ROOT], scores=[1.0])

    @classmethod
    def chain(cls, root_token: int, tokens: Sequence[int], source: str,
              scores: Sequence[float] | None = None) -> DraftTree:
        """Root followed by one path of draft tokens."""
        tree = cls.root_only(root_token)
        parent = 0
        for i, tok in enumerate(tokens):
            parent = tree.add(parent, tok, source, 1.0 if scores is None else scores[i])
        return tree

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_draft_tokens(self) -> int:
        """Nodes other than the root."""
        return len(self.tokens) - 1

    def add(self, parent: int, token: int, source: str, score: float = 1.0) -> int:
        """Append a child of `parent` (or return the existing sibling with the same token).

        An existing sibling keeps its source but takes the larger score: two proposers agreeing on a
        token makes it more likely, never less.
        """
        if not 0 <= parent < len(self.tokens):
            raise IndexError(f"parent {parent} out of range for a tree of {len(self.tokens)} nodes")
        existing = self.child_with_token(parent, token)
        if existing is not None:
            self.scores[existing] = max(self.scores[existing], float(score))
            return existing
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.sources.append(source)
        self.scores.append(float(score))
        return len(self.tokens) - 1

    def add_path(self, parent: int, tokens: Iterable[int], source: str,
                 scores: Sequence[float] | None = None) -> list[int]:
        """Append a chain below `parent`, reusing matching nodes (longest-prefix merge)."""
        out = []
        for i, tok in enumerate(tokens):
            parent = self.add(parent, tok, source, 1.0 if scores is None else scores[i])
            out.append(parent)
        return out

    def children(self, node: int) -> list[int]:
        """Children of `node` in insertion order (the order sampling tries them)."""
        return [i for i in range(node + 1, len(self.parents)) if self.parents[i] == node]

    def child_with_token(self, node: int, token: int) -> int | None:
        """The child of `node` holding `token`, if any."""
        for i in range(node + 1, len(self.parents)):
            if self.parents[i] == node and self.tokens[i] == token:
                return i
        return None

    def depths(self) -> list[int]:
        """Depth of every node (root = 0)."""
        depth = [0] * len(self.parents)
        for i in range(1, len(self.parents)):
            depth[i] = depth[self.parents[i]] + 1
        return depth

    def path_to(self, node: int) -> list[int]:
        """Node indices from the first node below the root down to `node` (root excluded)."""
        path = []
        while node > 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def ancestor_mask(self) -> torch.Tensor:
        """Bool [T, T]: entry (i, j) is True when j is i itself or one of its ancestors.

        This is the tree attention pattern: a node sees exactly the tokens on its own path.
        """
        n = len(self.parents)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            if self.parents[i] >= 0:
                mask[i] = mask[self.parents[i]]
            mask[i, i] = True
        return mask

    def subtree(self, keep: Iterable[int]) -> DraftTree:
        """A new tree with only the nodes in `keep` (plus their ancestors, so it stays connected)."""
        wanted = {0}
        for node in keep:
            while node not in wanted:
                wanted.add(node)
                node = self.parents[node]
        order = sorted(wanted)
        remap = {old: new for new, old in enumerate(order)}
        out = DraftTree(tokens=[self.tokens[i] for i in order],
                        parents=[remap[self.parents[i]] if i else -1 for i in order],
                        sources=[self.sources[i] for i in order], scores=[self.scores[i] for i in order])
        out.q = {remap[i]: d for i, d in self.q.items() if i in remap}
        out.bucket = self.bucket
        out.pruned = self.pruned
        return out

    def top_nodes(self, budget: int) -> DraftTree:
        """Keep the `budget` draft nodes with the highest path score (connected by construction).

        Scores are made monotone along paths first (a child can never be likelier than its parent),
        so taking the global top nodes always yields a prefix-closed tree, as in OPT-Tree.
        """
        if budget >= self.num_draft_tokens:
            return self
        scores = self.monotone_scores()
        ranked = sorted(range(1, len(self.tokens)), key=lambda i: (-scores[i], i))
        return self.subtree(ranked[:max(budget, 0)])

    def monotone_scores(self) -> list[float]:
        """Scores clipped so that no node exceeds its parent."""
        out = list(self.scores)
        out[0] = 1.0
        for i in range(1, len(out)):
            out[i] = min(out[i], out[self.parents[i]])
        return out

    def graft(self, other: DraftTree) -> DraftTree:
        """Merge `other` (same root token) into this tree by longest-prefix matching, in place."""
        if other.tokens[0] != self.tokens[0]:
            raise ValueError("cannot merge trees with different roots")
        remap = {0: 0}
        for i in range(1, len(other.tokens)):
            parent = remap[other.parents[i]]
            if i in other.q and self.child_with_token(parent, other.tokens[i]) is not None:
                # Merging would drop q (or mix two qs): the candidate would no longer be a draw from the q
                # the verifier uses, and exact sampling would be lost. Refuse rather than be subtly wrong.
                raise ValueError("cannot graft a sampled draft node onto an existing sibling with the same token")
            remap[i] = self.add(parent, other.tokens[i], other.sources[i], other.scores[i])
            if i in other.q:
                self.q[remap[i]] = other.q[i]
        return self
