"""Tree-size policies: how many of the proposed nodes are worth one verification forward.

`CostAwareSizer` maximises expected committed tokens per second of a step,

    value(n) = (1 + Σ_{i ≤ n} p̂_i) / (latency(n + 1) + overhead),

over the n nodes with the largest estimated path-acceptance probability p̂ (the bonus token is the 1).
p̂ is not trusted from proposers: `AcceptanceEstimator` learns, online, how often a node is accepted given
that its parent was, per (source, depth, sibling rank, proposer-confidence bucket), with Beta posteriors
that decay toward a prior so they follow the current request: a source that stopped being tried drifts back
to the prior mean and gets tried again (optionally, `thompson=True` samples the posteriors instead).
When nothing pays for its cost, n = 0 and the step is plain decoding: speculation never makes decoding
markedly slower than `ar`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from rasd.decoding.cost import CostCurve
from rasd.decoding.tree import DraftTree

Key = tuple[str, int, int, int, int]


@dataclass
class AcceptanceEstimator:
    """Beta(α, β) posteriors of P(node accepted | parent accepted)."""

    prior: tuple[float, float] = (1.0, 1.5)
    decay: float = 0.98
    max_depth: int = 8
    max_rank: int = 2
    seed: int = 0
    thompson: bool = False
    counts: dict[Key, list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def key(self, tree: DraftTree, node: int, depth: int, rank: int) -> Key:
        """Bucket a node by source, depth, sibling rank, the proposer's local confidence and tree bucket."""
        parent = tree.parents[node]
        parent_score = tree.scores[parent] if parent > 0 else 1.0
        local = tree.scores[node] / parent_score if parent_score > 0 else 0.0
        confidence = min(int(max(local, 0.0) * 4), 3)
        return (tree.sources[node], min(depth, self.max_depth), min(rank, self.max_rank), confidence, tree.bucket)

    def rate(self, key: Key) -> float:
        """A posterior sample (or the mean when `thompson` is off)."""
        a, b = self.counts.get(key, self.prior)
        if self.thompson:
            return self._rng.betavariate(a, b)
        return a / (a + b)

    def node_keys(self, tree: DraftTree) -> list[Key | None]:
        """The bucket of every node (None for the root)."""
        depths = tree.depths()
        rank_of: dict[int, int] = {}
        seen: dict[int, int] = {}
        for i in range(1, len(tree)):
            parent = tree.parents[i]
            rank_of[i] = seen.get(parent, 0)
            seen[parent] = rank_of[i] + 1
        return [None] + [self.key(tree, i, depths[i], rank_of[i]) for i in range(1, len(tree))]

    def path_probs(self, tree: DraftTree) -> list[float]:
        """p̂ for every node: product of the sampled conditional rates along its path (root = 1)."""
        keys = self.node_keys(tree)
        rates: dict[Key, float] = {}
        probs = [1.0] * len(tree)
        for i in range(1, len(tree)):
            k = keys[i]
            assert k is not None
            if k not in rates:
                rates[k] = self.rate(k)
            probs[i] = probs[tree.parents[i]] * rates[k]
        return probs

    def update(self, tree: DraftTree, accepted: list[int]) -> None:
        """Learn from a verified tree: every child of the root or of an accepted node was 'tried'."""
        for a_b in self.counts.values():
            a_b[0] = self.prior[0] + (a_b[0] - self.prior[0]) * self.decay
            a_b[1] = self.prior[1] + (a_b[1] - self.prior[1]) * self.decay
        on_path = {0, *accepted}
        keys = self.node_keys(tree)
        for i in range(1, len(tree)):
            if tree.parents[i] in on_path:
                k = keys[i]
                assert k is not None
                a_b = self.counts.setdefault(k, list(self.prior))
                a_b[0 if i in on_path else 1] += 1.0


class FixedSizer:
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


class CostAwareSizer:
    """Choose the tree size that maximises expected tokens per second against the measured cost curve."""

    def __init__(self, curve_for: Callable[[int], CostCurve], max_nodes: int = 64,
                 estimator: AcceptanceEstimator | None = None, margin: float = 1.05):
        self.curve_for = curve_for          # context length -> cost curve (cached per bucket)
        # Speculate only when the best tree beats plain decoding by this factor: picking the maximum of
        # noisy estimates is biased upwards, and a near-tie is not worth the risk of being slower than `ar`.
        self.margin = margin
        self.max_nodes = max_nodes
        self.estimator = estimator or AcceptanceEstimator()
        self.overhead_s = 0.0               # EMA of step time spent outside the target forward
        self.last_choice: tuple[int, int] = (0, 0)   # (nodes offered, nodes kept), for statistics
        # Online correction of the cached curve: a curve measured while the machine was busy would
        # otherwise forbid speculation forever. Observed verify times per tree size replace the curve's.
        self.observed: dict[int, float] = {}
        self.learn_latency = True
        self.explore_every = 16             # after this many plain steps, try a small tree once
        self.explore_nodes = 4
        self.max_backoff = 16
        self._plain_steps = 0
        # Exponential backoff: each exploration that gets nothing accepted doubles the wait before the next.
        # Where drafts never help (free writing), a fixed interval costs ~2% (one bigger forward in 16).
        self._backoff = 1
        self._exploring = False

    def latency(self, curve: CostCurve, n_tokens: int) -> float:
        """Observed latency of this tree size when known, else the measured curve's."""
        return self.observed.get(n_tokens, curve.latency(n_tokens))

    def budget(self, context_len: int) -> int:
        """Largest tree worth asking proposers for: bounded by the curve and by `max_nodes`."""
        return min(self.max_nodes, self.curve_for(context_len).max_tokens - 1)

    def cut(self, tree: DraftTree, context_len: int) -> DraftTree:
        """The prefix-closed subtree of the best size (possibly just the root)."""
        if tree.num_draft_tokens == 0:
            self.last_choice = (0, 0)
            return tree
        curve = self.curve_for(context_len)
        probs = self.estimator.path_probs(tree)
        # Nodes sampled from q are never dropped one by one: their estimates depend on the sampled token
        # (confidence = q(x)), and keeping x only for some values of x would bias the output distribution.
        # The proposer already sized them with `budget()`; only deterministic nodes are ranked and cut.
        sampled = sorted(tree.q)
        ranked = sorted((i for i in range(1, len(tree)) if i not in tree.q), key=lambda i: (-probs[i], i))
        limit = min(len(ranked), max(self.budget(context_len) - len(sampled), 0))
        best_n, gain = 0, 1.0 + sum(probs[i] for i in sampled)
        base = len(sampled) + 1
        best_value = (self.margin if not sampled else gain) / (self.latency(curve, base) + self.overhead_s)
        for n in range(1, limit + 1):
            gain += probs[ranked[n - 1]]
            value = gain / (self.latency(curve, base + n) + self.overhead_s)
            if value > best_value:
                best_n, best_value = n, value
        self._plain_steps = self._plain_steps + 1 if best_n == 0 else 0
        self._exploring = False
        if self._plain_steps >= self.explore_every * self._backoff:   # estimates/costs may be stale: look again
            best_n, self._plain_steps = min(self.explore_nodes, limit), 0
            self._exploring = best_n > 0
        self.last_choice = (tree.num_draft_tokens, best_n + len(sampled))
        return tree.subtree(sampled + ranked[:best_n])

    def observe(self, tree: DraftTree, accepted: list[int], overhead_s: float,
                verify_s: float | None = None) -> None:
        """Update acceptance posteriors, the per-step overhead and the observed latency of this size."""
        self.estimator.update(tree, accepted)
        if self._exploring:
            self._backoff = min(2 * self._backoff, self.max_backoff) if not accepted else 1
            self._exploring = False
        self.overhead_s = overhead_s if self.overhead_s == 0 else 0.9 * self.overhead_s + 0.1 * overhead_s
        if verify_s is not None and self.learn_latency:
            old = self.observed.get(len(tree))
            self.observed[len(tree)] = verify_s if old is None else 0.8 * old + 0.2 * verify_s
