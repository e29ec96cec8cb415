"""How likely a draft node is to be accepted: `AcceptanceEstimator`, learnt online from verdicts.

p̂ is not trusted from proposers: the estimator learns how often a node is accepted given that its parent
was, per (source, depth, sibling rank, proposer-confidence bucket, tree bucket), with Beta posteriors that
decay toward a prior so they follow the current request: a source that stopped being tried drifts back to
the prior mean and gets tried again. What those estimates still get wrong in the trees the sizer picks is
learnt too: per place in its ranking, for nodes on their source's main line and for side branches apart,
accepted over predicted (`position_factor`), which scales p̂ before the cut.

Measurements behind each rule: docs/lab-notes/sizing.md, "acceptance".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rasd.decoding.step.tree import DraftTree

Key = tuple[str, int, int, int, int]


def coarse_key(key: Key) -> tuple[str, int]:
    """The (source, depth) bucket that a fine bucket's estimate falls back to while it has little evidence."""
    return key[0], key[1]


def position_class(position: int) -> int:
    """A node's place in the sizer's ranking (1 = likeliest), in classes 1, 2-3, 4-7, 8-15, 16-31, 32+."""
    return min(max(position, 1).bit_length(), 6)


def top_key(key: Key) -> tuple[str, int, int] | None:
    """The (source, depth, rank 0) bucket: how often a parent's likeliest child is accepted (None for others)."""
    return (key[0], key[1], 0) if key[2] == 0 else None


@dataclass
class AcceptanceEstimator:
    """Beta(α, β) posteriors of P(node accepted | parent accepted)."""

    prior: tuple[float, float] = (1.0, 1.5)
    decay: float = 0.98
    max_depth: int = 8
    max_rank: int = 2
    counts: dict[Key | tuple[str, int] | tuple[str, int, int], list[float]] = field(default_factory=dict)
    # per (`position_class`, on the main line): [accepted, predicted] nodes at those places of the ranking
    # (decayed like `counts`)
    calibration: dict[tuple[int, bool], list[float]] = field(default_factory=dict)
    calibration_prior: float = 2.0   # pseudo-tokens of "as predicted": little evidence moves a factor little

    def key(self, tree: DraftTree, node: int, depth: int, rank: int) -> Key:
        """Bucket a node by source, depth, sibling rank, the proposer's local confidence and tree bucket."""
        parent = tree.parents[node]
        parent_score = tree.scores[parent] if parent > 0 else 1.0
        local = tree.scores[node] / parent_score if parent_score > 0 else 0.0
        local = min(local, 1.0) if local > 0 else 0.0      # also NaN -> 0: a bad score must not end the step
        confidence = min(int(local * 4), 3)
        return (tree.sources[node], min(depth, self.max_depth), min(rank, self.max_rank), confidence, tree.bucket)

    def rate(self, key: Key, coarse: list[float] | None = None) -> float:
        """The posterior mean; `coarse`: `coarse_rates(key[0])`, when the caller already has them.

        The fine bucket's own evidence is shrunk toward its (source, depth) bucket's rate, not toward the
        fixed prior: fine buckets are many and most are rarely tried, and a fixed prior for each of them let
        sizing keep dozens of nodes of a source that is almost never accepted (docs/lab-notes/sizing.md).
        """
        pa, pb = self.prior
        mean = (coarse if coarse is not None else self.coarse_rates(key[0]))[key[1]]
        a_f, b_f = self.counts.get(key, [pa, pb])
        a = a_f - pa + (pa + pb) * mean
        b = b_f - pb + (pa + pb) * (1.0 - mean)
        return a / (a + b)

    def coarse_rates(self, source: str, top: bool = False) -> list[float]:
        """Per depth 0..max_depth, the (source, depth) bucket's posterior mean, shrunk toward the prior mean
        or, when higher, the same source's rate one level shallower (index 0, the root: the prior mean).
        `top`: the rate of a parent's likeliest child alone (rank 0), what a look-ahead's one hypothetical
        child per node is (`GrowRule.pays`). Why apart: the pooled bucket counts every verified sibling, and
        at most one of them can be accepted, so the pooled rate understates the likeliest child's and a
        drafter's first forward was refused where it paid.

        Why shrink toward the shallower depth: a depth that the sizer has never verified kept the prior, so
        its nodes ranked below what was already verified and were never tried, and a source right at every
        shallow depth was held at small trees for a whole request. Never below the prior: given its parent was
        accepted, a node is usually *more* likely accepted than its parent was (a copy that matched goes on),
        so a low shallow rate says little about the next depth, and guessing low would stop a source from
        being tried at all. Measurements: docs/lab-notes/sizing.md.
        """
        pa, pb = self.prior
        prior_mean = pa / (pa + pb)
        means = [prior_mean]
        for d in range(1, self.max_depth + 1):
            target = max(prior_mean, means[-1])
            a_c, b_c = self.counts.get((source, d, 0) if top else (source, d), (pa, pb))
            a, b = a_c - pa + (pa + pb) * target, b_c - pb + (pa + pb) * (1.0 - target)
            means.append(a / (a + b))
        return means

    def node_keys(self, tree: DraftTree) -> list[Key | None]:
        """The bucket of every node (None for the root)."""
        depths, rank_of = tree.depths(), sibling_ranks(tree)
        return [None] + [self.key(tree, i, depths[i], rank_of[i]) for i in range(1, len(tree))]

    def path_probs(self, tree: DraftTree) -> list[float]:
        """p̂ for every node: product of the sampled conditional rates along its path (root = 1).

        Siblings are mutually exclusive (at most one child of a node is accepted). Where a node's children's
        conditional rates sum past 1, the likeliest child keeps its rate and the others share what it leaves,
        in proportion to their rates. Why: every sibling from rank 2 on shares one bucket's rate, shrunk toward
        the (source, depth) rate that rank 0 dominates; a prompt-lookup tree with many candidate continuations
        per node then counted several expected tokens per level. The likeliest child keeps its rate because its
        bucket is the best measured: scaling every sibling alike cut the request's own-text match beside the
        EAGLE head's top-k in `rasd`, and the batched service stopped speculating. Many cheap siblings still add
        up where the curve is flat. Measurements: docs/lab-notes/sizing.md.
        """
        keys = self.node_keys(tree)
        rates: dict[Key, float] = {}
        coarse: dict[str, list[float]] = {}      # per source, computed once per tree
        rate = [1.0] * len(tree)
        children: dict[int, list[int]] = {}
        for i in range(1, len(tree)):
            k = keys[i]
            assert k is not None
            if k not in rates:
                if k[0] not in coarse:
                    coarse[k[0]] = self.coarse_rates(k[0])
                rates[k] = self.rate(k, coarse[k[0]])
            rate[i] = rates[k]
            children.setdefault(tree.parents[i], []).append(i)
        for kids in children.values():
            _share_parent(rate, kids)
        probs = [1.0] * len(tree)
        for i in range(1, len(tree)):
            probs[i] = probs[tree.parents[i]] * rate[i]
        return probs

    def position_factor(self, position: int, main: bool = True) -> float:
        """Accepted over predicted tokens of the nodes verified at this place of the ranking (1 = likeliest),
        shrunk toward 1. Why: the sizer verifies a big tree exactly when its estimates are high, so their errors
        do not cancel there: the nodes ranked past the first few were accepted far less often than predicted.

        Kept apart for nodes on their source's main line (`main_line`) and off it. Why: a place means different
        things in a chain and in a bush. Pooled, the side branches of bushy trees (rejected siblings) set the
        factor that the later tokens of a copied chain were scaled by, so `pld` and `rasd` cut chains that were
        accepted whole, step after step. Measurements: docs/lab-notes/sizing.md."""
        accepted, predicted = self.calibration.get((position_class(position), main), (0.0, 0.0))
        return (accepted + self.calibration_prior) / (predicted + self.calibration_prior)

    def calibrated(self, ranked: list[float], start: int = 0, mains: list[bool] | None = None) -> list[float]:
        """p̂ of nodes in ranking order (`start` nodes ranked ahead of them), each times its place's factor;
        `mains`: whether each is on its source's main line (`main_line`; default: all are, as a look-ahead's
        likeliest children are)."""
        mains = [True] * len(ranked) if mains is None else mains
        return [p * self.position_factor(place, main)
                for place, (p, main) in enumerate(zip(ranked, mains, strict=True), start=start + 1)]

    def update(self, tree: DraftTree, accepted: list[int]) -> None:
        """Learn from a verified tree: every child of the root or of an accepted node was 'tried'.

        A step without drafts brings no evidence, so it does not decay the posteriors either: a drafter
        gated off for a while (`rasd.decoding.sizing.gate`) comes back with what was learnt about it.
        """
        if len(tree) <= 1:
            return
        self._calibrate(tree, self.path_probs(tree), {0, *accepted})   # the p̂ the cut ranked by, before learning
        for a_b in self.counts.values():
            a_b[0] = self.prior[0] + (a_b[0] - self.prior[0]) * self.decay
            a_b[1] = self.prior[1] + (a_b[1] - self.prior[1]) * self.decay
        on_path = {0, *accepted}
        keys = self.node_keys(tree)
        for i in range(1, len(tree)):
            if tree.parents[i] in on_path:
                k = keys[i]
                assert k is not None
                for bucket in (k, coarse_key(k), top_key(k)):
                    if bucket is None:
                        continue
                    a_b = self.counts.setdefault(bucket, list(self.prior))
                    a_b[0 if i in on_path else 1] += 1.0

    def forget(self, source: str, keep: float) -> None:
        """Move what was learnt about `source` toward the prior: only `keep` of its evidence stays.

        For a step in which the source was not tried (`CostAwareSizer.root_pays` refused it). Why: a refused
        source brings no evidence, so its low rate outlived the text it was learnt on: after a few prompts where
        the head was rarely right, `eagle` stayed off through later prompts where it was often right
        (docs/lab-notes/sizing.md)."""
        pa, pb = self.prior
        for key, a_b in self.counts.items():
            if key[0] == source:
                a_b[0] = pa + (a_b[0] - pa) * keep
                a_b[1] = pb + (a_b[1] - pb) * keep

    def state(self) -> dict[str, Any]:
        """The posteriors as plain JSON-able lists (`[[bucket...], [α, β]]`), what a later request starts from.

        The position calibration stays out: it starts afresh with each request, as it always has."""
        return {"counts": [[list(key), list(a_b)] for key, a_b in self.counts.items()]}

    def load_state(self, state: dict[str, Any]) -> None:
        """Start from the posteriors `state()` gave (its "counts"; the buckets as tuples again)."""
        self.counts = {tuple(key): [float(a), float(b)] for key, (a, b) in state["counts"]}

    def _calibrate(self, tree: DraftTree, probs: list[float], accepted: set[int]) -> None:
        """Fold one verified tree into `calibration`: its nodes ranked by p̂ as `rank_nodes` ranks them."""
        for entry in self.calibration.values():
            entry[0] *= self.decay
            entry[1] *= self.decay
        order = sorted(range(1, len(tree)), key=lambda i: (-probs[i], i))
        main = main_line(tree)
        for position, node in enumerate(order, start=1):
            entry = self.calibration.setdefault((position_class(position), main[node]), [0.0, 0.0])
            entry[0] += float(node in accepted)
            entry[1] += probs[node]


def sibling_ranks(tree: DraftTree) -> list[int]:
    """Every node's rank among its siblings from the same source, by the proposer's score (0 = its likeliest).

    Why not the order in the tree: in a fused tree (`rasd`) the draft's nodes come first, so the request's own
    text's likeliest continuation beside three EAGLE-head children was ranked 3 and rated like a source's
    fourth guess; and `pld`'s trie keeps its continuations in the order they were found (the latest
    occurrence first), not by how many occurrences agree (measured: docs/lab-notes/sizing.md).
    """
    groups: dict[tuple[int, str], list[int]] = {}
    for i in range(1, len(tree)):
        groups.setdefault((tree.parents[i], tree.sources[i]), []).append(i)
    rank = [0] * len(tree)
    for members in groups.values():
        if len(members) > 1:
            for r, i in enumerate(sorted(members, key=lambda j: (-tree.scores[j], j))):
                rank[i] = r
    return rank


def main_line(tree: DraftTree) -> list[bool]:
    """Whether each node is on its source's likeliest line: it and all its ancestors rank 0 among siblings."""
    rank = sibling_ranks(tree)
    out = [True] * len(tree)
    for i in range(1, len(tree)):
        out[i] = rank[i] == 0 and out[tree.parents[i]]
    return out


def _share_parent(rate: list[float], kids: list[int]) -> None:
    """Scale siblings' conditional rates (in place) so they sum to at most 1, the likeliest keeping its own."""
    total = sum(rate[i] for i in kids)
    if total <= 1.0:
        return
    top = max(kids, key=lambda i: rate[i])
    rest = total - rate[top]
    scale = max(0.0, 1.0 - rate[top]) / rest if rest > 0 else 0.0
    for i in kids:
        if i != top:
            rate[i] *= scale

