"""Cost curves (interpolation, buckets, on-disk cache) and tree sizing (acceptance estimates, cost-aware cut)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

import rasd.decoding.sizing.cost as cost_mod
from rasd.decoding.sizing.acceptance import AcceptanceEstimator
from rasd.decoding.sizing.cost import (
    CONTEXT_BUCKETS,
    CostCurve,
    context_bucket,
    curve_key,
    load_or_measure,
    measure_curve,
)
from rasd.decoding.sizing.cost_aware import CostAwareSizer
from rasd.decoding.sizing.simple import FixedSizer
from rasd.decoding.step.tree import DraftTree
from tests.helpers import tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


def curve(latencies: list[float], sizes: list[int] | None = None) -> CostCurve:
    sizes = sizes or [1, 2, 4, 8]
    return CostCurve(key="k", context_len=256, sizes=sizes, latency_s=latencies)


def test_latency_interpolation_and_extrapolation() -> None:
    c = curve([1.0, 1.5, 2.5, 4.5])
    assert c.latency(1) == 1.0 and c.latency(2) == 1.5 and c.latency(8) == 4.5   # measured points
    assert c.latency(3) == pytest.approx(2.0)                                      # between 2 and 4
    assert c.latency(6) == pytest.approx(3.5)                                      # between 4 and 8
    assert c.latency(10) == pytest.approx(5.5)                                     # last segment's slope
    assert c.latency(0) == 1.0 and c.latency(-3) == 1.0                            # at least one token
    assert c.max_tokens == 8
    assert c.relative() == pytest.approx([1.0, 1.5, 2.5, 4.5])
    values = [c.latency(n) for n in range(0, 40)]
    assert all(b >= a for a, b in zip(values, values[1:], strict=False)), "monotone curve, monotone latency"
    sparse = curve([0.06, 0.105, 0.13, 0.19], sizes=[1, 16, 32, 64])
    assert sparse.latency(2) == pytest.approx(0.06 + 0.045 / 15)
    assert sparse.latency(48) == pytest.approx(0.16)


def test_context_bucket() -> None:
    """Lengths map onto measured buckets: every bucket to itself, monotonically, extremes to the ends."""
    assert list(CONTEXT_BUCKETS) == sorted(CONTEXT_BUCKETS)
    for bucket in CONTEXT_BUCKETS:
        assert context_bucket(bucket) == bucket
    lengths = [1, 10, 100, 255, 256, 257, 600, 1024, 1500, 3000, 4096, 100_000]
    buckets = [context_bucket(n) for n in lengths]
    assert all(b in CONTEXT_BUCKETS for b in buckets)
    assert buckets == sorted(buckets)
    assert buckets[0] == CONTEXT_BUCKETS[0] and buckets[-1] == CONTEXT_BUCKETS[-1]


def test_curve_key_separates_what_matters() -> None:
    a, b = tiny_llama(0), tiny_llama(0, vocab=80)
    key = curve_key(a, "m", "cpu", "float32", 256)
    assert key == curve_key(tiny_llama(0), "m", "cpu", "float32", 256)        # same config, same key
    others = {curve_key(b, "m", "cpu", "float32", 256), curve_key(a, "n", "cpu", "float32", 256),
              curve_key(a, "m", "cuda:0", "float32", 256), curve_key(a, "m", "cpu", "bfloat16", 256),
              curve_key(a, "m", "cpu", "float32", 1024)}
    assert key not in others and len(others) == 5
    assert "/" not in curve_key(a, "org/some model", "cpu", "float32", 256)   # a safe file name


def test_measure_curve_is_monotone() -> None:
    model = tiny_llama(0)
    c = measure_curve(model, 40, sizes=(1, 4, 16, 32), repeats=2, key="x", progress=False)
    assert c.sizes == [1, 4, 16, 32] and c.context_len == 40 and c.key == "x"
    assert len(c.latency_s) == 4 and all(t > 0 for t in c.latency_s)
    assert all(b >= a for a, b in zip(c.latency_s, c.latency_s[1:], strict=False))


def test_the_default_curve_measures_inside_every_kernel_bucket() -> None:
    """Between two row counts where the kernels change form (`kernels._BUCKETS`) the cost is not the line
    between them (1k context, 2-core EPYC: 9 tokens cost 69 ms, the line from 8 to 16 says 57), so the curve
    measures every bucket's own size and at least one size inside every gap wider than one."""
    from rasd.decoding.model.kernels import _BUCKETS

    sizes = cost_mod.DEFAULT_SIZES
    assert list(sizes) == sorted(set(sizes)) and sizes[0] == 1
    assert set(_BUCKETS) <= set(sizes)
    for low, high in zip(_BUCKETS, _BUCKETS[1:], strict=False):
        if high - low > 1:
            assert any(low < s < high for s in sizes), (low, high)


def test_the_curve_times_sizes_up_and_down_so_one_token_never_follows_the_largest_tree(monkeypatch) -> None:
    """After the warm-up round, a size is only ever timed right after one of its neighbours (or itself)."""
    order: list[int] = []
    monkeypatch.setattr(cost_mod, "_timed_forward", lambda model, cache, step: lambda tree: order.append(len(tree)))
    sizes = (1, 2, 4, 8, 16)
    measure_curve(tiny_llama(0), 40, sizes=sizes, repeats=4, progress=False)
    assert len(order) == 5 * len(sizes)
    timed = order[len(sizes):]
    for before, size in zip(timed, timed[1:], strict=False):
        assert abs(sizes.index(before) - sizes.index(size)) <= 1, (before, size)


def test_a_measurement_beats_the_heart_every_round() -> None:
    """A service's stall detector hears from a first measurement while it runs (it is slow, not stuck)."""
    beats: list[float] = []
    measure_curve(tiny_llama(0), 40, sizes=(1, 4), repeats=3, progress=False, heartbeat=lambda: beats.append(1))
    assert len(beats) == 4


def test_load_or_measure_caches_to_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_llama(0)
    calls: list[int] = []
    real = cost_mod.measure_curve

    def quick_measure(model, context_len, key="", **kwargs):   # noqa: ANN001, ANN202
        calls.append(context_len)
        return real(model, context_len, sizes=(1, 2, 8), repeats=1, key=key, progress=False)

    monkeypatch.setattr(cost_mod, "measure_curve", quick_measure)
    monkeypatch.setattr(cost_mod, "machine_probe", lambda: 0.001)   # a machine exactly as busy as before
    monkeypatch.setattr(cost_mod, "TRUSTED_FOR_S", 0.0)             # read the file on every call here
    small, large = context_bucket(100), context_bucket(100_000)
    assert small != large
    same = next(n for n in range(101, 100_000) if context_bucket(n) == small)
    first = load_or_measure(model, "tiny", "cpu", "float32", 100, cache_dir=tmp_path)
    assert calls == [small], "measured once, at the bucket's context length"
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["latency_s"] == first.latency_s
    assert not list(tmp_path.glob(".*")), "no temporary files left behind"

    def must_not_measure(*args, **kwargs):   # noqa: ANN002, ANN003, ANN202
        raise AssertionError("re-measured a cached curve")

    monkeypatch.setattr(cost_mod, "measure_curve", must_not_measure)
    again = load_or_measure(model, "tiny", "cpu", "float32", same, cache_dir=tmp_path)  # same bucket
    assert again == first

    monkeypatch.setattr(cost_mod, "measure_curve", quick_measure)
    load_or_measure(model, "tiny", "cpu", "float32", 100_000, cache_dir=tmp_path)        # another bucket
    assert calls == [small, large]
    assert len(list(tmp_path.glob("*.json"))) == 2

    files[0].write_text("{not json")                                                      # corrupt file
    repaired = load_or_measure(model, "tiny", "cpu", "float32", 100, cache_dir=tmp_path)
    assert calls == [small, large, small] and repaired.sizes == [1, 2, 8]
    assert json.loads(files[0].read_text())["sizes"] == [1, 2, 8]


def test_a_curve_measured_on_a_busy_machine_is_measured_again(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe timed beside a cached curve ran 2x slower than it runs now: the curve is re-measured."""
    model = tiny_llama(0)
    real = cost_mod.measure_curve
    calls: list[float] = []
    probe = {"now": 0.002}
    monkeypatch.setattr(cost_mod, "machine_probe", lambda: probe["now"])
    monkeypatch.setattr(cost_mod, "TRUSTED_FOR_S", 0.0)

    def quick_measure(model, context_len, key="", **kwargs):   # noqa: ANN001, ANN202
        calls.append(probe["now"])
        return real(model, context_len, sizes=(1, 2), repeats=1, key=key, progress=False)

    monkeypatch.setattr(cost_mod, "measure_curve", quick_measure)
    busy = load_or_measure(model, "tiny", "cpu", "float32", 100, cache_dir=tmp_path)
    assert busy.probe_s == 0.002 and calls == [0.002]
    probe["now"] = 0.0019                                    # within the ratio: trusted
    load_or_measure(model, "tiny", "cpu", "float32", 100, cache_dir=tmp_path)
    assert calls == [0.002]
    probe["now"] = 0.001                                     # the machine is twice as fast now
    fresh = load_or_measure(model, "tiny", "cpu", "float32", 100, cache_dir=tmp_path)
    assert calls == [0.002, 0.001] and fresh.probe_s == 0.001
    stored = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert stored["probe_s"] == 0.001, "the re-measured curve replaced the busy one on disk"


# ------------------------------------------------------------------------------------------------------
# acceptance estimates and sizing
# ------------------------------------------------------------------------------------------------------

def chain(n: int, source: str = "s", score: float = 0.9) -> DraftTree:
    return DraftTree.chain(0, list(range(1, n + 1)), source, scores=[score ** (i + 1) for i in range(n)])


def test_estimator_learns_accept_and_reject_rates() -> None:
    good, bad = AcceptanceEstimator(), AcceptanceEstimator()
    tree = chain(1)
    key = good.node_keys(tree)[1]
    assert key is not None and key[:3] == ("s", 1, 0)
    prior_mean = good.prior[0] / sum(good.prior)
    assert good.rate(key) == pytest.approx(prior_mean)
    for _ in range(200):
        good.update(tree, [1])
        bad.update(tree, [])
    assert good.rate(key) > 0.9
    assert bad.rate(key) < 0.1


def test_estimator_only_counts_tried_nodes_and_decays_to_prior() -> None:
    est = AcceptanceEstimator()
    tree = chain(3)
    keys = est.node_keys(tree)
    for _ in range(50):
        est.update(tree, [])          # node 1 rejected: nodes 2 and 3 were never tried
    assert keys[1] in est.counts and keys[2] not in est.counts and keys[3] not in est.counts
    probs = est.path_probs(tree)
    assert probs[0] == 1.0
    assert probs[2] == pytest.approx(probs[1] * est.rate(keys[2]))
    assert probs[3] == pytest.approx(probs[2] * est.rate(keys[3]))
    low = est.rate(keys[1])
    other = chain(1, source="t")
    for _ in range(400):
        est.update(other, [1])        # keys[1] (and its coarse bucket) no longer tried: back to the prior mean
    assert est.rate(keys[1]) > low
    assert est.rate(keys[1]) == pytest.approx(est.prior[0] / sum(est.prior), abs=0.02)


def test_untried_depth_starts_from_the_shallower_depths_rate() -> None:
    """A source right at depths 1-3 whose depth 4 was never verified: depth 4 is guessed from depth 3, not
    from the 0.4 prior, so a sizer tries it (otherwise it would stay untried for good); once depth 4 is
    tried and rejected, its own evidence wins."""
    est = AcceptanceEstimator()
    short, long = chain(3, score=1.0), chain(6, score=1.0)
    for _ in range(40):
        est.update(short, [1, 2, 3])
    keys = est.node_keys(long)
    prior_mean = est.prior[0] / sum(est.prior)
    assert keys[4] not in est.counts
    assert est.rate(keys[3]) > 0.9
    assert est.rate(keys[4]) > 0.9 and est.rate(keys[6]) > 0.9
    assert AcceptanceEstimator().rate(keys[4]) == pytest.approx(prior_mean)
    for _ in range(40):
        est.update(long, [1, 2, 3])   # depth 4 tried and rejected every time
    assert est.rate(keys[4]) < 0.2
    assert est.rate(keys[3]) > 0.9


@dataclass
class FixedEstimate(AcceptanceEstimator):
    """Every node's p̂ is `p`, whatever was learnt: the calibration alone is under test."""

    p: float = 0.9

    def path_probs(self, tree: DraftTree) -> list[float]:
        return [1.0] + [self.p] * (len(tree) - 1)


def bushy(n: int) -> DraftTree:
    tree = DraftTree.root_only(0)
    for token in range(1, n + 1):
        tree.add(0, token, "s")
    return tree


def test_the_estimator_learns_how_each_place_of_its_ranking_fares() -> None:
    """Side branches ranked 8th and later predicted at 0.9 and never accepted: their places' factor falls
    toward 0, the first place (accepted every time) keeps at least its own; with no evidence every factor is 1."""
    est = FixedEstimate()
    assert [est.position_factor(k, main) for k in (1, 2, 8, 40) for main in (True, False)] == [1.0] * 8
    for _ in range(30):
        est.update(bushy(12), [1])
    assert est.position_factor(1) >= 1.0
    assert est.position_factor(8, main=False) < 0.15 and est.position_factor(12, main=False) < 0.15
    assert est.calibrated([0.9, 0.9], start=7, mains=[False, False]) == pytest.approx(
        [0.9 * est.position_factor(8, main=False)] * 2)


def test_a_chain_is_not_calibrated_by_the_side_branches_that_failed_at_its_places() -> None:
    """Bushy trees whose 2nd-7th guesses (side branches) always fail, then a copied chain accepted whole: the
    chain's 4th-7th tokens keep their own factor, and the sizer still verifies the whole chain. Pooled by place
    alone, the bushes' misses cut such chains at 3 tokens, step after step (LongBench docqa)."""
    curve = CostCurve(key="cpu", context_len=256, sizes=[1, 4, 5, 8, 12],
                      latency_s=[0.040, 0.045, 0.051, 0.060, 0.076])
    sizer = CostAwareSizer(lambda n: curve, estimator=FixedEstimate(p=0.6))
    for _ in range(30):
        sizer.observe(bushy(7), [1], overhead_s=0.0)
    est = sizer.estimator
    assert est.position_factor(4, main=False) < 0.3
    assert est.position_factor(4, main=True) == pytest.approx(1.0)
    assert sizer.cut(chain(8), 100).num_draft_tokens == 8


def test_no_layer_is_grown_under_side_branches_that_never_paid() -> None:
    """The look-ahead calibrates as the cut does: after bushes whose side branches always failed, a child
    under the main line still pays for its forward and one under a side branch does not. Calibrated as if every
    node were on the main line, the side branch was grown at every draft forward cost."""
    curve = CostCurve(key="cpu", context_len=256, sizes=[1, 4, 5, 8, 12],
                      latency_s=[0.040, 0.045, 0.051, 0.060, 0.076])
    sizer = CostAwareSizer(lambda n: curve, estimator=FixedEstimate(p=0.6))
    for _ in range(30):
        sizer.observe(bushy(7), [1], overhead_s=0.0)
    for forward_s in (0.0005, 0.005):
        assert sizer.grow_pays(bushy(2), [1], 100, forward_s=forward_s)
        assert not sizer.grow_pays(bushy(2), [2], 100, forward_s=forward_s)


def test_a_sizer_stops_verifying_big_trees_that_never_paid() -> None:
    """The sizer picks a big tree exactly when its estimates are high, so their errors pile up there: once the
    places past the first have been seen to fail, the same estimates no longer buy a 13-token tree."""
    curve = CostCurve(key="mild", context_len=256, sizes=[1, 8, 16, 33],
                      latency_s=[0.05 * (1 + 0.05 * (s - 1)) for s in (1, 8, 16, 33)])
    sizer = CostAwareSizer(lambda n: curve, estimator=FixedEstimate())
    assert sizer.cut(bushy(12), 100).num_draft_tokens == 12
    for _ in range(30):
        sizer.observe(bushy(12), [1], overhead_s=0.0)
    assert 1 <= sizer.cut(bushy(12), 100).num_draft_tokens < 8


def test_a_nodes_rank_is_its_place_among_its_own_sources_siblings_by_score() -> None:
    """A fused tree's draft children come first: the copied continuation beside them is still its source's
    likeliest (rank 0), bucketed as it is in a tree of its own; within a source the higher score ranks first."""
    from rasd.decoding.sizing.acceptance import sibling_ranks

    alone = DraftTree.root_only(0)
    alone.add(0, 7, "context", 0.2)            # found first, one occurrence of five
    alone.add(0, 8, "context", 0.8)            # four occurrences
    fused = DraftTree.root_only(0)
    for token in (1, 2, 3):
        fused.add(0, token, "eagle", 0.5 - 0.1 * token)
    fused.add(0, 7, "context", 0.2)
    fused.add(0, 8, "context", 0.8)
    assert sibling_ranks(alone) == [0, 1, 0]
    assert sibling_ranks(fused) == [0, 0, 1, 2, 1, 0]
    est = AcceptanceEstimator()
    assert est.node_keys(fused)[4:] == est.node_keys(alone)[1:]


def flat(context_len: int) -> CostCurve:
    return CostCurve(key="flat", context_len=256, sizes=[1, 8, 16, 33], latency_s=[0.05] * 4)


def steep(context_len: int) -> CostCurve:
    return CostCurve(key="steep", context_len=256, sizes=[1, 8, 16, 33], latency_s=[0.05 * s for s in (1, 8, 16, 33)])


def trained_sizer(curve_for, accept: bool, max_nodes: int = 64) -> CostAwareSizer:   # noqa: ANN001
    sizer = CostAwareSizer(curve_for, max_nodes=max_nodes, estimator=AcceptanceEstimator())
    tree = chain(12)
    for _ in range(200):
        sizer.observe(tree, list(range(1, 13)) if accept else [], overhead_s=0.0)
    return sizer


def test_sizer_speculates_when_drafts_are_accepted_on_a_flat_curve() -> None:
    sizer = trained_sizer(flat, accept=True)
    assert sizer.budget(100) == 32
    cut = sizer.cut(chain(12), 100)
    assert cut.num_draft_tokens == 12 and sizer.last_choice == (12, 12)
    assert trained_sizer(flat, accept=True, max_nodes=5).cut(chain(12), 100).num_draft_tokens == 5


def test_sizer_falls_back_to_plain_decoding_when_drafts_fail() -> None:
    sizer = trained_sizer(flat, accept=False)
    cut = sizer.cut(chain(12), 100)
    assert cut.num_draft_tokens == 0 and cut.tokens == [0]
    assert sizer.last_choice == (12, 0)


def test_sizer_refuses_trees_that_cost_more_than_they_can_gain() -> None:
    """On a curve where every token costs a full step, even certain acceptance cannot beat plain decoding."""
    sizer = trained_sizer(steep, accept=True)
    assert sizer.cut(chain(12), 100).num_draft_tokens == 0


def test_sizer_cut_is_prefix_closed_and_keeps_the_likely_branch() -> None:
    sizer = trained_sizer(flat, accept=True)
    tree = chain(6)
    tree.add(0, 50, "never")                 # an unknown source at the prior's rate
    for _ in range(200):                     # ... that is learned to be always rejected
        sizer.estimator.update(tree, list(range(1, 7)))
    cut = sizer.cut(tree, 100)
    assert cut.tokens[:7] == tree.tokens[:7]
    for i in range(1, len(cut)):
        assert 0 <= cut.parents[i] < i
    assert sizer.cut(DraftTree.root_only(3), 100).tokens == [3]


def test_sizer_never_drops_sampled_nodes_whatever_their_estimate() -> None:
    """A node sampled from q must be kept or dropped independently of its token, or sampling is biased.

    Even on a curve where speculation never pays and with drafts learnt to fail, the sampled chain stays;
    only the deterministic nodes grafted beside it are ranked and cut.
    """
    import torch

    sizer = trained_sizer(steep, accept=False)
    tree = chain(3)
    for i in range(1, 4):
        tree.q[i] = torch.full((8,), 1 / 8)
    tree.add(0, 77, "datastore")
    cut = sizer.cut(tree, 100)
    assert cut.tokens[:4] == tree.tokens[:4] and sorted(cut.q) == [1, 2, 3]
    assert sizer.last_choice[1] >= 3


def test_grow_pays_weighs_the_next_layer_against_its_forward() -> None:
    """One more draft layer pays where its likely children are cheap to verify and the forward is cheap; not
    where verifying them costs a step each, nor where the draft forward costs as much as the gain."""
    certain = trained_sizer(flat, accept=True)
    tree = chain(2)
    assert certain.grow_pays(tree, [2], 100, forward_s=0.001)
    assert not certain.grow_pays(tree, [2], 100, forward_s=0.2)          # the forward costs 4 target steps
    assert not trained_sizer(steep, accept=True).grow_pays(tree, [2], 100, forward_s=0.001)
    assert not trained_sizer(flat, accept=False).grow_pays(tree, [2], 100, forward_s=0.001)


def test_a_grow_rule_travels_and_decides_like_its_sizer() -> None:
    """The rule a draft worker receives (pickled, as Ray sends it) answers as the sizer itself would."""
    import pickle

    tree = chain(2)
    for sizer in (trained_sizer(flat, accept=True), trained_sizer(steep, accept=True),
                  trained_sizer(flat, accept=False)):
        rule = pickle.loads(pickle.dumps(sizer.grow_rule(100)))
        assert len(rule.step_s) == sizer.budget(100) + 1
        for forward_s in (0.001, 0.2):
            want = sizer.grow_pays(tree, [2], 100, forward_s)
            assert rule(tree, [2], 100, forward_s) == want == rule.pays(tree, [2], forward_s)


def test_sizer_observe_tracks_overhead() -> None:
    sizer = CostAwareSizer(flat)
    sizer.observe(chain(1), [], overhead_s=0.01)
    assert sizer.overhead_s == pytest.approx(0.01)
    sizer.observe(chain(1), [], overhead_s=0.02)
    assert sizer.overhead_s == pytest.approx(0.011)


def test_fixed_sizer() -> None:
    sizer = FixedSizer(3)
    assert sizer.budget(10) == 3
    tree = chain(6)
    assert sizer.cut(tree, 10).tokens == [0, 1, 2, 3]
    sizer.observe(tree, [1], 0.1)   # learns nothing, raises nothing


def test_sizer_exploration_backs_off_while_it_finds_nothing_and_resets_on_success() -> None:
    """Failed explorations double the wait (bounded); one accepted exploration restores the base interval."""
    sizer = trained_sizer(steep, accept=False)
    sizer.explore_every = 4

    def steps_until_exploration() -> int:
        for n in range(1, 200):
            cut = sizer.cut(chain(6), 100)
            if cut.num_draft_tokens:
                return n
            sizer.observe(cut, [], overhead_s=0.0)
        raise AssertionError("never explored")

    waits = []
    for _ in range(3):
        waits.append(steps_until_exploration())
        sizer.observe(chain(4), [], overhead_s=0.0)        # the exploration got nothing accepted
    assert waits == [4, 8, 16]
    steps_until_exploration()
    sizer.observe(chain(4), [1], overhead_s=0.0)           # ... this one did
    assert steps_until_exploration() == 4


def test_unseen_fine_bucket_falls_back_to_its_source_and_depth_rate() -> None:
    """A rarely-accepted source's nodes in a new (rank, confidence) bucket start at the source's own low rate,
    not at the optimistic prior; another source at the same depth keeps the prior."""
    est = AcceptanceEstimator()
    seen = chain(1, source="junk", score=0.9)
    for _ in range(100):
        est.update(seen, [])
    unseen = chain(1, source="junk", score=0.1)            # another confidence bucket, same source and depth
    key_seen, key_unseen = est.node_keys(seen)[1], est.node_keys(unseen)[1]
    assert key_seen != key_unseen and key_unseen not in est.counts
    assert est.rate(key_unseen) < 0.1
    assert est.rate(est.node_keys(chain(1, source="other"))[1]) == pytest.approx(est.prior[0] / sum(est.prior))


def test_a_checked_curve_is_trusted_for_a_while_in_the_process(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoder per request must not re-read the file and re-time the probe each time (≈ 12 ms)."""
    model = tiny_llama(0)
    real = cost_mod.measure_curve
    probes: list[int] = []

    def probe() -> float:
        probes.append(1)
        return 0.001

    monkeypatch.setattr(cost_mod, "machine_probe", probe)
    monkeypatch.setattr(cost_mod, "measure_curve",
                        lambda model, context_len, key="", **kw: real(model, context_len, sizes=(1, 2), repeats=1,
                                                                      key=key, progress=False))
    first = load_or_measure(model, "tiny", "cpu", "float32", 100, cache_dir=tmp_path)
    checked = len(probes)
    assert load_or_measure(model, "tiny", "cpu", "float32", 100, cache_dir=tmp_path) is first
    assert len(probes) == checked, "trusted: no second probe"
    monkeypatch.setattr(cost_mod, "TRUSTED_FOR_S", 0.0)     # time is up: read and checked again
    again = load_or_measure(model, "tiny", "cpu", "float32", 100, cache_dir=tmp_path)
    assert again == first and again is not first and len(probes) == checked + 1


def test_root_pays_asks_of_the_first_forward_what_grow_pays_asks_of_later_ones() -> None:
    """A drafter's first forward of a step pays where its depth-1 node is often right and the forward is cheap;
    not where it is never right, nor where the forward costs as much as the node is worth. The source named is
    the one whose rate counts (the root itself has none)."""
    assert trained_sizer(flat, accept=True).root_pays(0, "s", 100, forward_s=0.001)
    assert not trained_sizer(flat, accept=True).root_pays(0, "s", 100, forward_s=0.2)
    assert not trained_sizer(flat, accept=False).root_pays(0, "s", 100, forward_s=0.001)
    assert trained_sizer(flat, accept=False).root_pays(0, "never-seen", 100, forward_s=0.001)   # the prior


def test_the_look_ahead_rates_a_hypothetical_child_as_a_likeliest_child() -> None:
    """Three siblings verified a step, the likeliest right 30% of the time and the others never: the pooled
    depth-1 rate falls near 0.1, but the one child a look-ahead adds is a likeliest child, so `root_pays` and
    `grow_pays` use rank 0's rate. With a forward that costs a tenth of a step, the first forward pays (it is
    refused when the pooled rate stands in; the old rule)."""
    sizer = CostAwareSizer(flat, estimator=AcceptanceEstimator())
    fan = DraftTree.root_only(0)
    for token in (1, 2, 3):
        fan.add(0, token, "s", 0.3)
    for step in range(300):
        sizer.observe(fan, [1] if step % 10 < 3 else [], overhead_s=0.0)
    est = sizer.estimator
    assert est.coarse_rates("s")[1] < 0.15 and est.coarse_rates("s", top=True)[1] == pytest.approx(0.3, abs=0.05)
    assert sizer.root_pays(0, "s", 100, forward_s=0.005)
    pooled = est.coarse_rates
    est.coarse_rates = lambda source, top=False: pooled(source)   # the old rule: every sibling's rate pooled
    assert not sizer.root_pays(0, "s", 100, forward_s=0.005)


def test_a_drafter_beside_a_confident_free_source_does_not_pay_for_its_forward() -> None:
    """`root_pays` with the step's free nodes: a drafter right 45% of the time pays for a cheap forward on its
    own, but not beside the request's own text, whose next token is accepted 90% of the time (a new child
    adds at most the 10% that one leaves). Beside a weak match it still pays."""
    sizer = CostAwareSizer(flat, estimator=AcceptanceEstimator())
    one = DraftTree.root_only(0)
    one.add(0, 1, "head", 0.5)
    strong, weak = DraftTree.root_only(0), DraftTree.root_only(0)
    strong.add(0, 2, "context", 0.9)
    weak.add(0, 3, "context", 0.2)
    for step in range(300):
        sizer.observe(one, [1] if step % 20 < 9 else [], overhead_s=0.0)
        sizer.observe(strong, [1] if step % 10 < 9 else [], overhead_s=0.0)
    sizer.observe(weak, [], overhead_s=0.0)
    assert sizer.root_pays(0, "head", 100, forward_s=0.008)
    assert not sizer.root_pays(0, "head", 100, forward_s=0.008, tree=strong)
    assert sizer.root_pays(0, "head", 100, forward_s=0.008, tree=weak)


def test_a_refused_drafter_is_let_through_now_and_then_and_its_likeliest_child_is_verified() -> None:
    """A refused drafter brings no evidence, so every `explore_every × backoff` refused steps it drafts anyway,
    and the next cut verifies its likeliest depth-1 child (the probe) whatever its estimate, and only that; the
    interval doubles (bounded) each time the probe is rejected and restarts when one is accepted. Why on the
    verdict, not on the rule refusing again: one rejection lowers the rate, so the rule refused after nearly
    every probe and the interval reached its bound within a prompt; `eagle` then kept its head off through
    whole Spec-Bench categories where one head node a step was accepted 40% of the time."""
    def cpu(context_len: int) -> CostCurve:   # a second token costs a fifth of a step, more cost much more
        return CostCurve(key="cpu", context_len=256, sizes=[1, 2, 8, 16], latency_s=[0.05, 0.06, 0.4, 0.8])

    sizer = CostAwareSizer(cpu, estimator=AcceptanceEstimator())
    sizer.explore_every, sizer.max_backoff = 3, 4
    sizer.refused_keep = 1.0                                 # the probe alone here (the drift: the next test)
    for _ in range(200):                                     # the drafter and another source, never right
        sizer.observe(chain(12), [], overhead_s=0.0)
        sizer.observe(chain(3, "other"), [], overhead_s=0.0)
    bush = DraftTree.root_only(0)            # the drafter's one child of the root (2) has a child of its own
    for token, source in ((1, "other"), (2, "s"), (3, "other")):
        bush.add(0, token, source, 0.5)
    bush.add(2, 4, "s", 0.4)

    def probe(accepted: bool) -> int:
        """Steps until the drafter is let through; then the probe's verdict."""
        for n in range(1, 100):
            if sizer.root_pays(0, "s", 100, forward_s=0.001):
                cut = sizer.cut(bush, 100)
                assert cut.tokens == [0, 2], "only the drafter's likeliest depth-1 child is verified"
                sizer.observe(cut, [1] if accepted else [], overhead_s=0.0)
                return n
        raise AssertionError("never let through")

    assert [probe(accepted=False) for _ in range(4)] == [3, 6, 12, 12]
    assert probe(accepted=True) == 12
    assert probe(accepted=False) == 3                        # the accepted probe restarted the interval
    for _ in range(300):                                     # the source turns out right after all
        sizer.observe(chain(12), list(range(1, 13)), overhead_s=0.0)
    assert sizer.root_pays(0, "s", 100, forward_s=0.001)


def test_a_refused_source_drifts_back_to_being_tried_and_other_sources_keep_what_was_learnt() -> None:
    """Every refused step keeps `refused_keep` of what was learnt about the refused source, so a rate learnt on
    text where the drafter was wrong does not outlive that text: the rule itself (not a probe) lets the drafter
    through again after a few dozen refused steps. Why: after two Spec-Bench translation prompts `eagle` stayed
    off through the summarization and QA prompts that followed. Without the drift it stays refused."""
    def cpu(context_len: int) -> CostCurve:
        return CostCurve(key="cpu", context_len=256, sizes=[1, 2, 8, 16], latency_s=[0.05, 0.06, 0.4, 0.8])

    def refused_steps(keep: float) -> tuple[int | None, float]:
        """Refused steps until the rule lets the drafter through (None: not in 200), and the other source's
        depth-1 rate then."""
        sizer = CostAwareSizer(cpu, estimator=AcceptanceEstimator())
        sizer.explore_every, sizer.max_backoff, sizer.refused_keep = 10_000, 1, keep   # no probes
        for _ in range(200):
            sizer.observe(chain(3), [], overhead_s=0.0)                # the drafter "s": never right
            sizer.observe(chain(3, "other"), [1], overhead_s=0.0)      # another source: right at depth 1
        other = sizer.estimator.coarse_rates("other")[1]
        assert not sizer.root_pays(0, "s", 100, forward_s=0.001)
        for n in range(1, 200):
            if sizer.root_pays(0, "s", 100, forward_s=0.001):
                return n, other - sizer.estimator.coarse_rates("other")[1]
        return None, other - sizer.estimator.coarse_rates("other")[1]

    steps, other_moved = refused_steps(0.95)
    assert steps is not None and steps <= 100
    assert other_moved == 0.0, "only the refused source forgets"
    assert refused_steps(1.0)[0] is None


@pytest.mark.parametrize("single_faster", [True, False])
def test_measured_speed_picks_between_the_sizers_trees_and_one_drafter_node_a_step(single_faster: bool) -> None:
    """With the one-node arm (`use_single_node_arm`), blocks of steps alternate at first, then the arm that
    committed more tokens per second (measured on the clock, not predicted) takes most steps. In a one-node step
    the drafter grows no layer and `cut` keeps its likeliest depth-1 child alone, whatever the estimates; in a tree
    step the sizer sizes as usual. Why: on a 2-core CPU one head node a step beat the sizer's trees in five of
    five Spec-Bench runs, on a flat GPU curve the trees win; only the host's own clock knows which it is."""
    now = [0.0]
    sizer = trained_sizer(flat, accept=True)      # its own trees: many nodes
    sizer.use_single_node_arm(block=2)
    assert sizer.single_arm is not None
    sizer.single_arm.clock = lambda: now[0]
    bush = DraftTree.root_only(0)
    for token, score in ((1, 0.3), (2, 0.6), (3, 0.2)):   # the likeliest depth-1 child is node 2 (token 2)
        bush.add(0, token, "s", score)
    bush.add(2, 4, "s", 0.5)
    bush.add(4, 5, "s", 0.4)
    context, single_steps = 100, 0
    for _ in range(60):
        assert sizer.root_pays(0, "s", context, forward_s=0.001)
        single = sizer._single is not None
        assert not (single and sizer.grow_pays(bush, [4], context, forward_s=0.0)), "one node: no layer grown"
        cut = sizer.cut(bush, context)
        if single:
            assert cut.tokens == [0, 2], "one node: the drafter's likeliest depth-1 child alone"
            single_steps += 1
        else:
            assert len(cut) > 2, "a tree step is sized as usual (a flat curve, a source always right)"
        sizer.observe(cut, [1], overhead_s=0.0)   # the source stays right at depth 1
        fast = single == single_faster
        now[0] += 1.0 if fast else 3.0            # both commit 2 tokens; one arm takes three times as long
        context += 2
    assert (single_steps > 40) if single_faster else (single_steps < 20)
    assert sizer.root_pays(0, "s", context, forward_s=0.001, tree=bush) is not None   # beside free nodes: no arm
    assert sizer._single is None


def test_the_one_node_arm_is_asked_where_no_free_source_has_candidates() -> None:
    """`rasd` passes its free candidates to `root_pays`: where they are none (nothing copied), the one-node arm
    decides as for `eagle`; beside copied nodes it is not asked, and the step it skipped is credited to no arm."""
    now = [0.0]
    sizer = trained_sizer(flat, accept=True)
    sizer.use_single_node_arm(block=1)
    assert sizer.single_arm is not None
    sizer.single_arm.clock = lambda: now[0]
    empty, copied = DraftTree.root_only(0), chain(2, "context")
    arms = []
    for step in range(4):            # blocks of 1: the tree arm, then the one-node arm, then their leader
        assert sizer.root_pays(0, "s", 100 + 2 * step, forward_s=0.001, tree=empty)
        arms.append(sizer.single_step)
        sizer.cut(chain(3), 100 + 2 * step)
        sizer.observe(chain(1), [1], overhead_s=0.0)
        now[0] += 1.0
    assert arms[:2] == [None, "s"], "an empty free tree is asked like no free tree"
    pulls = sum(sizer.single_arm.choices.values())
    sizer.root_pays(0, "s", 108, forward_s=0.001, tree=copied)
    assert sizer.single_step is None and sum(sizer.single_arm.choices.values()) == pulls, "beside copies: not asked"
    sizer.cut(chain(3), 108)
    sizer.observe(chain(1), [1], overhead_s=0.0)
    credited = {arm: stats.pulls for arm, stats in sizer.single_arm.buckets[0].arms.items()}
    sizer.root_pays(0, "s", 112, forward_s=0.001, tree=empty)
    assert {arm: stats.pulls for arm, stats in sizer.single_arm.buckets[0].arms.items()} == credited, \
        "the step before the copied one is not credited with it"


def test_one_slow_verification_does_not_lock_a_tree_size_out_for_good() -> None:
    """A 2-token tree once verified ten times slower than its curve (a first use of a shape, a busy second)
    makes such trees too dear for a while; plain steps at the curve's speed bring the class back, so the
    sizer verifies them again (before, the class was never observed again and stayed locked out)."""
    sizer = trained_sizer(flat, accept=True)
    plain, one = DraftTree.root_only(0), chain(1)

    def plain_steps(n: int) -> None:
        for _ in range(n):
            sizer.cut(plain, 100)
            sizer.observe(plain, [], overhead_s=0.0, verify_s=flat(100).latency(1))

    plain_steps(20)
    assert sizer.cut(one, 100).num_draft_tokens == 1
    sizer.observe(one, [1], overhead_s=0.0, verify_s=10 * flat(100).latency(2))
    assert sizer.cut(one, 100).num_draft_tokens == 0
    plain_steps(200)
    assert sizer.cut(one, 100).num_draft_tokens == 1


def test_siblings_share_one_parents_chance_so_their_estimates_never_sum_past_it() -> None:
    """At most one child of a node is accepted: however many candidate continuations a proposer offers, their p̂
    sum to no more than their parent's, and the sizer keeps fewer of them on a curve where tokens cost time."""
    est = AcceptanceEstimator()
    wide = DraftTree.root_only(0)
    first = wide.add(0, 1, "s", 0.9)
    for token in range(2, 12):                    # ten siblings under the first node, from one source
        wide.add(first, token, "s", 0.9)
    for _ in range(100):                          # the source is right two times in three
        est.update(chain(3), [1, 2])
    probs = est.path_probs(wide)
    assert sum(probs[2:]) == pytest.approx(probs[first])              # their rates summed past 1: scaled to 1
    assert probs[first] == pytest.approx(est.rate(est.node_keys(wide)[1]))
    assert probs[2] == pytest.approx(probs[first] * est.rate(est.node_keys(wide)[2]))   # the likeliest keeps its own
    assert probs[2] > probs[5] > 0
    sizer = CostAwareSizer(lambda n: CostCurve(key="c", context_len=256, sizes=[1, 2, 4, 8, 16],
                                               latency_s=[0.025, 0.025, 0.03, 0.05, 0.07]),
                           estimator=est)
    assert sizer.cut(wide, 100).num_draft_tokens <= 4
