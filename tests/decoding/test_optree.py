"""OPT-Tree: the n largest-p̂ connected subtree, δ-controlled deepening, and lossless decoding with it.

1. Pure logic (`grow_opt_tree` on hand-made next-token distributions): the result equals a brute-force
   enumeration of every token path up to the depth reached; deepening stops exactly when the gain in E[A]
   falls to δ; siblings never repeat; the tree is prefix-closed with exactly n nodes.
2. The draft-model proposer (`shape="optree"`): the batched frontier forward (tree mask, positions, KV
   cache kept in sync across steps) gives the same tree as expanding every path with plain forwards.
3. Greedy equality to HF `generate` for method `optree` (target as its own draft, and an unrelated draft).
4. Sampling: OPT-Tree nodes are deterministic candidates; the engine's output distribution is the target's
   (χ² against the exact joint, with the harness of tests/test_sampling_exact.py).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from rasd.decoding.drafting.optree import DEFAULT_DELTA, delta_from_times, grow_opt_tree
from rasd.decoding.proposers import DraftModelProposer, make_proposer
from rasd.decoding.runtime.engine import SpeculativeDecoder
from rasd.decoding.sizing.sizers import CostAwareSizer, FixedSizer
from rasd.decoding.step.sampling import GREEDY
from rasd.decoding.step.tree import DraftTree
from tests.decoding.test_engine_greedy import flat_curve, prompt_of
from tests.decoding.test_sampling_exact import (
    OTHER,
    PROMPT,
    SVOCAB,
    TARGET,
    WARPED,
    Recording,
    check_against_exact,
    exact_joint,
)
from tests.helpers import assert_greedy_equal, hf_greedy, random_prompt, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

V = 6   # vocabulary of the hand-made distributions


# ------------------------------------------------------------------------------------------------------
# 1. pure logic
# ------------------------------------------------------------------------------------------------------

def hand_made(seed: int, sharpness: float = 2.0, zeros: int = 0):
    """A next-token distribution for every token path: seeded by the path, peaked by `sharpness`.

    `zeros` tokens (chosen by the path) get probability 0, so some rows have less than V candidates.
    """
    def dist(path: tuple[int, ...]) -> torch.Tensor:
        gen = torch.Generator().manual_seed(hash((seed, path)) % (2**31))
        logits = torch.randn(V, generator=gen, dtype=torch.float64) * sharpness
        if zeros:
            logits[torch.randperm(V, generator=gen)[:zeros]] = -math.inf
        return logits.softmax(-1)
    return dist


class Expander:
    """`expand` over a hand-made distribution; records the frontiers it was asked for."""

    def __init__(self, dist: Any):
        self.dist, self.calls = dist, []

    def __call__(self, tree: DraftTree, frontier: list[int]) -> torch.Tensor:
        self.calls.append(list(frontier))
        return torch.stack([self.dist(path_tokens(tree, f)) for f in frontier])


def path_tokens(tree: DraftTree, node: int) -> tuple[int, ...]:
    return tuple(tree.tokens[i] for i in tree.path_to(node))


def brute_force_top(dist: Any, depth: int, n: int) -> dict[tuple[int, ...], float]:
    """The n most likely token paths of length 1..depth by p̂ (every path enumerated)."""
    scores: dict[tuple[int, ...], float] = {}
    for length in range(1, depth + 1):
        for path in itertools.product(range(V), repeat=length):
            p = 1.0
            for k in range(length):
                p = p * float(dist(path[:k])[path[k]])
            if p > 0:
                scores[path] = p
    ranked = sorted(scores, key=lambda path: -scores[path])[:n]
    return {path: scores[path] for path in ranked}


def tree_paths(tree: DraftTree) -> dict[tuple[int, ...], float]:
    return {path_tokens(tree, i): tree.scores[i] for i in range(1, len(tree))}


def assert_no_duplicate_siblings(tree: DraftTree) -> None:
    pairs = [(tree.parents[i], tree.tokens[i]) for i in range(1, len(tree))]
    assert len(pairs) == len(set(pairs)), "two siblings hold the same token"


@pytest.mark.parametrize("n", [1, 3, 8, 25])
@pytest.mark.parametrize("delta", [0.0, 0.05, 0.3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_result_is_the_n_largest_p_hat_subtree(seed: int, delta: float, n: int) -> None:
    dist = hand_made(seed)
    result = grow_opt_tree(7, Expander(dist), n, delta, max_depth=4)
    tree = result.tree
    expected = brute_force_top(dist, result.layers, n)
    got = tree_paths(tree)
    assert set(got) == set(expected), f"layers {result.layers}"
    for path, score in got.items():
        assert score == pytest.approx(expected[path], rel=1e-12)
    assert tree.tokens[0] == 7 and tree.num_draft_tokens == n
    for i in range(1, len(tree)):   # prefix-closed, topological
        assert 0 <= tree.parents[i] < i
    assert_no_duplicate_siblings(tree)
    assert_no_duplicate_siblings(result.grown)
    assert sum(got.values()) == pytest.approx(result.expected[-1], rel=1e-12), "E[A] = Σ p̂ of the result"


def test_zero_probability_children_are_never_proposed() -> None:
    dist = hand_made(3, zeros=4)   # two candidates per node
    result = grow_opt_tree(0, Expander(dist), 50, 0.0, max_depth=3)
    assert all(s > 0 for s in result.grown.scores)
    assert result.tree.num_draft_tokens == 2 + 4 + 8
    assert set(tree_paths(result.tree)) == set(brute_force_top(dist, 3, 50))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_delta_stops_deepening(seed: int) -> None:
    dist = hand_made(seed, sharpness=3.0)
    layers = {}
    for delta in (0.0, 0.01, 0.1, 0.3, 0.6, 1.0):
        expander = Expander(dist)
        result = grow_opt_tree(0, expander, 12, delta, max_depth=6)
        gains = np.diff([0.0, *result.expected])
        assert len(expander.calls) == result.layers, "one expand (draft forward) per layer"
        assert all(g > delta for g in gains[:-1]), f"stopped too late: gains {gains}, δ {delta}"
        assert gains[-1] <= delta or result.layers == 6, f"stopped too early: gains {gains}, δ {delta}"
        for call, frontier in enumerate(expander.calls[1:], start=1):   # frontier = the last layer added
            depths = result.grown.depths()
            assert {depths[f] for f in frontier} == {call}
        layers[delta] = result.layers
    assert layers[1.0] == 1, "E[A] of the first layer is at most 1: δ = 1 never deepens"
    values = [layers[d] for d in sorted(layers)]
    assert values == sorted(values, reverse=True), f"a larger δ never grows deeper: {layers}"
    assert layers[0.0] > 1


def test_degenerate_budgets() -> None:
    expander = Expander(hand_made(0))
    assert grow_opt_tree(5, expander, 0, 0.0).tree.num_draft_tokens == 0
    assert grow_opt_tree(5, expander, 4, 0.0, max_depth=0).tree.num_draft_tokens == 0
    assert expander.calls == []


def test_delta_from_measured_times() -> None:
    assert delta_from_times(None, 0.05) == DEFAULT_DELTA
    assert delta_from_times(0.01, None) == DEFAULT_DELTA
    assert delta_from_times(0.01, 0.05) == pytest.approx(0.2)
    assert delta_from_times(0.2, 0.05) == 1.0        # a draft slower than the target: deepen only for >1 token
    assert delta_from_times(1e-6, 0.05) == 0.01


# ------------------------------------------------------------------------------------------------------
# 2. the draft-model proposer
# ------------------------------------------------------------------------------------------------------

def sequential_dist(model: torch.nn.Module, context: list[int]):
    """Next-token probabilities after context + path, each from a plain uncached forward (float64)."""
    def dist(path: tuple[int, ...]) -> torch.Tensor:
        with torch.inference_mode():
            logits = model(torch.tensor([context + list(path)])).logits[0, -1].float()
        return logits.softmax(-1).double()
    return dist


def test_draft_model_optree_equals_expansion_with_plain_forwards() -> None:
    """The batched frontier forward (tree mask, positions, cache sync across steps) is exactly the OPT-Tree of
    the draft model's sequential distributions."""
    model = tiny_llama(2, init=0.3)
    proposer = make_proposer("optree", model, delta=0.02, max_depth=4)
    assert isinstance(proposer, DraftModelProposer) and proposer.name == "optree"
    context = random_prompt(20, 4)
    proposer.start(context, GREEDY)
    for step in range(3):
        tree = proposer.propose(context, 10)
        assert proposer.last_layers >= 3, "the test needs deep trees"
        reference = grow_opt_tree(context[-1], Expander(sequential_dist(model, context)), 10, 0.02, 4).tree
        assert tree.tokens == reference.tokens and tree.parents == reference.parents
        assert tree.scores == pytest.approx(reference.scores, rel=1e-4, abs=1e-7)
        assert tree.q == {} and set(tree.sources[1:]) == {"draft"}
        branch = tree.path_to(len(tree) - 1)   # commit part of the last branch plus an unrelated token
        context = context + [tree.tokens[i] for i in branch[:2]] + [int(step * 7 % 96)]


def test_delta_follows_measured_draft_and_target_times() -> None:
    model = tiny_llama(2, init=0.3)
    proposer = DraftModelProposer(model, shape="optree", target_step_s=lambda context_len: 1000.0)
    assert proposer.current_delta(10) == DEFAULT_DELTA, "no draft forward measured yet"
    context = random_prompt(20, 4)
    proposer.start(context, GREEDY)
    proposer.propose(context, 8)
    assert proposer.forward_s is not None and proposer.forward_s > 0
    assert proposer.current_delta(len(context)) == 0.01, "a draft 1e5x faster than the target: δ at its floor"
    assert DraftModelProposer(model, shape="optree", delta=0.2).current_delta(10) == 0.2
    assert DraftModelProposer(model, shape="optree").current_delta(10) == DEFAULT_DELTA


def test_optree_needs_a_draft_model_and_a_known_shape() -> None:
    with pytest.raises(ValueError, match="optree.*draft model"):
        make_proposer("optree")
    with pytest.raises(ValueError, match="shape"):
        DraftModelProposer(tiny_llama(0), shape="ring")


# ------------------------------------------------------------------------------------------------------
# 3. greedy equality to HF
# ------------------------------------------------------------------------------------------------------

DRAFTS = {"self": None, "other": 99}


def optree_decoder(target: torch.nn.Module, draft: str, sizer: Any = None, **options: Any) -> SpeculativeDecoder:
    draft_model = target if draft == "self" else tiny_llama(DRAFTS[draft])
    return SpeculativeDecoder(target, make_proposer("optree", draft_model, **options),
                              sizer=sizer if sizer is not None else FixedSizer(16))


@pytest.mark.parametrize("draft", list(DRAFTS))
@pytest.mark.parametrize("prompt_len", [1, 7, 40])
@pytest.mark.parametrize("seed", [0, 1])
def test_optree_greedy_equals_hf(seed: int, prompt_len: int, draft: str) -> None:
    model = tiny_llama(seed)
    prompt = prompt_of(prompt_len, seed)
    decoder = optree_decoder(model, draft, delta=0.0)
    for max_new in (13, 37):
        ref = hf_greedy(model, prompt, max_new)
        out = decoder.generate(prompt, max_new)
        assert_greedy_equal(model, prompt, out.token_ids, ref, label=f"optree-{draft} seed={seed} len={prompt_len}")
        assert out.finish_reason == "length"
        assert out.stats.num_draft_tokens > 0


@pytest.mark.parametrize("sizer", ["fixed", "cost"])
@pytest.mark.parametrize("seed", [0, 1])
def test_optree_deep_trees_greedy_equals_hf(seed: int, sizer: str) -> None:
    """Peaked models (larger init): the trees are several layers deep and most steps accept many tokens."""
    model = tiny_llama(seed, init=0.3)
    prompt = random_prompt(30, seed + 3)
    chosen = FixedSizer(16) if sizer == "fixed" else CostAwareSizer(flat_curve, max_nodes=16)
    for draft in DRAFTS:
        out = optree_decoder(model, draft, sizer=chosen, delta=0.05).generate(prompt, 60)
        assert_greedy_equal(model, prompt, out.token_ids, hf_greedy(model, prompt, 60), label=f"optree-{draft}")
        if draft == "self":
            assert out.stats.mean_accepted_tokens > 3, out.stats.accept_lengths
            assert out.stats.accepted_by_source["draft"] == out.stats.num_accepted_tokens


def test_optree_respects_the_context_limit_and_eos() -> None:
    """Near the model's context the node budget shrinks to the room left; EOS inside an accepted block."""
    model = tiny_llama(0, init=0.3)
    prompt = random_prompt(40, 1)
    ref = hf_greedy(model, prompt, 37)
    out = SpeculativeDecoder(model, make_proposer("optree", model, delta=0.0), sizer=FixedSizer(16),
                             max_context=50).generate(prompt, 37)
    assert out.token_ids == ref[:10] and out.finish_reason == "length"
    eos = ref[12]
    ref_eos = hf_greedy(model, prompt, 37, eos_token_id=eos)
    out = optree_decoder(model, "self", delta=0.0).generate(prompt, 37, eos_token_ids={eos})
    assert out.token_ids == ref_eos and out.finish_reason == "eos"


# ------------------------------------------------------------------------------------------------------
# 4. sampling with deterministic OPT-Tree nodes is exact
# ------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_optree_sampling_is_exact() -> None:
    """Warped sampling (temperature, top-k, top-p) with an unrelated draft: several deterministic candidates per
    node, accepted with p(x) or zeroed out; the first three tokens follow the exact joint of plain sampling."""
    target = tiny_llama(**TARGET)
    recording = Recording(make_proposer("optree", tiny_llama(**OTHER), delta=0.0, max_depth=2))
    decoder = SpeculativeDecoder(target, recording, sizer=FixedSizer(6))
    joint = exact_joint(target, PROMPT, WARPED)
    counts = np.zeros((SVOCAB,) * 3)
    accepted = 0
    n = 1000
    for i in range(n):
        out = decoder.generate(PROMPT, 3, sampling=replace(WARPED, seed=2 * i))
        a, b, c = out.token_ids
        counts[a, b, c] += 1
        accepted += out.stats.num_accepted_tokens
    assert recording.nodes_with_q == 0, "OPT-Tree nodes are deterministic candidates"
    assert recording.max_root_children >= 2, "several candidates per node: the zero-and-renormalise rule is used"
    assert 100 < accepted < 1900, f"acceptances {accepted}: both outcomes must be exercised"
    check_against_exact(counts, joint, "optree warped")


def test_cli_optree_without_a_draft_model_needs_the_trained_self_draft(
        capsys: pytest.CaptureFixture[str], tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from rasd.cli import main

    monkeypatch.setenv("RASD_HOME", str(tmp_path))   # no trained exit layer there
    code = main(["generate", "--model", "/nonexistent", "--method", "optree", "--prompt", "hi"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "rasd train eesd" in err[0]


def test_n_is_tied_to_the_flat_part_of_the_cost_curve() -> None:
    """OPT-Tree's n: the nodes a curve verifies for about one token's price (a CPU: few; a GPU: many)."""
    from rasd.decoding.sizing.cost import CostCurve, flat_nodes

    cpu = CostCurve("cpu", 256, [1, 2, 4, 8, 16], [0.0647, 0.0652, 0.0652, 0.1038, 0.110])
    gpu = CostCurve("gpu", 256, [1, 2, 4, 8, 16, 32, 64], [0.0268] * 5 + [0.0274, 0.0276])
    steep = CostCurve("steep", 256, [1, 2, 4], [0.05, 0.09, 0.2])
    assert (flat_nodes(cpu), flat_nodes(gpu), flat_nodes(steep)) == (3, 63, 1)
    model = tiny_llama(2, init=0.3)
    proposer = DraftModelProposer(model, shape="optree", delta=0.0, node_cap=lambda context_len: 3)
    context = random_prompt(20, 4)
    proposer.start(context, GREEDY)
    assert proposer.propose(context, 32).num_draft_tokens == 3
