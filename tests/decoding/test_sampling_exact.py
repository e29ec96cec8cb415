"""Exact speculative sampling: the emitted tokens have exactly the target's sampling distribution.

Two levels:
1. Pure logic: `accept_sampling` on hand-built trees against a fixed target distribution p, ~20k seeded
   trials, χ² goodness of fit at α = 1e-3. Negative controls run the same harness on deliberately wrong
   rules and must be rejected, so the test demonstrably has power.
2. Engine: a tiny model with a small vocabulary and peaked (non-flat) distributions; the first three new
   tokens sampled many times (seeds) with `ar`, `pld` and `draft` (the target as its own draft, and an
   unrelated draft) are compared with the exact joint distribution computed from the model with HF's own
   logits warpers, and with `ar`'s samples (χ² homogeneity).

Seeds are fixed, so every run draws the same samples: a pass is reproducible, never a coin flip.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

import rasd.decoding.step.verify as verify_mod
from rasd.decoding.model.kernels.forms import onednn_bf16
from rasd.decoding.proposers import ProposerBase, make_proposer
from rasd.decoding.runtime.engine import SpeculativeDecoder
from rasd.decoding.sizing.sizers import FixedSizer
from rasd.decoding.step.sampling import SamplingParams, target_probs
from rasd.decoding.step.tree import DraftTree
from rasd.decoding.step.verify import Verdict, accept_sampling
from tests.helpers import pooled_chisquare, pooled_homogeneity, random_prompt, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

ALPHA = 1e-3
T1 = SamplingParams(temperature=1.0)

# ------------------------------------------------------------------------------------------------------
# 1. pure logic
# ------------------------------------------------------------------------------------------------------

P = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.06, 0.04])       # the target distribution at the root
P_CHILD = torch.tensor([0.05, 0.1, 0.5, 0.05, 0.2, 0.1])   # the target distribution after token 0
Q = torch.tensor([0.05, 0.05, 0.1, 0.4, 0.3, 0.1])          # a draft distribution unlike P
V = len(P)

TreeMaker = Callable[[torch.Generator], DraftTree]
Acceptor = Callable[[DraftTree, torch.Tensor, SamplingParams, torch.Generator], Verdict]


def det_children(*tokens: int) -> TreeMaker:
    def make(gen: torch.Generator) -> DraftTree:
        tree = DraftTree.root_only(0)
        for tok in tokens:
            tree.add(0, tok, "det")
        return tree
    return make


def q_child_then(*tokens: int) -> TreeMaker:
    """A first child sampled from Q (q attached), then deterministic siblings (merged if equal)."""
    def make(gen: torch.Generator) -> DraftTree:
        tree = DraftTree.root_only(0)
        x = int(torch.multinomial(Q, 1, generator=gen))
        tree.q[tree.add(0, x, "draft")] = Q
        for tok in tokens:
            tree.add(0, tok, "det")
        return tree
    return make


def two_levels(gen: torch.Generator) -> DraftTree:
    """root ─ 0 ─ {2, 4}      and      root ─ 1"""
    tree = DraftTree.root_only(0)
    a = tree.add(0, 0, "det")
    tree.add(0, 1, "det")
    tree.add(a, 2, "det")
    tree.add(a, 4, "det")
    return tree


def logits_for(tree: DraftTree, root_p: torch.Tensor = P) -> torch.Tensor:
    """log p at every node: P at the root, P_CHILD below token 0 (only two_levels looks there)."""
    rows = [P_CHILD if (i > 0 and tree.tokens[i] == 0 and tree.parents[i] == 0) else root_p
            for i in range(len(tree))]
    return torch.stack(rows).log()


def emitted(make: TreeMaker, trials: int, seed: int, accept: Acceptor = accept_sampling,
            params: SamplingParams = T1, root_p: torch.Tensor = P) -> tuple[np.ndarray, np.ndarray, int]:
    """Counts of the first emitted token, of the second given the first was 0, and of draft acceptances."""
    gen = torch.Generator().manual_seed(seed)
    first, second = np.zeros(V), np.zeros(V)
    accepted = 0
    for _ in range(trials):
        tree = make(gen)
        verdict = accept(tree, logits_for(tree, root_p), params, gen)
        tokens = verdict.new_tokens(tree)
        first[tokens[0]] += 1
        accepted += len(verdict.accepted)
        if tokens[0] == 0 and len(tokens) > 1:
            second[tokens[1]] += 1
    return first, second, accepted


@pytest.mark.parametrize(("label", "make"), [
    ("two likely deterministic children", det_children(0, 1)),
    ("three unlikely-first deterministic children", det_children(3, 5, 1)),
    ("one child sampled from a known q", q_child_then()),
    ("q child then a deterministic sibling", q_child_then(0)),
])
def test_first_token_distribution_is_p(label: str, make: TreeMaker) -> None:
    first, _, accepted = emitted(make, 20_000, seed=1)
    assert 0.05 * 20_000 < accepted < 0.95 * 20_000, "both acceptance and rejection must be exercised"
    pvalue = pooled_chisquare(first, P.numpy())
    assert pvalue > ALPHA, f"{label}: first-token distribution {first / first.sum()} vs p {P.tolist()}"


def test_second_token_after_accepted_node_is_its_own_p() -> None:
    """Below an accepted node, the next emitted token follows that node's target distribution."""
    first, second, _ = emitted(two_levels, 20_000, seed=2)
    assert pooled_chisquare(first, P.numpy()) > ALPHA
    assert second.sum() > 5_000
    assert pooled_chisquare(second, P_CHILD.numpy()) > ALPHA


def test_warped_target_distribution_with_candidate_outside_top_k() -> None:
    """top_k=3: a candidate with p = 0 is never accepted and the emitted distribution is the warped p."""
    params = SamplingParams(temperature=1.0, top_k=3)
    first, _, _ = emitted(det_children(4, 1, 0), 20_000, seed=3, params=params)
    warped = torch.zeros(V)
    warped[:3] = P[:3] / P[:3].sum()
    assert first[3:].sum() == 0
    assert pooled_chisquare(first[:3], warped[:3].numpy()) > ALPHA


def test_one_hot_target_always_emits_its_token() -> None:
    one_hot = torch.tensor([1e-30, 1.0, 1e-30, 1e-30, 1e-30, 1e-30])
    first, _, _ = emitted(det_children(0, 1), 500, seed=4, root_p=one_hot)
    assert first[1] == 500
    first, _, _ = emitted(q_child_then(), 500, seed=4, root_p=one_hot)
    assert first[1] == 500


# negative controls: the same harness must reject wrong rules --------------------------------------------

def accept_first_child_always(tree: DraftTree, logits: torch.Tensor, params: SamplingParams,
                              gen: torch.Generator) -> Verdict:
    children = tree.children(0)
    probs = target_probs(logits, params)
    if children:
        return Verdict(accepted=[children[0]], bonus=int(torch.multinomial(probs[children[0]], 1, generator=gen)))
    return Verdict(accepted=[], bonus=int(torch.multinomial(probs[0], 1, generator=gen)))


def forget_residual(p: torch.Tensor, x: int, q: torch.Tensor | None, gen: torch.Generator
                    ) -> tuple[torch.Tensor, bool]:
    """Wrong `_try_candidate`: right acceptance test, but rejection leaves p unchanged."""
    u = float(torch.rand((), generator=gen))
    ratio = float(p[x]) if q is None else min(1.0, float(p[x]) / float(q[x]))
    return p, u < ratio


@pytest.mark.parametrize(("label", "make", "wrong"), [
    ("accepting the first child always", det_children(3, 5), "first"),
    ("no renormalisation after a rejected deterministic candidate", det_children(0, 1), "residual"),
    ("resampling from p instead of the residual max(p - q, 0)", q_child_then(), "residual"),
])
def test_negative_controls_are_rejected(label: str, make: TreeMaker, wrong: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    accept: Acceptor = accept_sampling
    if wrong == "first":
        accept = accept_first_child_always
    else:
        monkeypatch.setattr(verify_mod, "_try_candidate", forget_residual)
    first, _, _ = emitted(make, 5_000, seed=5, accept=accept)
    assert pooled_chisquare(first, P.numpy()) < ALPHA, f"the χ² harness failed to reject {label}"


def test_graft_refuses_to_merge_a_sampled_node_into_a_sibling() -> None:
    """Merging a node sampled from q into an existing same-token sibling would drop q, and the sampled
    candidate would in effect be drawn from q conditioned on differing from that sibling: biased (this was
    a bug; graft now refuses)."""
    tree = DraftTree.root_only(0)
    tree.add(0, 3, "context")
    draft = DraftTree.root_only(0)
    draft.q[draft.add(0, 3, "draft")] = Q
    with pytest.raises(ValueError):
        tree.graft(draft)


def sampled_then_grafted_deterministic(gen: torch.Generator) -> DraftTree:
    """The exact fusion order: the sampled draft first, deterministic (retrieval) nodes grafted into it;
    a deterministic node with the sampled token merges into the sampled node, which keeps its q."""
    draft = DraftTree.root_only(0)
    x = int(torch.multinomial(Q, 1, generator=gen))
    draft.q[draft.add(0, x, "draft")] = Q
    retrieved = DraftTree.root_only(0)
    retrieved.add(0, 3, "context")
    retrieved.add(0, 0, "context")
    out = draft.graft(retrieved)
    assert 1 in out.q and out.children(0)[0] == 1
    return out


def test_graft_of_deterministic_nodes_into_sampled_draft_stays_exact() -> None:
    first, _, accepted = emitted(sampled_then_grafted_deterministic, 20_000, seed=6)
    assert accepted > 2_000
    assert pooled_chisquare(first, P.numpy()) > ALPHA, f"{first / first.sum()} vs {P.tolist()}"


def test_sampled_sibling_after_deterministic_one_is_exact_with_its_true_q() -> None:
    """A sampled candidate after a deterministic sibling is exact when its q is the distribution it was
    really drawn from (here q restricted to tokens other than the sibling's, so no merge can happen)."""
    def make(gen: torch.Generator) -> DraftTree:
        tree = DraftTree.root_only(0)
        tree.add(0, 3, "context")
        q = Q.clone()
        q[3] = 0
        q /= q.sum()
        x = int(torch.multinomial(q, 1, generator=gen))
        tree.q[tree.add(0, x, "draft")] = q
        return tree
    first, _, _ = emitted(make, 20_000, seed=7)
    assert pooled_chisquare(first, P.numpy()) > ALPHA


# ------------------------------------------------------------------------------------------------------
# warping: ours == HF's logits processors
# ------------------------------------------------------------------------------------------------------

def hf_warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """HF generate's sampling distribution: temperature, then top-k, then top-p (logits [B, vocab])."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = logits.float()
    dummy = torch.zeros(scores.shape[0], 1, dtype=torch.long)
    scores = TemperatureLogitsWarper(params.temperature)(dummy, scores)
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(dummy, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(dummy, scores)
    return scores.softmax(-1)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0), SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=0.8, top_k=6, top_p=0.9),
    SamplingParams(temperature=1.0, top_p=0.01),
])
def test_target_probs_matches_hf_warpers(params: SamplingParams) -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0)) * 3
    torch.testing.assert_close(target_probs(logits, params), hf_warp(logits, params), atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------------------------------
# 2. engine
# ------------------------------------------------------------------------------------------------------

SVOCAB = 16
TARGET = {"seed": 5, "vocab": SVOCAB, "init": 0.3}     # peaked, not flat: ~5 effective tokens per position
OTHER = {"seed": 6, "vocab": SVOCAB, "init": 0.3}
PROMPT = random_prompt(24, seed=7, vocab=SVOCAB)       # every token occurs: pld proposes multi-child trees
WARPED = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)


def exact_joint(model: torch.nn.Module, prompt: list[int], params: SamplingParams) -> np.ndarray:
    """P(t1, t2, t3) [V, V, V] of plain sampling, computed with HF's warpers over all prefixes."""
    v = SVOCAB
    with torch.inference_mode():
        p1 = hf_warp(model(torch.tensor([prompt])).logits[:, -1], params)[0]                     # [V]
        ids2 = torch.tensor([prompt + [a] for a in range(v)])
        p2 = hf_warp(model(ids2).logits[:, -1], params)                                          # [V, V]
        ids3 = torch.tensor([prompt + [a, b] for a in range(v) for b in range(v)])
        p3 = hf_warp(model(ids3).logits[:, -1], params).reshape(v, v, v)                         # [V, V, V]
    joint = p1[:, None, None] * p2[:, :, None] * p3
    return joint.double().numpy()


class Recording(ProposerBase):
    """Wraps a proposer and records what it proposed (to show each test exercises what it claims)."""

    def __init__(self, inner: ProposerBase):
        self.inner, self.name = inner, inner.name
        self.model = inner.model
        self.max_root_children = 0
        self.nodes_with_q = 0
        self.lengths: set[int] = set()   # sampled chain lengths seen

    def start(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        self.inner.start(prompt_ids, sampling)

    def propose(self, context: list[int], max_nodes: int) -> DraftTree:
        tree = self.inner.propose(context, max_nodes)
        self.max_root_children = max(self.max_root_children, len(tree.children(0)))
        self.nodes_with_q += len(tree.q)
        self.lengths.add(len(tree.q))
        return tree

    def observe(self, *args: Any) -> None:
        self.inner.observe(*args)


def stop_after_unlikely_tokens(tree: DraftTree, frontier: list[int], context_len: int, forward_s: float) -> bool:
    """A chain-length rule that reads the drawn tokens (like the cost sizer's `grow_pays`): go on after a
    token q found likely, stop after an unlikely one."""
    node = frontier[-1]
    return float(tree.q[node][tree.tokens[node]]) > 0.25


def make_sampler(method: str) -> tuple[SpeculativeDecoder, Recording]:
    target = tiny_llama(**TARGET)
    if method == "ar":
        proposer = make_proposer("ar")
    elif method == "pld":
        proposer = make_proposer("pld")
    elif method == "draft-self":
        proposer = make_proposer("draft", target, max_depth=2, min_prob=0.0)
    elif method == "draft-other":
        proposer = make_proposer("draft", tiny_llama(**OTHER), max_depth=2, min_prob=0.0)
    elif method == "draft-other-stops":
        proposer = make_proposer("draft", tiny_llama(**OTHER), max_depth=3, min_prob=0.0)
        proposer.grow_pays = stop_after_unlikely_tokens
    else:
        raise ValueError(method)
    recording = Recording(proposer)
    return SpeculativeDecoder(target, recording, sizer=FixedSizer(16)), recording


def sample_triples(method: str, params: SamplingParams, n: int, seed_offset: int
                   ) -> tuple[np.ndarray, Recording, int]:
    """Counts [V, V, V] of the first three new tokens over n seeded generations, and accepted drafts.

    Seeds are even: the draft proposer seeds its own generator with seed + 1, which must not coincide
    with another run's sampling seed (that would correlate the runs).
    """
    decoder, recording = make_sampler(method)
    counts = np.zeros((SVOCAB,) * 3)
    accepted = 0
    for i in range(n):
        out = decoder.generate(PROMPT, 3, sampling=replace(params, seed=seed_offset + 2 * i))
        a, b, c = out.token_ids
        counts[a, b, c] += 1
        accepted += out.stats.num_accepted_tokens
    return counts, recording, accepted


def check_against_exact(counts: np.ndarray, joint: np.ndarray, label: str) -> None:
    n = counts.sum()
    assert counts[joint == 0].sum() == 0, f"{label}: sampled a token with probability 0"
    p12 = pooled_chisquare(counts.sum(2), joint.sum(2))
    p123 = pooled_chisquare(counts, joint)
    p3 = pooled_chisquare(counts.sum((0, 1)), joint.sum((0, 1)))
    print(f"{label}: n={int(n)} p-values (t1,t2) {p12:.3g}, (t1,t2,t3) {p123:.3g}, t3 {p3:.3g}")
    assert min(p12, p123, p3) > ALPHA, f"{label}: distribution differs from plain sampling"


def test_engine_draft_sampling_with_warping_is_exact() -> None:
    """The unrelated draft under temperature/top-k/top-p: q and p both have zeros, residuals everywhere."""
    joint = exact_joint(tiny_llama(**TARGET), PROMPT, WARPED)
    counts, recording, accepted = sample_triples("draft-other", WARPED, 1000, seed_offset=0)
    assert recording.nodes_with_q > 0
    assert 100 < accepted < 1900, f"acceptances {accepted}: both outcomes must be exercised"
    check_against_exact(counts, joint, "draft-other warped")


def test_a_chain_that_stops_by_its_own_drawn_tokens_samples_exactly() -> None:
    """A draft chain whose length depends on the tokens it drew (the cost sizer's `grow_pays` under sampling)
    still gives the target's exact joint distribution: the stop rule never looks at the target."""
    joint = exact_joint(tiny_llama(**TARGET), PROMPT, T1)
    counts, recording, accepted = sample_triples("draft-other-stops", T1, 1500, seed_offset=3_000_000)
    assert recording.lengths >= {1, 3}, f"chains of one and of three nodes must both occur: {recording.lengths}"
    assert accepted > 0.05 * 1500, f"too few acceptances ({accepted}) to test anything"
    check_against_exact(counts, joint, "draft-other, chains stopped by their own tokens")


@pytest.mark.slow
def test_engine_sampling_matches_plain_sampling() -> None:
    """ar, pld, draft (self and unrelated) at temperature 1 vs the exact joint and vs ar's samples."""
    joint = exact_joint(tiny_llama(**TARGET), PROMPT, T1)
    ar_counts, _, _ = sample_triples("ar", T1, 1000, seed_offset=0)
    check_against_exact(ar_counts, joint, "ar")
    for k, (method, n) in enumerate([("pld", 1500), ("draft-self", 1200), ("draft-other", 1500)]):
        counts, recording, accepted = sample_triples(method, T1, n, seed_offset=(k + 1) * 1_000_000)
        if method == "pld":
            assert recording.max_root_children >= 2, "pld should propose sibling candidates here"
        else:
            assert recording.nodes_with_q > 0
        assert accepted > 0.05 * n, f"{method}: too few acceptances ({accepted}) to test anything"
        check_against_exact(counts, joint, method)
        p_hom = pooled_homogeneity(ar_counts.sum(2), counts.sum(2))
        print(f"{method} vs ar (t1,t2): homogeneity p = {p_hom:.3g}")
        assert p_hom > ALPHA, f"{method}: (t1, t2) distribution differs from ar's"


def engine_joint(model: torch.nn.Module, prompt: list[int], params: SamplingParams) -> np.ndarray:
    """P(t1, t2, t3) [V, V, V] of plain sampling as our engine computes it (prefill, then one token per step).

    Why not HF's forward (`exact_joint`): in bf16 HF's attention rounds otherwise than ours, and a token at the
    edge of top-k / top-p can be in one cut and not the other; the claim is exactness against plain decoding in the
    same dtype, which is this."""
    from rasd.decoding.model import fast_forward
    from rasd.decoding.model.kernels import fast_kernels, install
    from rasd.decoding.step.cache import TreeCache
    from rasd.decoding.step.verify import tree_forward

    install(model)
    v = SVOCAB

    def dist(after: list[int]) -> torch.Tensor:
        cache = TreeCache.for_model(model)
        logits = fast_forward.prefill(model, cache, torch.tensor([prompt]))
        for token in after:
            logits = tree_forward(model, cache, DraftTree.root_only(token))[0]
        return hf_warp(logits[None].float(), params)[0]

    with torch.inference_mode(), fast_kernels(True):
        p1 = dist([])
        p2 = torch.stack([dist([a]) for a in range(v)])
        p3 = torch.stack([dist([a, b]) for a in range(v) for b in range(v)]).reshape(v, v, v)
    return (p1[:, None, None] * p2[:, :, None] * p3).double().numpy()


@pytest.mark.skipif(not onednn_bf16(),
                    reason="this CPU has no oneDNN bf16 kernels (bf16 products unchecked there)")
def test_draft_sampling_with_warping_is_exact_in_bf16() -> None:
    """The warped unrelated-draft test with target and draft in bf16 (exact tree attention, row-exact products):
    sampling is exact against the bf16 target's own plain sampling (`engine_joint`)."""
    import copy

    with torch.inference_mode(False):
        target = copy.deepcopy(tiny_llama(**TARGET)).to(torch.bfloat16)
        draft = copy.deepcopy(tiny_llama(**OTHER)).to(torch.bfloat16)
    joint = engine_joint(target, PROMPT, WARPED)
    recording = Recording(make_proposer("draft", draft, max_depth=2, min_prob=0.0))
    decoder = SpeculativeDecoder(target, recording, sizer=FixedSizer(16))
    counts, accepted = np.zeros((SVOCAB,) * 3), 0
    for i in range(1000):
        out = decoder.generate(PROMPT, 3, sampling=replace(WARPED, seed=5_000_000 + 2 * i))
        a, b, c = out.token_ids
        counts[a, b, c] += 1
        accepted += out.stats.num_accepted_tokens
    assert recording.nodes_with_q > 0 and 100 < accepted < 1900, accepted
    check_against_exact(counts, joint, "draft-other warped, bf16")
