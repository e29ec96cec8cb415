"""One tree width per batch step: the cost model's fit, the choice of W, the cuts, and losslessness.

Pure logic on hand-made trees and synthetic cost curves, then tiny random Llamas whose requests are sized
by cost-aware sizers inside one batch: greedy output must still equal HF `generate`.
"""

from __future__ import annotations

import pytest
import torch

from rasd.decoding.proposers import make_proposer
from rasd.decoding.proposers.recycling import RecyclingMatrix
from rasd.decoding.runtime.engine import GenerationStream, SpeculativeDecoder, vocab_size
from rasd.decoding.sizing.batch_width import BatchCostModel, BatchSizer, plan_row
from rasd.decoding.sizing.cost import CostCurve
from rasd.decoding.sizing.sizers import CostAwareSizer, FixedSizer
from rasd.decoding.step.batch_decoder import BatchDecoder
from rasd.decoding.step.tree import DraftTree
from tests.helpers import assert_greedy_equal, hf_greedy, random_prompt, tiny_llama

SIZES = [1, 2, 4, 8, 16, 32, 64, 128]


def curve(per_token: float, base: float = 0.05) -> CostCurve:
    """A linear single-row cost curve: `base` seconds plus `per_token` per tree token beyond the first."""
    return CostCurve("synthetic", 512, SIZES, [base + per_token * (n - 1) for n in SIZES])


def chain(tokens: int, score: float = 0.9) -> DraftTree:
    """Root 0 and a chain of `tokens` draft nodes with decreasing proposer scores."""
    tree = DraftTree.root_only(0)
    parent = 0
    for i in range(tokens):
        parent = tree.add(parent, 10 + i, "retrieval", score ** (i + 1))
    return tree


def cost_sizer(per_token: float = 0.001) -> CostAwareSizer:
    return CostAwareSizer(lambda n: curve(per_token), max_nodes=32)


def is_prefix_closed(tree: DraftTree) -> bool:
    return all(p < i for i, p in enumerate(tree.parents) if i > 0) and tree.parents[0] == -1


def test_cost_model_recovers_matmul_scale_and_attention_term() -> None:
    model, c_ = BatchCostModel(), curve(0.004)
    a_true, c_true = 1.4, 2e-6
    for rows, width, ctx in [(8, 1, 7000), (8, 3, 7000), (4, 2, 3000), (2, 8, 1500), (8, 6, 6000), (1, 16, 800)]:
        seconds = a_true * c_.latency(rows * width) + c_true * width * ctx
        for _ in range(8):
            model.observe(c_, rows, width, ctx, seconds)
    assert model.a == pytest.approx(a_true, rel=0.05)
    assert model.c == pytest.approx(c_true, rel=0.10)
    assert model.predict(c_, 8, 4, 7000) == pytest.approx(a_true * c_.latency(32) + c_true * 4 * 7000, rel=0.05)


def test_cost_model_prior_before_any_observation_is_the_single_row_curve() -> None:
    model = BatchCostModel()
    assert model.predict(curve(0.01), 4, 2, 3000) == pytest.approx(curve(0.01).latency(8))


def test_width_follows_cost_and_acceptance() -> None:
    sizer = BatchSizer(max_tokens=128)
    plans = []
    for _ in range(4):
        tree, rows_sizer = chain(12, 0.95), cost_sizer()
        for _ in range(20):   # every node of this chain was accepted before: p̂ stays high along it
            rows_sizer.estimator.update(tree, list(range(1, len(tree))))
        plans.append(plan_row(tree, rows_sizer))
    flat = sizer.width(plans, curve(0.0001), context_sum=4 * 500)
    steep = sizer.width(plans, curve(0.2), context_sum=4 * 500)
    assert flat == 13 and steep == 1, (flat, steep)
    assert BatchSizer(max_tokens=32).width(plans, curve(0.0001), context_sum=4 * 500) == 32 // 4


def test_cut_gives_every_cost_row_the_same_width_and_keeps_other_rows_whole() -> None:
    sizer = BatchSizer(max_tokens=64)
    fixed = chain(5)
    sampled = chain(3)
    sampled.q = {1: torch.zeros(4), 2: torch.zeros(4)}      # two nodes drawn from q: never cut one by one
    trees = [chain(20), chain(2), fixed, sampled]
    sizers = [cost_sizer(), cost_sizer(), FixedSizer(5), cost_sizer()]
    out = sizer.cut(trees, sizers, curve(0.0001), context_sum=4 * 300)
    w = sizer.last_width
    assert w >= len(fixed), "a row whose own policy cut its tree sets a lower bound on the width"
    assert out[2] is fixed
    assert len(out[0]) == min(w, len(trees[0])) and len(out[1]) == min(w, len(trees[1]))
    assert set(out[3].q) == {1, 2}, "sampled nodes stay"
    assert all(is_prefix_closed(t) and len(t) <= max(w, len(t) if t is fixed else 0) for t in out)


def test_cut_shrinks_every_row_to_the_root_when_nothing_pays() -> None:
    sizer = BatchSizer(max_tokens=64)
    trees = [chain(8, 0.05), chain(8, 0.05)]
    sizers = [cost_sizer(), cost_sizer()]
    for s in sizers:    # many rejections at every depth: p̂ near zero
        for _ in range(30):
            s.estimator.update(trees[0], [])
    out = sizer.cut(trees, sizers, curve(0.05), context_sum=2 * 300)
    assert sizer.last_width == 1 and all(len(t) == 1 for t in out)


def decoder(model: torch.nn.Module, method: str, cost: bool) -> SpeculativeDecoder:
    sizer = CostAwareSizer(lambda n: curve(0.0005, base=0.01), max_nodes=16) if cost else FixedSizer(8)
    extra = {"recycling": RecyclingMatrix(vocab_size(model))} if method == "recycling" else {}
    return SpeculativeDecoder(model, make_proposer(method, None, **extra), sizer=sizer)


def repeating(length: int, seed: int) -> list[int]:
    head = random_prompt(length - 10, seed)
    return head + head[:10] + head[:10]


@pytest.mark.usefixtures("one_thread")
def test_batch_sized_requests_stay_greedy_equal_to_hf() -> None:
    model = tiny_llama(3)
    batch = BatchDecoder(model)
    specs = [("pld", 40, 1, 30, True), ("recycling", 25, 2, 24, True), ("pld", 33, 3, 17, False),
             ("ar", 12, 4, 20, True)]
    streams: list[GenerationStream] = []
    blocks: dict[int, list[int]] = {}
    for method, length, seed, max_new, cost in specs:
        stream = decoder(model, method, cost).stream(repeating(length, seed), max_new)
        streams.append(stream)
        blocks[id(stream)] = batch.add(stream) or []
    widths = []
    for _ in range(200):
        if not len(batch):
            break
        for stream, block in batch.step():
            blocks[id(stream)] += block
        widths.append(batch.sizer.last_width)
    assert not len(batch)
    assert max(widths) > 1, "the batch must have speculated"
    for stream, (method, _, _, max_new, _) in zip(streams, specs, strict=True):
        out = stream.output
        assert out is not None and blocks[id(stream)] == out.token_ids
        assert_greedy_equal(model, stream.prompt_ids, out.token_ids, hf_greedy(model, stream.prompt_ids, max_new),
                            label=method)
    assert batch.sizer.cost.obs, "the batch learned what its forwards cost"


def test_a_batch_ranks_rows_by_their_estimates_uncalibrated() -> None:
    """A batch has no exploration step: a row whose first places were scaled down by the single-request
    calibration (`AcceptanceEstimator.position_factor`) would be held at W = 1 with nothing more to learn."""
    sizer = cost_sizer()
    sizer.estimator.calibration[(1, True)] = [0.0, 20.0]      # the likeliest place: predicted 20 tokens, got none
    assert sizer.estimator.position_factor(1) < 0.1
    tree = chain(3)
    plan = plan_row(tree, sizer)
    probs = sizer.estimator.path_probs(tree)
    assert plan.probs == [probs[i] for i in plan.ranked]
