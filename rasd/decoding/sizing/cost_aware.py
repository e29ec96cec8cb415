"""The default tree-size policy: `CostAwareSizer`, expected committed tokens per second against the measured curve.

It maximises, over the n nodes with the largest estimated path-acceptance probability p̂
(`acceptance.AcceptanceEstimator`, calibrated per place in the ranking),

    value(n) = (1 + Σ_{i ≤ n} p̂_i) / (latency(n + 1) + overhead),

the bonus token being the 1, with latency from the target's measured cost curve (`sizing.cost`) corrected
online by what verification really took. When nothing pays for its cost, n = 0 and the step is plain
decoding: speculation never makes decoding markedly slower than `ar`. Model drafters ask it, before each
draft forward, whether that forward can pay (`root_pays`, `grow_pays`, the rule in `sizing.grow`).

Measurements behind each rule: docs/lab-notes/sizing.md, "cost_aware".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rasd.decoding.sizing.acceptance import AcceptanceEstimator, main_line
from rasd.decoding.sizing.cost import CostCurve
from rasd.decoding.sizing.gate import DraftGate
from rasd.decoding.sizing.grow import GrowRule, best_prefix
from rasd.decoding.sizing.protocol import SizerDefaults
from rasd.decoding.step.tree import DraftTree


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
        self.correction = LatencyCorrection()   # what verifying really took, against the cached curve
        self._curve: CostCurve | None = None    # the curve the last `cut` used: `observe` compares with it
        self.explore_every = 16             # after this many plain steps, try a small tree once
        self.explore_nodes = 4
        self.max_backoff = 16
        self._plain_steps = 0
        # Exponential backoff: each exploration that gets nothing accepted doubles the wait before the next.
        # Where drafts never help (free writing), a fixed interval pays one bigger forward every 16 steps.
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
        return curve.latency(n_tokens) * self.correction.ratio(n_tokens)

    def budget(self, context_len: int) -> int:
        """Largest tree worth asking proposers for: bounded by the curve and by `max_nodes`."""
        return min(self.max_nodes, self.curve_for(context_len).max_tokens - 1)

    def plain_step_s(self, context_len: int) -> float:
        """One plain step's measured latency at this context (memoised per bucket by `curve_for`)."""
        return self.curve_for(context_len).latency(1)

    def use_single_node_arm(self, block: int = 8) -> None:
        """Let measured speed choose, block by block, between this sizer's trees and one drafter node a step.

        Why: on a CPU with a steep curve one EAGLE-head node every step beat this sizer's own trees: its
        estimates were calibrated, but its second head layers, often cut away, cost time every step. On a flat
        GPU curve the trees are nearly free and win. A setting per machine is what a user should not have to
        know; tokens per second measured on the host decide instead (docs/lab-notes/sizing.md).

        Asked only on steps where no free source has candidates (`root_pays` without free nodes), which for
        `eagle`, the one method that arms it, is every step."""
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

        Why: a model drafter pays for every layer it grows before `cut` sees the tree, and trees grown deep
        then cut to one or two nodes made `eagle` slower than `ar` (docs/lab-notes/sizing.md). The rule
        itself is `GrowRule.pays`, on this step's estimates and costs.
        """
        if self._single is not None:   # the one-node arm: the root's children only
            return False
        return self.grow_rule(context_len, len(tree) - 1 + len(frontier)).pays(tree, frontier, forward_s)

    def root_pays(self, root_token: int, source: str, context_len: int, forward_s: float,
                  tree: DraftTree | None = None) -> bool:
        """Whether a drafter's first forward this step (the one that gives the root's children) can pay.

        Why: `grow_pays` guards every layer after the first, and the draft gate (`sizing.gate`) guarded the first
        with a bandit built for the EESD self-draft, whose draft tokens are dear. An EAGLE head is cheap, and
        one head node a step was often accepted where the gate kept it off. This asks the same question as
        `grow_pays` of the root alone, with the source's learnt depth-1 rate. A refused drafter brings no
        evidence, so after `explore_every × backoff` refused steps it drafts anyway and the next `cut` verifies its
        likeliest child (the probe). The backoff doubles (up to `max_backoff`) when the probe is rejected and
        restarts when one is accepted. Why on the verdict: doubling whenever the rule still refused after a probe
        (one rejection lowers the rate, so nearly always) let the interval climb to its bound, and the head then
        stayed off through whole prompts where it was often right. One node, not four as before: the verdict
        that matters is the likeliest child's, and four cost a 5-token verification to learn it.

        `tree`: the nodes the step has already from sources that cost nothing (`rasd`'s copying candidates), the
        drafter's children would stand beside them. Why: in document QA the request's own text often offers
        the answer's next tokens with high p̂, and asked of a bare root the head's forward looked worth it at
        every step, while the cut then dropped its nodes, so no evidence ever said otherwise (`pld` was faster
        than `rasd`; docs/lab-notes/sizing.md).
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
        if verify_s is not None and self.correction.learn and self._curve is not None:
            self.correction.fold(len(tree), verify_s / self._curve.latency(len(tree)))

    def state(self) -> dict[str, Any]:
        """What carries to a later request: the acceptance posteriors, the latency corrections per size class and
        over all, and the per-step overhead (JSON-able). Exploration and probe intervals are per request."""
        return {**self.estimator.state(), **self.correction.state(), "overhead_s": self.overhead_s}

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from a `state()`: a fresh sizer then skips what the last request already learnt not to try."""
        self.estimator.load_state(state)
        self.correction.load_state(state)
        self.overhead_s = state["overhead_s"]


def likeliest_child(tree: DraftTree, ranked: list[int], source: str) -> int | None:
    """The first of `ranked` that is a child of the root from `source` (None when the source drafted none)."""
    return next((i for i in ranked if tree.parents[i] == 0 and tree.sources[i] == source), None)



@dataclass
class LatencyCorrection:
    """Online correction of the cached cost curve: observed verify time over the curve's, per size class.

    A curve measured while the machine was busy would otherwise forbid speculation forever. The ratio of a
    power-of-two size class (`size_class`) scales the curve; classes not seen yet take the mean over all
    observations. Why ratios pooled by class, not one time per exact size: with a flat curve (a GPU) sizes
    differ by less than their timing noise, and the argmax over 64 separately-noisy sizes locked onto a few
    lucky ones (docs/lab-notes/sizing.md); a ratio also carries over to other context lengths, where an
    absolute time does not."""

    observed: dict[int, float] = field(default_factory=dict)   # size class -> observed / curve latency
    observed_all: float | None = None   # the mean over all observations (None: none yet)
    drift: float = 0.98                 # per step, an unobserved class's ratio moves this much less off the mean
    learn: bool = True                  # False: keep the curve as measured (tests of a given curve)

    def ratio(self, n_tokens: int) -> float:
        """What verifying n tree tokens really takes over what the curve says (1 before any observation)."""
        ratio = self.observed.get(size_class(n_tokens), self.observed_all)
        return 1.0 if ratio is None else ratio

    def fold(self, n_tokens: int, ratio: float) -> None:
        """Fold one observed/curve latency ratio into its size class and into the mean over all steps.

        Classes that were not observed drift back toward that mean (`drift` per step). Why: a class is observed
        only when a tree of its size is verified, and one slow verification (a first use of a shape, a busy
        second) made trees of that size look too dear to verify again, so the class was never measured again
        and `pld` ran at `ar`'s speed for a whole run (docs/lab-notes/sizing.md). The mean is refreshed every
        step, plain ones included, so it is the right anchor."""
        key = size_class(n_tokens)
        anchor = ratio if self.observed_all is None else self.observed_all
        for other, value in self.observed.items():
            if other != key:
                self.observed[other] = anchor + (value - anchor) * self.drift
        old = self.observed.get(key)
        self.observed[key] = ratio if old is None else 0.8 * old + 0.2 * ratio
        self.observed_all = ratio if self.observed_all is None else 0.9 * self.observed_all + 0.1 * ratio

    def state(self) -> dict[str, Any]:
        """The ratios as JSON-able data (classes as [class, ratio] pairs: JSON keys would turn into text)."""
        return {"observed": [[k, v] for k, v in self.observed.items()], "observed_all": self.observed_all}

    def load_state(self, state: dict[str, Any]) -> None:
        self.observed = {int(k): float(v) for k, v in state["observed"]}
        self.observed_all = state["observed_all"]


def size_class(n_tokens: int) -> int:
    """Tree sizes sharing one latency correction: 1, 2-3, 4-7, ..., 32-63, 64-127 (the curve's own grid)."""
    return max(1, int(n_tokens)).bit_length()

