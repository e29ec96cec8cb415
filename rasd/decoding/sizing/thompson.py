"""EESD's draft length by Thompson sampling (`thompson`), as a depth limit on any proposed tree.

A Beta(α, β) posterior on the per-token acceptance rate θ; each step, level by level, sample θ̃ ~ Beta(α, β)
and go one level deeper while θ̃^d (the sampled chance that a depth-d token is reached and accepted) is worth
its cost `min_gain`, up to a hard cap; after the verification α += the accepted tokens and β += 1 when a
drafted token was rejected. A depth limit never looks at the current step's tokens, so it stays exact
under sampling.
"""

from __future__ import annotations

import random
from typing import Any

from rasd.decoding.sizing.protocol import SizerDefaults
from rasd.decoding.sizing.simple import depth_cut, ended_at_leaf
from rasd.decoding.step.tree import DraftTree


class ThompsonSizer(SizerDefaults):
    """EESD's Thompson-sampling draft length, as a depth limit on the tree.

    θ (per-token acceptance given the previous token was accepted) has a Beta(α, β) posterior. Level by
    level, θ̃ ~ Beta(α, β) is sampled and the tree goes one level deeper while θ̃^d >= `min_gain`: acting
    optimally for a sampled θ is Thompson sampling, so an uncertain posterior sometimes tries deeper drafts
    and a confident one settles. At least `min_depth` levels are kept (so there is always something to
    learn from) and at most `max_depth` (the hard cap). Tokens after the first rejection are never judged,
    so a step adds its accepted tokens to α and at most one rejection to β.
    """

    def __init__(self, max_nodes: int = 64, prior: tuple[float, float] = (1.0, 1.0), min_gain: float = 0.3,
                 min_depth: int = 1, max_depth: int = 10, decay: float = 1.0, seed: int = 0):
        self.max_nodes, self.min_gain = max_nodes, min_gain
        self.min_depth, self.max_depth, self.decay = min_depth, max_depth, decay
        self.prior = prior
        self.alpha, self.beta = prior
        self.depth = min_depth          # the depth limit chosen by the last `cut`
        self._rng = random.Random(seed)

    def budget(self, context_len: int) -> int:
        return self.max_nodes

    def sample_depth(self) -> int:
        """Go one level deeper while the sampled θ̃^(d+1) pays for the next level."""
        depth = self.min_depth
        while depth < self.max_depth:
            theta = self._rng.betavariate(self.alpha, self.beta)
            if theta ** (depth + 1) < self.min_gain:
                break
            depth += 1
        return depth

    def cut(self, tree: DraftTree, context_len: int) -> DraftTree:
        self.depth = self.sample_depth()
        return depth_cut(tree, self.depth).top_nodes(self.max_nodes)

    def observe(self, tree: DraftTree, accepted: list[int], overhead_s: float,
                verify_s: float | None = None) -> None:
        """α += accepted tokens; β += 1 if the path stopped at a rejection (no draft: nothing learnt)."""
        if tree.num_draft_tokens == 0:
            return
        a0, b0 = self.prior
        self.alpha = a0 + (self.alpha - a0) * self.decay + len(accepted)
        self.beta = b0 + (self.beta - b0) * self.decay + (0.0 if ended_at_leaf(tree, accepted) else 1.0)

    def state(self) -> dict[str, Any]:
        """The posterior (α, β); the depth of the last cut is redrawn every step."""
        return {"alpha": self.alpha, "beta": self.beta}

    def load_state(self, state: dict[str, Any]) -> None:
        self.alpha, self.beta = float(state["alpha"]), float(state["beta"])
