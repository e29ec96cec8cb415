"""Tree-size policies: how many of the proposed nodes are worth one verification forward.

`CostAwareSizer` maximises expected committed tokens per second of a step,

    value(n) = (1 + Σ_{i ≤ n} p̂_i) / (latency(n + 1) + overhead),

over the n nodes with the largest estimated path-acceptance probability p̂ (the bonus token is the 1).
p̂ is not trusted from proposers: `AcceptanceEstimator` learns, online, how often a node is accepted given
that its parent was, per (source, depth, sibling rank, proposer-confidence bucket), with Beta posteriors
that decay toward a prior so they follow the current request: a source that stopped being tried drifts back
to the prior mean and gets tried again (optionally, `thompson=True` samples the posteriors instead). What
those estimates still get wrong in the trees the sizer picks is learnt too: per position in its ranking, for
nodes on their source's main line and for side branches apart, accepted over predicted (`position_factor`),
which scales p̂ before the cut.
When nothing pays for its cost, n = 0 and the step is plain decoding: speculation never makes decoding
markedly slower than `ar`.

Every policy has the same three methods, `budget(context_len)` (nodes to ask proposers for),
`cut(tree, context_len)` (the prefix-closed subtree to verify) and `observe(tree, accepted, overhead_s,
verify_s)` (learn from the verdict), and `make_sizer` picks one by name (`SIZINGS`):

- `cost` (default): `CostAwareSizer` above.
- `fixed`: the `max_nodes` nodes with the best proposer scores; learns nothing.
- `heuristic`: Hugging Face's assisted-generation schedule as a depth limit: +2 after a step in which every
  drafted token on the accepted path was accepted (the path ended at a leaf of the verified tree), −1
  otherwise, never below 1.
- `threshold`: keep nodes whose path confidence (the proposer's p̂, made monotone) is at least τ = 0.3.
- `thompson` (EESD): a Beta(α, β) posterior on the per-token acceptance rate θ; each step, level by level,
  sample θ̃ ~ Beta(α, β) and go one level deeper while θ̃^d (the sampled chance that a depth-d token is
  reached and accepted) is worth its cost `min_gain`, up to a hard cap; after the verification α += the
  accepted tokens and β += 1 when a drafted token was rejected.
- `ldlp` (AdaEAGLE): the trained Lightweight Draft Length Predictor (`rasd.decoding.sizing.ldlp`, trained by
  `rasd train ldlp`) predicts k from the target's embedding of the root and its final-norm hidden state at
  the last accepted position; nodes are kept while no ancestor's draft step would have stopped under
  AdaEAGLE-DDD (step >= k and cumulative draft log-prob < -0.6), up to k_max.

Exactness under sampling: a depth limit that does not look at the current step's tokens keeps every node
sampled from q with the chain it was drawn in (it is just a shorter draft), so it stays exact. A score cut
would drop a sampled node *because of its own value*, which biases the proposal away from q: the threshold
rule therefore decides a sampled node by its parent's confidence (drafting it was decided before it was
drawn), and deterministic nodes by their own.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from rasd.decoding.sizing.cost import CostCurve
from rasd.decoding.sizing.gate import DraftGate
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
    seed: int = 0
    thompson: bool = False
    counts: dict[Key | tuple[str, int] | tuple[str, int, int], list[float]] = field(default_factory=dict)
    # per (`position_class`, on the main line): [accepted, predicted] nodes at those places of the ranking
    # (decayed like `counts`)
    calibration: dict[tuple[int, bool], list[float]] = field(default_factory=dict)
    calibration_prior: float = 2.0   # pseudo-tokens of "as predicted": little evidence moves a factor little

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def key(self, tree: DraftTree, node: int, depth: int, rank: int) -> Key:
        """Bucket a node by source, depth, sibling rank, the proposer's local confidence and tree bucket."""
        parent = tree.parents[node]
        parent_score = tree.scores[parent] if parent > 0 else 1.0
        local = tree.scores[node] / parent_score if parent_score > 0 else 0.0
        local = min(local, 1.0) if local > 0 else 0.0      # also NaN -> 0: a bad score must not end the step
        confidence = min(int(local * 4), 3)
        return (tree.sources[node], min(depth, self.max_depth), min(rank, self.max_rank), confidence, tree.bucket)

    def rate(self, key: Key, coarse: list[float] | None = None) -> float:
        """A posterior sample (or the mean when `thompson` is off); `coarse`: `coarse_rates(key[0])`, when the
        caller already has them.

        The fine bucket's own evidence is shrunk toward its (source, depth) bucket's rate, not toward the
        fixed prior: fine buckets are many and most are rarely tried, and a prior of 0.4 for each of them let
        sizing keep dozens of nodes of a source that is almost never accepted (Token Recycling inside
        `rasd` on LongBench QA: 1181 recycled nodes verified, 44 accepted, trees 1.8x larger than needed).
        """
        pa, pb = self.prior
        mean = (coarse if coarse is not None else self.coarse_rates(key[0]))[key[1]]
        a_f, b_f = self.counts.get(key, [pa, pb])
        a = a_f - pa + (pa + pb) * mean
        b = b_f - pb + (pa + pb) * (1.0 - mean)
        if self.thompson:
            return self._rng.betavariate(a, b)
        return a / (a + b)

    def coarse_rates(self, source: str, top: bool = False) -> list[float]:
        """Per depth 0..max_depth, the (source, depth) bucket's posterior mean, shrunk toward the prior mean
        or, when higher, the same source's rate one level shallower (index 0, the root: the prior mean).
        `top`: the rate of a parent's likeliest child alone (rank 0), what a look-ahead's one hypothetical
        child per node is (`GrowRule.pays`). Why apart: the pooled bucket counts every verified sibling, and
        at most one of them can be accepted, so three siblings tried a step held an EAGLE head right 26% of
        the time at depth 1 (Spec-Bench writing) to a pooled 0.12, and its first forward was refused.

        Why: a depth that the sizer has never verified kept the prior's 0.4, so its nodes ranked below what
        was already verified and were never tried. A source right at depths 1-3 (an answer repeated from the
        response history: 0.94 each) was held at 3-node trees and its depth-4+ buckets stayed untried for the
        whole request. Never below the prior: given its parent was accepted, a node is usually *more* likely
        accepted than its parent was (a copy that matched goes on), so a low shallow rate says little about
        the next depth, and guessing low would stop a source from being tried at all.
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
        the (source, depth) rate that rank 0 dominates; a prompt-lookup tree with ten candidate continuations
        per node then counted several expected tokens per level (LongBench docqa: `pld` kept a 35-node tree at
        p̂ ≈ 0.2 a node, depth-2 siblings summing to 2.4 under a parent at 0.61). The likeliest child keeps its
        rate because its bucket is the best measured: scaling every sibling alike cut the request's own-text
        match beside the EAGLE head's top-k in `rasd`, and the batched service stopped speculating (1.01
        accepted a step at 8 concurrent requests). Many cheap siblings still add up where the curve is flat.
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
        do not cancel there. On LongBench docqa (`pld` and `rasd`, 10 rows) nodes ranked 1-7 were accepted
        0.88-1.0 times as often as predicted, those ranked 8-15 0.12 times: trees of 9-32 tokens were predicted
        4-6 accepted tokens and got 0.3-1.6, at 2.4-4x the cost of a 4-token tree.

        Kept apart for nodes on their source's main line (`main_line`) and off it. Why: a place means different
        things in a chain and in a bush. Pooled, the side branches of bushy trees (rejected siblings at places
        4-7) set the factor that the 4th-7th tokens of a copied chain were scaled by, so `pld` and `rasd` cut
        chains that were accepted whole at 3 tokens, step after step (LongBench docqa rows 6-13, interleaved:
        `pld` 34.7 -> 38.8 tokens/s with the split; docs/lab-notes/eagle.md, 2026-12-03)."""
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
        source brings no evidence, so its low rate outlived the text it was learnt on; after two Spec-Bench
        translation prompts (the head right ≈ 10% of the time) `eagle` stayed off through the summarization and
        QA prompts that followed (1.00 accepted a step), where one head node a step was accepted 35-55% of the
        time."""
        pa, pb = self.prior
        for key, a_b in self.counts.items():
            if key[0] == source:
                a_b[0] = pa + (a_b[0] - pa) * keep
                a_b[1] = pb + (a_b[1] - pb) * keep

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
    occurrence first), not by how many occurrences agree. Ranked by score within the source, LongBench docqa
    (10 rows twice, interleaved in one process) ran `pld` 53.5 → 56.7 tokens/s and `rasd` 52.9 → 56.7.
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


class SizerDefaults:
    """What a policy without a cost curve answers: no plain-step estimate, and a batch keeps its own cut."""

    batch_sized = False   # True: a batch may size this row's tree jointly with the others (`sizing.batch`)

    def plain_step_s(self, context_len: int) -> float | None:
        """The measured latency of one plain decoding step at this context, when the policy knows it."""
        return None


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


def rank_nodes(tree: DraftTree, probs: list[float]) -> tuple[list[int], list[int]]:
    """(sampled, ranked): the nodes drawn from q, and the deterministic ones by p̂, best first.

    Nodes sampled from q are never dropped one by one: their estimates depend on the sampled token
    (confidence = q(x)), and keeping x only for some values of x would bias the output distribution. The
    proposer already sized them with `budget()`; only deterministic nodes are ranked and cut. p̂ only falls
    along a path and ties go to the lower index (a parent's), so every prefix of `ranked` is prefix-closed.
    """
    sampled = sorted(tree.q)
    ranked = sorted((i for i in range(1, len(tree)) if i not in tree.q), key=lambda i: (-probs[i], i))
    return sampled, ranked


class CostAwareSizer(SizerDefaults):
    """Choose the tree size that maximises expected tokens per second against the measured cost curve."""

    batch_sized = True   # its acceptance estimates let a batch rank this row's nodes against the others'

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
        # otherwise forbid speculation forever. Observed verify time / the curve's, per power-of-two size
        # class (`size_class`), scales the curve; classes not seen yet take the mean over all observations.
        # Why ratios pooled by class, not one time per exact size: with a flat curve (a GPU) sizes differ
        # by less than their timing noise, and the argmax over 64 separately-noisy sizes locked onto a few
        # lucky ones (H200: `rasd` trees sat at 23 and 30 nodes under a 63-node budget; pooled, they reach
        # 64 on a fifth of the steps, same speed so far); a ratio also carries over to other context
        # lengths, where an absolute time does not.
        self.observed: dict[int, float] = {}
        self.observed_all: float | None = None
        self.latency_drift = 0.98           # per step, an unobserved class's ratio moves this much less off the mean
        self._curve: CostCurve | None = None    # the curve the last `cut` used: `observe` compares with it
        self.learn_latency = True
        self.explore_every = 16             # after this many plain steps, try a small tree once
        self.explore_nodes = 4
        self.max_backoff = 16
        self._plain_steps = 0
        # Exponential backoff: each exploration that gets nothing accepted doubles the wait before the next.
        # Where drafts never help (free writing), a fixed interval costs ~2% (one bigger forward in 16).
        self._backoff = 1
        self._exploring = False
        # The drafter's first forward of a step (`root_pays`): refused steps since the last draft, the interval
        # before it drafts anyway (doubling each time the probe it then verifies is rejected, back to 1 when one
        # is accepted), and the source whose likeliest depth-1 node the next `cut` must verify (the probe: else a
        # low rate would never be measured again), then whose verdict `observe` waits for.
        self._root_refused = 0
        self._root_backoff = 1
        self._probe_source: str | None = None
        self._probing: str | None = None
        # Each refused step keeps this share of what was learnt about the refused source (`forget`): about 45
        # refused steps take a rate learnt at 10% back to where the head is tried again.
        self.refused_keep = 0.95
        # A model drafter alone (`eagle`) may also be sized by measurement (`use_single_node_arm`): per block of
        # steps a two-armed bandit on committed tokens per second (`DraftGate`: its DRAFT arm = this sizer's own
        # tree, PLAIN = the drafter's likeliest depth-1 node alone, every step). `_single`: this step's source.
        self.single_arm: DraftGate | None = None
        self._single: str | None = None
        self.steps = 0   # steps observed: the one-node arm credits a step only to the one just before it

    def latency(self, curve: CostCurve, n_tokens: int) -> float:
        """The measured curve's latency, scaled by what verifying trees of this size class really took."""
        ratio = self.observed.get(size_class(n_tokens), self.observed_all)
        return curve.latency(n_tokens) * (1.0 if ratio is None else ratio)

    def budget(self, context_len: int) -> int:
        """Largest tree worth asking proposers for: bounded by the curve and by `max_nodes`."""
        return min(self.max_nodes, self.curve_for(context_len).max_tokens - 1)

    def plain_step_s(self, context_len: int) -> float:
        """One plain step's measured latency at this context (memoised per bucket by `curve_for`)."""
        return self.curve_for(context_len).latency(1)

    def use_single_node_arm(self, block: int = 8) -> None:
        """Let measured speed choose, block by block, between this sizer's trees and one drafter node a step.

        Why: on a 2-core CPU (a 2-token verification ≈ 1.15x a plain step, a head layer ≈ 7%) one EAGLE-head node
        every step beat this sizer's own trees in five of five interleaved Spec-Bench runs (1.19-1.29x `ar`
        against 1.11-1.23x): its estimates were calibrated, but its second head layers, often cut away, cost
        ≈ 3 ms a step. On a flat GPU curve the trees are nearly free and win. A setting per machine is what a
        user should not have to know; tokens per second measured on the host decide instead.

        Asked only on steps where no free source has candidates (`root_pays` without free nodes): for `eagle`
        every step; for `rasd:single_node=on` the steps where nothing was copied, where it is the head against the
        head and recycling fused (off by default for `rasd`: not faster in its first A/B, docs/lab-notes/eagle.md)."""
        self.single_arm = DraftGate(block=block)

    @property
    def single_step(self) -> str | None:
        """The source whose likeliest depth-1 node alone this step verifies (the one-node arm), else None."""
        return self._single

    def cut(self, tree: DraftTree, context_len: int) -> DraftTree:
        """The prefix-closed subtree of the best size (possibly just the root)."""
        curve = self._curve = self.curve_for(context_len)
        if tree.num_draft_tokens == 0:   # nothing drafted: no probe to verify (nor to hold exploration back)
            self.last_choice, self._probe_source, self._single = (0, 0), None, None
            return tree
        if self._single is not None:   # before p̂: the one-node arm needs no estimate
            return self._cut_single(tree)
        probs = self.estimator.path_probs(tree)
        sampled, ranked = rank_nodes(tree, probs)
        limit = min(len(ranked), max(self.budget(context_len) - len(sampled), 0))
        main = main_line(tree)
        gain = 1.0 + sum(self.estimator.calibrated([probs[i] for i in sampled], mains=[main[i] for i in sampled]))
        base = len(sampled) + 1
        floor = (self.margin if not sampled else gain) / (self.latency(curve, base) + self.overhead_s)
        values = self.estimator.calibrated([probs[i] for i in ranked[:limit]], start=len(sampled),
                                           mains=[main[i] for i in ranked[:limit]])
        best_n, _ = self._best_prefix(values, base, gain, floor, curve)
        self._plain_steps = self._plain_steps + 1 if best_n == 0 else 0
        self._exploring = False
        if self._probe_source is None and self._plain_steps >= self.explore_every * self._backoff:
            # estimates/costs may be stale: look again (not beside a drafter's probe, which looks already)
            best_n, self._plain_steps = min(self.explore_nodes, limit), 0
            self._exploring = best_n > 0
        keep = sampled + ranked[:best_n]
        if self._probe_source is not None:   # a drafter `root_pays` let through: verify its likeliest child
            probe = likeliest_child(tree, ranked, self._probe_source)
            self._probing = None if probe is None else self._probe_source
            if probe is not None and probe not in keep:
                keep.append(probe)
            self._probe_source = None
        self.last_choice = (tree.num_draft_tokens, len(keep))
        return tree.subtree(keep)

    def _cut_single(self, tree: DraftTree) -> DraftTree:
        """The one-node arm's cut: the drafter's own top depth-1 child, by its score (a chain drawn under
        sampling: as drawn)."""
        source, self._single = self._single, None
        kids = [i for i in range(1, len(tree)) if tree.parents[i] == 0 and tree.sources[i] == source]
        child = max(kids, key=lambda i: tree.scores[i], default=None)
        keep = sorted(tree.q) or ([] if child is None else [child])   # drawn nodes, as `rank_nodes` keeps them
        self.last_choice = (tree.num_draft_tokens, len(keep))
        return tree.subtree(keep)

    def grow_pays(self, tree: DraftTree, frontier: list[int], context_len: int, forward_s: float) -> bool:
        """Whether one more draft forward (`forward_s`) to give the `frontier` nodes children can pay.

        Why: a model drafter pays for every layer it grows before `cut` sees the tree. On a 2-core CPU one
        EAGLE-head layer costs ≈ 7% of a target step, and trees grown to depth 6 then cut to one or two nodes
        made `eagle` slower than `ar` (draft 14 ms + verify 56 ms a step, against 42 ms for a plain step).
        The rule itself is `GrowRule.pays`, on this step's estimates and costs.
        """
        if self._single is not None:   # the one-node arm: the root's children only
            return False
        return self.grow_rule(context_len, len(tree) - 1 + len(frontier)).pays(tree, frontier, forward_s)

    def root_pays(self, root_token: int, source: str, context_len: int, forward_s: float,
                  tree: DraftTree | None = None) -> bool:
        """Whether a drafter's first forward this step (the one that gives the root's children) can pay.

        Why: `grow_pays` guards every layer after the first, and the draft gate (`sizing.gate`) guarded the first
        with a bandit built for the EESD self-draft (a quarter of a target step a draft token). An EAGLE head
        costs ≈ 7% of a step, and one head node a step was accepted about half the time on Spec-Bench qa and
        writing where the gate kept it off (1.18x `ar` against 1.07x). This asks the same question as
        `grow_pays` of the root alone, with the source's learnt depth-1 rate. A refused drafter brings no
        evidence, so after `explore_every × backoff` refused steps it drafts anyway and the next `cut` verifies its
        likeliest child (the probe). The backoff doubles (up to `max_backoff`) when the probe is rejected and
        restarts when one is accepted. Why on the verdict: doubling whenever the rule still refused after a probe
        (one rejection lowers the rate, so nearly always) let the interval climb to its bound (256 steps); in one
        Spec-Bench A/B the head then stayed off through ten prompts of five categories (1.00 accepted a step)
        where one head node a step was accepted 25-60% of the time. One node, not four as before: the verdict
        that matters is the likeliest child's, and four cost a 5-token verification to learn it.

        `tree`: the nodes the step has already from sources that cost nothing (`rasd`'s copying candidates), the
        drafter's children would stand beside them. Why: in document QA the request's own text offers the
        answer's next tokens at p̂ ≈ 0.9, and asked of a bare root the head's forward looked worth it at every
        step, while the cut then dropped its nodes, so no evidence ever said otherwise (`rasd` drafted 3.5 ms
        a step, `pld` was faster).
        """
        self._single = None
        nothing_free = tree is None or tree.num_draft_tokens == 0
        if (self.single_arm is not None and nothing_free
                and not self.single_arm.choose(context_len, step=self.steps)):
            self._single = source   # this block measures one node a step: draft, and `cut` keeps one
            return True
        root = tree if tree is not None else DraftTree.root_only(root_token)
        if self.grow_rule(context_len, len(root)).pays(root, [0], forward_s, source=source):
            self._root_refused, self._root_backoff = 0, 1
            return True
        self._root_refused += 1
        self.estimator.forget(source, self.refused_keep)
        if self._root_refused < self.explore_every * self._root_backoff:
            return False
        self._root_refused, self._probe_source = 0, source
        return True

    def grow_rule(self, context_len: int, nodes: int | None = None) -> GrowRule:
        """`grow_pays`'s inputs for one step at this context: what a draft worker in another process needs to
        stop its tree where this sizer would (the estimator by reference; Ray pickles a copy). `nodes`: the
        most draft nodes the rule will be asked about (default: the budget), so no step time beyond is computed."""
        curve, budget = self.curve_for(context_len), self.budget(context_len)
        limit = budget if nodes is None else min(budget, nodes)
        step_s = [self.latency(curve, n) + self.overhead_s for n in range(1, limit + 2)]
        return GrowRule(self.estimator, step_s, self.margin)

    def _best_prefix(self, ranked: list[float], base: int, gain: float, floor: float, curve: CostCurve
                     ) -> tuple[int, float]:
        """`best_prefix` against this sizer's corrected curve plus its per-step overhead."""
        return best_prefix(ranked, base, gain, floor, lambda n: self.latency(curve, n) + self.overhead_s)

    def observe(self, tree: DraftTree, accepted: list[int], overhead_s: float,
                verify_s: float | None = None) -> None:
        """Update acceptance posteriors, the per-step overhead and the observed latency of this size."""
        self.steps += 1
        self.estimator.update(tree, accepted)
        if self._probing is not None:   # the probe's verdict sets the interval to the next one
            hit = any(tree.parents[i] == 0 and tree.sources[i] == self._probing for i in accepted)
            self._root_backoff = 1 if hit else min(2 * self._root_backoff, self.max_backoff)
            self._probing = None
        if self._exploring:
            self._backoff = min(2 * self._backoff, self.max_backoff) if not accepted else 1
            self._exploring = False
        self.overhead_s = overhead_s if self.overhead_s == 0 else 0.9 * self.overhead_s + 0.1 * overhead_s
        if verify_s is not None and self.learn_latency and self._curve is not None:
            self._learn_latency(size_class(len(tree)), verify_s / self._curve.latency(len(tree)))

    def _learn_latency(self, key: int, ratio: float) -> None:
        """Fold one observed/curve latency ratio into its size class and into the mean over all steps.

        Classes that were not observed drift back toward that mean (`latency_drift` per step). Why: a class is
        observed only when a tree of its size is verified, and one slow verification (a first use of a shape,
        a busy second) made trees of that size look too dear to verify again, so the class was never measured
        again: `pld` once drafted 40 nodes in 1,555 Spec-Bench steps and ran at 0.99x `ar` for a whole run,
        where it runs 1.15x. The mean is refreshed every step, plain ones included, so it is the right anchor."""
        anchor = ratio if self.observed_all is None else self.observed_all
        for other, value in self.observed.items():
            if other != key:
                self.observed[other] = anchor + (value - anchor) * self.latency_drift
        old = self.observed.get(key)
        self.observed[key] = ratio if old is None else 0.8 * old + 0.2 * ratio
        self.observed_all = ratio if self.observed_all is None else 0.9 * self.observed_all + 0.1 * ratio


def likeliest_child(tree: DraftTree, ranked: list[int], source: str) -> int | None:
    """The first of `ranked` that is a child of the root from `source` (None when the source drafted none)."""
    return next((i for i in ranked if tree.parents[i] == 0 and tree.sources[i] == source), None)


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


def size_class(n_tokens: int) -> int:
    """Tree sizes sharing one latency correction: 1, 2-3, 4-7, ..., 32-63, 64-127 (the curve's own grid)."""
    return max(1, int(n_tokens)).bit_length()


class Sizer(Protocol):
    """The interface every tree-size policy implements (see the module docstring)."""

    batch_sized: bool

    def budget(self, context_len: int) -> int:
        """Largest tree (draft nodes) worth asking proposers for."""
        ...

    def plain_step_s(self, context_len: int) -> float | None:
        """Latency of one plain decoding step at this context, if the policy measured it."""
        ...

    def cut(self, tree: DraftTree, context_len: int) -> DraftTree:
        """The prefix-closed subtree to verify."""
        ...

    def observe(self, tree: DraftTree, accepted: list[int], overhead_s: float,
                verify_s: float | None = None) -> None:
        """Learn from the verdict on `tree` (the tree `cut` returned)."""


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
    token of a tree (docs/lab-notes/decoding-speed.md). `max_depth` caps the growth when proposers stay short.
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


class ThresholdSizer(SizerDefaults):
    """Keep the nodes whose path confidence is at least `threshold` (AdaEAGLE/EAGLE-2-style cut).

    0.3 by default: a node is worth verifying when it is accepted in roughly one step in three, about the
    cost of one more tree token relative to a plain step on a CPU (docs/lab-notes/decoding-speed.md).
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


class LDLPSizer(SizerDefaults):
    """AdaEAGLE's LDLP + DDD as a cut on any proposed tree (the decision logic lives in `LDLPController`).

    A sampled node is decided by its ancestors' scores only (DDD's stop after a token never looks at the
    next one), so sampled chains stay exact.
    """

    def __init__(self, controller: Any, max_nodes: int = 64):
        self.controller, self.max_nodes = controller, max_nodes

    def budget(self, context_len: int) -> int:
        return self.max_nodes

    def cut(self, tree: DraftTree, context_len: int) -> DraftTree:
        return self.controller.cut(tree).top_nodes(self.max_nodes)

    def observe(self, tree: DraftTree, accepted: list[int], overhead_s: float,
                verify_s: float | None = None) -> None:
        """Take the hidden state of the last accepted node for the next prediction."""
        self.controller.observe(tree, accepted)


SIZINGS = ("cost", "fixed", "heuristic", "threshold", "thompson", "ldlp")


def make_sizer(name: str, max_nodes: int = 64, curve_for: Callable[[int], CostCurve] | None = None,
               **options: Any) -> Sizer:
    """The sizing policy called `name` (see SIZINGS); `cost` needs the target's cost-curve provider."""
    if name == "cost":
        if curve_for is None:
            raise ValueError("sizing 'cost' needs the target's cost curve (curve_for)")
        return CostAwareSizer(curve_for, max_nodes=max_nodes, **options)
    if name == "fixed":
        return FixedSizer(max_nodes)
    if name == "heuristic":
        return HeuristicSizer(max_nodes, **options)
    if name == "threshold":
        return ThresholdSizer(max_nodes, **options)
    if name == "thompson":
        return ThompsonSizer(max_nodes, **options)
    if name == "ldlp":
        if "controller" in options:
            return LDLPSizer(options["controller"], max_nodes)
        if options.get("target") is None:
            raise ValueError("sizing 'ldlp' needs the target model and a trained LDLP (`rasd train ldlp`)")
        from rasd.decoding.sizing.ldlp import load_controller

        return LDLPSizer(load_controller(options["target"], options.get("path"), options.get("model_name", "default"),
                                         options.get("drafter", "eesd")), max_nodes)
    raise ValueError(f"unknown sizing {name!r}; choose one of {', '.join(SIZINGS)}")
