"""Length/size controllers behind one interface: update rules on hand-made trees and verdicts, the cuts they
make (always prefix-closed), selection by name, and greedy equality to HF `generate` with each of them."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rasd.decoding.runtime.engine import build_decoder
from rasd.decoding.sizing.cost import CostCurve
from rasd.decoding.sizing.cost_aware import CostAwareSizer
from rasd.decoding.sizing.simple import FixedSizer, HeuristicSizer, ThresholdSizer, depth_cut, ended_at_leaf
from rasd.decoding.sizing.sizers import SIZINGS, make_sizer
from rasd.decoding.sizing.thompson import ThompsonSizer
from rasd.decoding.step.tree import DraftTree
from tests.decoding.test_engine_greedy import check_stats, cpu_like_curve, flat_curve, make_decoder, prompt_of
from tests.helpers import assert_greedy_equal, hf_greedy, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


def chain(length: int) -> DraftTree:
    return DraftTree.chain(0, list(range(1, length + 1)), "draft", [0.9**k for k in range(1, length + 1)])


def forked() -> DraftTree:
    """root ─ a(0.8) ─ b(0.5) ─ c(0.2)      root ─ d(0.35) ─ e(0.4: above its parent)      root ─ f(0.1)"""
    tree = DraftTree.root_only(0)
    a = tree.add(0, 1, "x", 0.8)
    b = tree.add(a, 2, "x", 0.5)
    tree.add(b, 3, "x", 0.2)
    d = tree.add(0, 4, "x", 0.35)
    tree.add(d, 5, "x", 0.4)
    tree.add(0, 6, "x", 0.1)
    return tree


def random_tree(rng: random.Random, size: int) -> DraftTree:
    tree = DraftTree.root_only(0)
    for token in range(1, size + 1):
        parent = rng.randrange(len(tree))
        tree.add(parent, token, "x", rng.random() * tree.scores[parent] * 1.3)
    return tree


def assert_prefix_closed(tree: DraftTree) -> None:
    for i in range(1, len(tree)):
        assert 0 <= tree.parents[i] < i


def token_paths(tree: DraftTree) -> set[tuple[int, ...]]:
    return {tuple(tree.tokens[j] for j in tree.path_to(i)) for i in range(1, len(tree))}


# ------------------------------------------------------------------------------------------------------
# update rules and cuts
# ------------------------------------------------------------------------------------------------------

def test_ended_at_leaf() -> None:
    tree = forked()
    assert not ended_at_leaf(tree, [])            # root has children: the first draft token was rejected
    assert not ended_at_leaf(tree, [1])           # a → b rejected
    assert ended_at_leaf(tree, [1, 2, 3])         # ran out of draft
    assert ended_at_leaf(tree, [6])
    assert ended_at_leaf(DraftTree.root_only(0), [])


def test_depth_cut_is_prefix_closed() -> None:
    tree = forked()
    assert token_paths(depth_cut(tree, 1)) == {(1,), (4,), (6,)}
    assert token_paths(depth_cut(tree, 2)) == {(1,), (1, 2), (4,), (4, 5), (6,)}
    assert depth_cut(tree, 3) is tree
    rng = random.Random(0)
    for _ in range(50):
        t = random_tree(rng, 12)
        limit = rng.randrange(0, 5)
        cut = depth_cut(t, limit)
        assert_prefix_closed(cut)
        assert max(cut.depths()) <= limit
        assert cut.num_draft_tokens == sum(1 for d in t.depths()[1:] if d <= limit)


def test_heuristic_plus_two_minus_one() -> None:
    sizer = HeuristicSizer(max_nodes=64, initial=5, max_depth=9)
    assert sizer.depth == 5
    cut = sizer.cut(chain(8), 100)
    assert cut.num_draft_tokens == 5 and max(cut.depths()) == 5
    sizer.observe(cut, [1, 2, 3, 4, 5], 0.0)      # everything drafted was accepted
    assert sizer.depth == 7
    sizer.observe(chain(7), [1, 2], 0.0)            # rejected at depth 3
    assert sizer.depth == 6
    sizer.observe(DraftTree.root_only(0), [], 0.0)  # nothing drafted: nothing learnt
    assert sizer.depth == 6
    for _ in range(10):
        sizer.observe(chain(3), [], 0.0)
    assert sizer.depth == 1, "never below 1"
    for _ in range(10):
        sizer.observe(chain(1), [1], 0.0)
    assert sizer.depth == 9, "capped at max_depth"
    sizer.observe(forked(), [4, 5], 0.0)            # a tree: the accepted branch ran out of draft
    assert sizer.depth == 9


def test_threshold_cut_is_prefix_closed() -> None:
    sizer = ThresholdSizer(max_nodes=64, threshold=0.3)
    assert token_paths(sizer.cut(forked(), 10)) == {(1,), (1, 2), (4,), (4, 5)}
    assert token_paths(ThresholdSizer(threshold=0.6).cut(forked(), 10)) == {(1,)}
    assert ThresholdSizer(threshold=0.9).cut(forked(), 10).num_draft_tokens == 0
    rng = random.Random(1)
    for _ in range(100):
        tree = random_tree(rng, 15)
        threshold = rng.random() * 0.8
        cut = ThresholdSizer(threshold=threshold).cut(tree, 10)
        assert_prefix_closed(cut)
        scores = tree.monotone_scores()
        kept = {tuple(tree.tokens[j] for j in tree.path_to(i)) for i in range(1, len(tree)) if scores[i] >= threshold}
        assert token_paths(cut) == kept


def test_threshold_decides_a_sampled_node_by_its_parent() -> None:
    """Dropping a node sampled from q because of its own q(x) would bias the proposal away from q."""
    tree = DraftTree.root_only(0)
    first = tree.add(0, 1, "draft", 0.1)
    tree.q[first] = torch.full((8,), 1 / 8)
    second = tree.add(first, 2, "draft", 0.05)
    tree.q[second] = torch.full((8,), 1 / 8)
    cut = ThresholdSizer(threshold=0.3).cut(tree, 10)
    assert token_paths(cut) == {(1,)} and 1 in cut.q, "drafted after the root (confidence 1): kept whole"


def test_thompson_posterior_counts() -> None:
    sizer = ThompsonSizer(prior=(1.0, 1.0))
    sizer.observe(chain(4), [1, 2], 0.0)            # 2 accepted, then a rejection
    assert (sizer.alpha, sizer.beta) == (3.0, 2.0)
    sizer.observe(chain(3), [1, 2, 3], 0.0)         # all accepted: no rejection observed
    assert (sizer.alpha, sizer.beta) == (6.0, 2.0)
    sizer.observe(chain(3), [], 0.0)                # first token rejected
    assert (sizer.alpha, sizer.beta) == (6.0, 3.0)
    sizer.observe(DraftTree.root_only(0), [], 0.0)  # nothing drafted: nothing learnt
    assert (sizer.alpha, sizer.beta) == (6.0, 3.0)
    decayed = ThompsonSizer(prior=(1.0, 1.0), decay=0.5)
    decayed.observe(chain(4), [1, 2], 0.0)
    decayed.observe(chain(4), [1, 2], 0.0)
    assert (decayed.alpha, decayed.beta) == (1.0 + 1.0 + 2.0, 1.0 + 0.5 + 1.0)


def test_thompson_depth_follows_the_posterior() -> None:
    good = ThompsonSizer(prior=(1.0, 1.0), max_depth=10, seed=1)
    bad = ThompsonSizer(prior=(1.0, 1.0), max_depth=10, seed=1)
    for _ in range(200):
        good.observe(chain(6), [1, 2, 3, 4, 5, 6], 0.0)
        bad.observe(chain(6), [], 0.0)
    good_depths = [good.sample_depth() for _ in range(200)]
    bad_depths = [bad.sample_depth() for _ in range(200)]
    assert min(good_depths) >= 8, "a confidently good drafter drafts (nearly) to the cap"
    assert set(bad_depths) == {1}, "a confidently bad drafter keeps only the minimum depth"
    fresh = ThompsonSizer(prior=(1.0, 1.0), max_depth=10, seed=2)
    depths = {fresh.sample_depth() for _ in range(300)}
    assert min(depths) == 1 and max(depths) >= 4, "an uncertain posterior explores several depths"
    cut = good.cut(chain(12), 10)
    assert cut.num_draft_tokens == good.depth <= 10


def test_sizers_by_name() -> None:
    assert SIZINGS == ("cost", "fixed", "heuristic", "threshold", "thompson", "ldlp")
    assert isinstance(make_sizer("fixed", 8), FixedSizer)
    assert isinstance(make_sizer("heuristic", 8), HeuristicSizer)
    assert isinstance(make_sizer("threshold", 8, threshold=0.5), ThresholdSizer)
    assert isinstance(make_sizer("thompson", 8), ThompsonSizer)
    assert isinstance(make_sizer("cost", 8, curve_for=flat_curve), CostAwareSizer)
    with pytest.raises(ValueError, match="cost curve"):
        make_sizer("cost", 8)
    with pytest.raises(ValueError, match="rasd train ldlp"):
        make_sizer("ldlp", 8)
    with pytest.raises(ValueError, match="unknown sizing"):
        make_sizer("magic", 8)


@pytest.mark.parametrize("sizing", ["fixed", "heuristic", "threshold", "thompson"])
def test_build_decoder_picks_the_sizer_by_name(sizing: str) -> None:
    target = SimpleNamespace(model=tiny_llama(0), tokenizer=None, max_context=512, name="tiny")
    decoder = build_decoder(target, "pld", sizing=sizing, max_nodes=12)
    assert isinstance(decoder.sizer, type(make_sizer(sizing, 12)))
    prompt = prompt_of(40, 5)
    out = decoder.generate(prompt, 20)
    assert out.token_ids == hf_greedy(target.model, prompt, 20)
    with pytest.raises(ValueError, match="rasd train ldlp"):
        build_decoder(target, "pld", sizing="ldlp")


# ------------------------------------------------------------------------------------------------------
# greedy equality with every controller
# ------------------------------------------------------------------------------------------------------

def sizer_named(name: str) -> Any:
    return make_sizer(name, 16, curve_for=flat_curve)


@pytest.mark.parametrize("method", ["pld", "draft-tree-self", "draft-chain-other"])
@pytest.mark.parametrize("sizing", ["fixed", "heuristic", "threshold", "thompson", "cost"])
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_equals_hf_with_each_controller(seed: int, sizing: str, method: str) -> None:
    model = tiny_llama(seed)
    for prompt_len, max_new in ((7, 13), (40, 37)):
        prompt = prompt_of(prompt_len, seed)
        ref = hf_greedy(model, prompt, max_new)
        sizer = sizer_named(sizing)
        out = make_decoder(model, method, sizer=sizer).generate(prompt, max_new)
        assert_greedy_equal(model, prompt, out.token_ids, ref, label=f"{method} {sizing} seed={seed}")
        check_stats(out, method)
        if sizing in ("heuristic", "thompson"):
            assert max(out.stats.accept_lengths) <= sizer.max_depth + 1
    if method == "pld" or (method == "draft-tree-self" and sizing != "threshold"):   # (tiny p̂ < τ: no tree)
        assert out.stats.num_accepted_tokens > 0, "the controller must let speculation happen"


def test_threshold_keeps_confident_draft_nodes() -> None:
    """A peaked model drafting for itself: confident nodes pass τ = 0.3, get accepted, and stay exact."""
    model = tiny_llama(0, init=0.3)
    prompt = prompt_of(40, 5)
    out = make_decoder(model, "draft-tree-self", sizer=sizer_named("threshold")).generate(prompt, 37)
    assert_greedy_equal(model, prompt, out.token_ids, hf_greedy(model, prompt, 37), label="threshold")
    assert out.stats.num_accepted_tokens > 5


def test_heuristic_and_thompson_deepen_for_a_drafter_that_is_always_right() -> None:
    """The target as its own draft chain: every draft is accepted, so both controllers settle deep."""
    model = tiny_llama(0, init=0.3)
    prompt = prompt_of(40, 5)
    for name in ("heuristic", "thompson"):
        sizer = make_sizer(name, 16)
        out = make_decoder(model, "draft-chain-self", sizer=sizer).generate(prompt, 60)
        assert_greedy_equal(model, prompt, out.token_ids, hf_greedy(model, prompt, 60), label=name)
        late = out.stats.accept_lengths[len(out.stats.accept_lengths) // 2:]
        assert min(late) >= 5, f"{name}: {out.stats.accept_lengths}"


def test_cli_offers_every_sizing_and_refuses_ldlp_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from rasd.cli import build_parser, main

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    generate = sub.choices["generate"]
    sizing = next(a for a in generate._actions if a.dest == "sizing")
    assert list(sizing.choices) == list(SIZINGS) and sizing.default == "cost"
    code = main(["generate", "--model", "/nonexistent", "--method", "ar", "--prompt", "hi", "--sizing", "ldlp"])
    err = capsys.readouterr().err
    assert code == 2 and "rasd train ldlp" in err and err.count("\n") == 1


def h200_like_curve(context_len: int) -> CostCurve:
    """The H200's measured verify curve (docs/lab-notes/gpu.md): flat, 64 tokens cost 4% more than one."""
    sizes = [1, 2, 4, 8, 16, 32, 64]
    return CostCurve(key="h200", context_len=256, sizes=sizes,
                     latency_s=[0.02525] * 4 + [0.02570, 0.02570, 0.02626])


def test_one_lucky_timing_does_not_lock_the_sizer_onto_its_size() -> None:
    """On a flat curve sizes differ by less than their timing noise: a single fast observation at 23 nodes
    must not make 23 look cheaper than 40 (it did when each exact size kept its own time)."""
    sizer = CostAwareSizer(h200_like_curve, max_nodes=63)
    tree = DraftTree.root_only(0)
    for token in range(1, 41):              # 40 first-token guesses (a recycled top-k): each one worth a node
        tree.add(0, token, "recycling", 0.5)
    before = sizer.cut(tree, 300).num_draft_tokens
    assert before > 23
    sizer.observe(chain(22), [1, 2], 0.0, verify_s=0.95 * h200_like_curve(300).latency(23))
    assert sizer.cut(tree, 300).num_draft_tokens == before
    curve = h200_like_curve(300)
    # the correction scales the curve; its shape (what bigger trees cost more) stays the measured one
    assert sizer.latency(curve, 40) / sizer.latency(curve, 23) == pytest.approx(curve.latency(40) / curve.latency(23))


def test_latency_corrections_are_pooled_per_size_class_and_carry_to_other_contexts() -> None:
    sizer = CostAwareSizer(cpu_like_curve, max_nodes=63)
    sizer.cut(chain(4), 500)                                    # the curve of this context is the reference
    sizer.observe(chain(4), [1], 0.0, verify_s=2.0 * cpu_like_curve(500).latency(5))      # class 4-7: 2x
    assert sizer.correction.observed == {3: pytest.approx(2.0)}
    far = CostCurve(key="far", context_len=2048, sizes=[1, 64], latency_s=[0.5, 1.0])
    assert sizer.latency(far, 6) == pytest.approx(2.0 * far.latency(6))      # same class, other context
    assert sizer.latency(far, 40) == pytest.approx(2.0 * far.latency(40))    # unseen class: the mean so far
    sizer.cut(chain(40), 500)
    sizer.observe(chain(40), [1], 0.0, verify_s=1.0 * cpu_like_curve(500).latency(41))   # class 32-63: 1x
    observed = sizer.correction.observed
    assert observed[6] == pytest.approx(1.0) and observed[3] == pytest.approx(2.0)
    assert 1.0 < sizer.correction.observed_all < 2.0


# ------------------------------------------------------------------------------------------------------
# state() / load_state(): what a sizer learned, carried as plain data
# ------------------------------------------------------------------------------------------------------

class FixedDepth:
    """An LDLP controller stand-in: a fixed depth limit, nothing learned (the real one needs a trained MLP)."""

    def cut(self, tree: DraftTree) -> DraftTree:
        return depth_cut(tree, 2)

    def observe(self, tree: DraftTree, accepted: list[int]) -> None:
        pass


STATEFUL = {"cost": lambda: make_sizer("cost", 16, curve_for=cpu_like_curve),
            "fixed": lambda: make_sizer("fixed", 16),
            "heuristic": lambda: make_sizer("heuristic", 16, initial=2),
            "threshold": lambda: make_sizer("threshold", 16),
            "thompson": lambda: make_sizer("thompson", 16, seed=7),
            "ldlp": lambda: make_sizer("ldlp", 16, controller=FixedDepth())}
LEARNS = {"cost", "heuristic", "thompson"}


def drive(sizer: Any, seed: int, steps: int) -> list[set[tuple[int, ...]]]:
    """Cut and observe `steps` random trees (each accepting a random path of the cut); the cuts' token paths."""
    rng, cuts = random.Random(seed), []
    for _ in range(steps):
        tree = random_tree(rng, rng.randrange(0, 20))
        cut = sizer.cut(tree, 300)
        accepted, node = [], 0
        while (kids := cut.children(node)) and rng.random() < 0.7:
            node = kids[0]
            accepted.append(node)
        sizer.observe(cut, accepted, overhead_s=0.001 * rng.random(), verify_s=0.05 + 0.01 * rng.random())
        cuts.append(token_paths(cut))
    return cuts


def as_json(state: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(state))


def test_sizing_names_all_have_a_state_round_trip_case() -> None:
    assert set(STATEFUL) == set(SIZINGS)


@pytest.mark.parametrize("sizing", list(STATEFUL))
def test_a_sizer_state_round_trips_as_json_and_decides_alike(sizing: str) -> None:
    """What `state()` gives survives JSON; a sizer loaded from it reports the same state, and two sizers loaded
    from the same state cut the same trees from then on (the state is all a later request starts from)."""
    make = STATEFUL[sizing]
    learned = make()
    drive(learned, seed=1, steps=60)
    state = as_json(learned.state())
    assert (state != as_json(make().state())) == (sizing in LEARNS), "a learning sizer's state must move"
    first, second = make(), make()
    first.load_state(state)
    assert as_json(first.state()) == state
    second.load_state(as_json(first.state()))
    assert drive(first, seed=2, steps=40) == drive(second, seed=2, steps=40)
    assert as_json(first.state()) == as_json(second.state())


def test_a_loaded_cost_sizer_starts_from_the_learned_estimates_not_the_prior() -> None:
    """The carried posteriors and latency corrections are the ones learned (not a reset): a loaded sizer rates
    nodes and prices trees as the sizer that learned them does."""
    learned = STATEFUL["cost"]()
    drive(learned, seed=3, steps=80)
    loaded, fresh = STATEFUL["cost"](), STATEFUL["cost"]()
    loaded.load_state(as_json(learned.state()))
    tree = random_tree(random.Random(4), 15)
    assert loaded.estimator.path_probs(tree) == learned.estimator.path_probs(tree)
    assert loaded.estimator.path_probs(tree) != fresh.estimator.path_probs(tree)
    curve = cpu_like_curve(300)
    assert [loaded.latency(curve, n) for n in (1, 4, 16)] == [learned.latency(curve, n) for n in (1, 4, 16)]
    assert loaded.overhead_s == learned.overhead_s > 0
