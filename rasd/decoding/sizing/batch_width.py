"""Tree size for a whole batch step: one width W for every row, chosen against a batched cost model.

A batched forward pads every row to the widest tree ([B, W] tokens), so a row's tree size is not its own
business: one request with a 30-node tree makes seven others pay for 30. The single-request sizer
(`cost_aware.CostAwareSizer`) cannot see that, and the batch's cost is not the single-row curve either: at
B rows of context L each, attention reads B·L keys per query token, so 8 rows of 8 tokens cost far more than
64 tokens in one row (docs/lab-notes/sizing.md, "batch_width").

So, per step, with p̂ the row's own acceptance estimates (its sizer's `AcceptanceEstimator`):

    value(W) = Σ_b (1 + Σ of row b's W-1 largest p̂) / (t̂(B, W) + overhead),

and every row is filled to W with its best nodes (padding slots are paid for anyway). t̂ is a two-parameter
model fitted online to the forwards this batch actually ran,

    t̂(B, W) = a · curve(B·W) + c · W · Σ_b L_b,

the single-row curve at the same token count (the matrix multiplies) plus attention over every row's
context. a = 1, c = 0 is the prior (ridge-regularised, a quarter observation's weight): it starts optimistic, so
large widths are tried early and priced by what they really cost.

Only rows whose sizer is cost-aware are re-sized. A row under another policy (`fixed`, `thompson`, ...)
keeps the tree its own sizer cut, and nodes sampled from q are never dropped one by one (see
`sizing.protocol`): such rows only set a lower bound on W.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from rasd.decoding.sizing.cost import CostCurve
from rasd.decoding.sizing.cost_aware import rank_nodes
from rasd.decoding.sizing.protocol import Sizer
from rasd.decoding.step.tree import DraftTree


@dataclass
class BatchCostModel:
    """t̂(B, W) = a·curve(B·W) + c·W·ΣL, least squares over the last `window` forwards, shrunk to (1, 0)."""

    window: int = 64
    prior_weight: float = 0.25
    a: float = 1.0
    c: float = 0.0
    obs: deque[tuple[float, float, float]] = field(default_factory=deque)   # (curve part, W·ΣL, seconds)

    def features(self, curve: CostCurve, rows: int, width: int, context_sum: int) -> tuple[float, float]:
        return curve.latency(rows * width), float(width * context_sum)

    def predict(self, curve: CostCurve, rows: int, width: int, context_sum: int) -> float:
        x1, x2 = self.features(curve, rows, width, context_sum)
        return self.a * x1 + self.c * x2

    def observe(self, curve: CostCurve, rows: int, width: int, context_sum: int, seconds: float) -> None:
        x1, x2 = self.features(curve, rows, width, context_sum)
        self.obs.append((x1, x2, seconds))
        while len(self.obs) > self.window:
            self.obs.popleft()
        self._fit()

    def _fit(self) -> None:
        """Ridge least squares for (a, c) toward the prior (1, 0)."""
        n = len(self.obs)
        s11 = sum(x1 * x1 for x1, _, _ in self.obs)
        s22 = sum(x2 * x2 for _, x2, _ in self.obs)
        s12 = sum(x1 * x2 for x1, x2, _ in self.obs)
        s1t = sum(x1 * t for x1, _, t in self.obs)
        s2t = sum(x2 * t for _, x2, t in self.obs)
        # the prior weighs a quarter of an average observation: enough to split (a, c) while the batch has
        # only run one shape, too little to bias the fit once it has run several
        r1, r2 = self.prior_weight * s11 / n, self.prior_weight * s22 / n
        m11, m22, m12 = s11 + r1, s22 + r2, s12
        b1, b2 = s1t + r1 * 1.0, s2t
        det = m11 * m22 - m12 * m12
        if det <= 0:
            return
        a = (b1 * m22 - b2 * m12) / det
        c = (m11 * b2 - m12 * b1) / det
        if c < 0:                          # attention never makes a forward cheaper: refit a alone
            c, a = 0.0, b1 / m11
        self.a, self.c = max(a, 0.05), c


@dataclass
class RowPlan:
    """One row's candidates: nodes the batch may cut (ranked, with p̂) and nodes it must keep."""

    tree: DraftTree
    ranked: list[int]          # deterministic draft nodes, best p̂ first (prefix-closed in any prefix)
    probs: list[float]         # p̂ of `ranked`, same order
    kept: list[int]            # nodes that stay whatever W is (sampled from q, or a non-cost row's tree)

    @property
    def min_width(self) -> int:
        return 1 + len(self.kept)


def plan_row(tree: DraftTree, sizer: Sizer) -> RowPlan:
    """Rank a row's nodes by its own acceptance estimates; a row under another policy keeps its tree."""
    if not sizer.batch_sized:
        return RowPlan(tree, [], [], list(range(1, len(tree))))
    probs = sizer.estimator.path_probs(tree)
    sampled, ranked = rank_nodes(tree, probs)
    # p̂ as estimated, not `AcceptanceEstimator.calibrated`: a batch has no exploration step, and with it the
    # batched service stopped speculating for good (docs/lab-notes/sizing.md, "batch_width")
    return RowPlan(tree, ranked, [probs[i] for i in ranked], sampled)


class BatchSizer:
    """Picks W for a batch step and cuts every cost-aware row to its W best nodes."""

    def __init__(self, max_tokens: int = 128, margin: float = 1.05):
        self.max_tokens = max_tokens      # B·W never exceeds this (memory and worst-case latency bound)
        self.margin = margin              # as in CostAwareSizer: a near-tie with plain decoding is not taken
        self.cost = BatchCostModel()
        self.overhead_s = 0.0             # EMA of a step's time outside the forward (proposing, committing)
        self.last_width = 1

    def width(self, plans: Sequence[RowPlan], curve: CostCurve, context_sum: int) -> int:
        """The W that maximises expected committed tokens per second of the step."""
        rows = len(plans)
        low = max(p.min_width for p in plans)
        high = max(low, min(self.max_tokens // rows, max(p.min_width + len(p.ranked) for p in plans)))
        best_w, best_value = low, -1.0
        for w in range(low, high + 1):
            gain = sum(1.0 + sum(p.probs[: max(w - p.min_width, 0)]) for p in plans)
            value = gain / (self.cost.predict(curve, rows, w, context_sum) + self.overhead_s)
            if w == 1:
                value *= self.margin
            if value > best_value:
                best_w, best_value = w, value
        return best_w

    def cut(self, trees: Sequence[DraftTree], sizers: Sequence[Sizer], curve: CostCurve,
            context_sum: int) -> list[DraftTree]:
        """Every row's tree for this step (a row may end up smaller than W when it has fewer candidates)."""
        plans = [plan_row(tree, sizer) for tree, sizer in zip(trees, sizers, strict=True)]
        w = self.width(plans, curve, context_sum)
        self.last_width = w
        return [p.tree.subtree(p.kept + p.ranked[: max(w - p.min_width, 0)]) if p.ranked else p.tree
                for p in plans]

    def observe(self, curve: CostCurve, rows: int, width: int, context_sum: int, forward_s: float,
                overhead_s: float) -> None:
        """Learn the forward's cost and the step's overhead."""
        self.cost.observe(curve, rows, width, context_sum, forward_s)
        self.overhead_s = overhead_s if self.overhead_s == 0 else 0.9 * self.overhead_s + 0.1 * overhead_s
