"""The grow rule: whether one more draft forward (another tree layer) can pay for itself.

A model drafter pays for every layer it grows before the sizer's `cut` sees the tree, so the cost-aware
sizer decides layer by layer whether the best cut of the deeper tree, charged the extra draft forward, beats
the best cut of the tree as it is (`GrowRule.pays`). `GrowRule` is that decision frozen for one step
(estimates and step times, no curve provider), small enough to travel with a call to a draft worker.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rasd.decoding.sizing.acceptance import AcceptanceEstimator, main_line
from rasd.decoding.step.tree import DraftTree


def best_prefix(ranked: list[float], base: int, gain: float, floor: float, step_s: Callable[[int], float],
                extra_s: float = 0.0) -> tuple[int, float]:
    """(n, expected tokens per second) of the best first-n of `ranked` (p̂, best first) verified beside `base`
    tree tokens already worth `gain`; (0, floor) when no prefix beats `floor`. `step_s(n)`: the time of a step
    verifying n tree tokens; `extra_s`: time paid for any prefix (one more draft forward)."""
    best_n, best = 0, floor
    for n, p in enumerate(ranked, start=1):
        gain += p
        value = gain / (step_s(base + n) + extra_s)
        if value > best:
            best_n, best = n, value
    return best_n, best


@dataclass
class GrowRule:
    """`CostAwareSizer.grow_pays` frozen for one step: acceptance estimates and step times, no curve provider,
    so it can travel to a draft worker with the call (a few KB) and stop the worker's tree where the sizer
    would stop a local one."""

    estimator: AcceptanceEstimator
    step_s: list[float]        # [n + 1]: seconds of a step verifying 1 .. n + 1 tree tokens (n <= the budget)
    margin: float = 1.05

    def pays(self, tree: DraftTree, frontier: list[int], forward_s: float, source: str | None = None) -> bool:
        """One step of look-ahead: each frontier node gets one hypothetical child at its path p̂ times the rate
        at which the source's likeliest child is accepted one level deeper (`coarse_rates(top=True)`); growing
        pays when the best cut of that tree, charged the draft forward, beats the best cut of the tree as it is.
        `source`: the children's source when it is not their parent's (the root's children: the drafter's).
        Under sampling the drafter asks only about nodes already drawn, so the decision never depends on a
        node's own value. Both trees are calibrated as `cut` calibrates them, each node by its place and whether
        it is on its source's main line: a child under a side branch is a side branch, one under the main line
        is not, so where side branches never pay no layer is grown under them."""
        est = self.estimator
        probs, depths, main = est.path_probs(tree), tree.depths(), main_line(tree)
        child_source = [source or tree.sources[f] for f in frontier]
        rates = {src: est.coarse_rates(src, top=True) for src in set(child_source)}
        taken = dict.fromkeys(frontier, 0.0)       # the conditional rates a frontier node's children have already
        for i in range(1, len(tree)):
            if tree.parents[i] in taken and probs[tree.parents[i]] > 0:
                taken[tree.parents[i]] += probs[i] / probs[tree.parents[i]]
        # a new child beside them adds at most what they leave (`_share_parent`: min(rate, 1 - taken)); it is its
        # parent's likeliest child, so on the main line where its parent is
        deeper = [(probs[f] * min(rates[src][min(depths[f] + 1, est.max_depth)], max(0.0, 1.0 - taken[f])), main[f])
                  for f, src in zip(frontier, child_source, strict=True)]
        now = [(probs[i], main[i]) for i in range(1, len(tree))]
        plain = self.margin / self.step_s[0]
        return self._best(deeper + now, plain, forward_s) > self._best(now, plain, 0.0)

    def _best(self, nodes: list[tuple[float, bool]], plain: float, extra_s: float) -> float:
        """Expected tokens per second of the best cut of these (p̂, on the main line) nodes, calibrated as `cut`
        calibrates them, charged `extra_s`."""
        ranked = sorted(nodes, key=lambda n: -n[0])[: len(self.step_s) - 1]
        values = self.estimator.calibrated([p for p, _ in ranked], mains=[m for _, m in ranked])
        return best_prefix(values, 1, 1.0, plain, self._step, extra_s)[1]

    def __call__(self, tree: DraftTree, frontier: list[int], context_len: int, forward_s: float) -> bool:
        """A drafter's `grow_pays` hook (the context length is this rule's already)."""
        return self.pays(tree, frontier, forward_s)

    def _step(self, n_tokens: int) -> float:
        return self.step_s[min(n_tokens, len(self.step_s)) - 1]


