"""Token Recycling: the adjacency-matrix update, the template and OPT-Tree gathers, persistence, and
greedy/sampling exactness of `recycling` and of `rasd` with recycling as a source."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from rasd.decoding.proposers import ProposerBase, RecyclingMatrix, RecyclingProposer, make_proposer
from rasd.decoding.proposers.recycling import RANK_PRIOR, template
from rasd.decoding.runtime.engine import SpeculativeDecoder
from rasd.decoding.sizing.sizers import FixedSizer
from rasd.decoding.step.sampling import SamplingParams
from rasd.decoding.step.tree import DraftTree
from rasd.decoding.step.verify import Verdict
from rasd.index.suffix_array import SuffixArray
from tests.decoding.test_sampling_exact import PROMPT, SVOCAB, TARGET, Recording, check_against_exact, exact_joint
from tests.helpers import TINY_VOCAB, assert_greedy_equal, hf_greedy, random_prompt, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------------ matrix


def hand_matrix() -> RecyclingMatrix:
    """Vocabulary 10, k 3: row t = (t+1, t+2, t+3) with probabilities (0.5, 0.3, 0.1); row 9 unseen."""
    m = RecyclingMatrix(10, k=3)
    for t in range(9):
        m.tokens[t] = torch.tensor([(t + 1) % 10, (t + 2) % 10, (t + 3) % 10], dtype=torch.int32)
        m.probs[t] = torch.tensor([0.5, 0.3, 0.1], dtype=torch.float16)
    return m


def test_update_writes_the_top_k_of_every_node_last_write_wins() -> None:
    m = RecyclingMatrix(6, k=2)
    logits = torch.tensor([[0.0, 5, 1, 0, 0, 0],      # after token 3: top 1, 2
                           [9.0, 0, 0, 0, 8, 0],      # after token 4: top 0, 4
                           [0.0, 0, 0, 7, 0, 6]])     # after token 3 again: top 3, 5 (overwrites)
    m.update([3, 4, 3], logits)
    assert m.tokens[3].tolist() == [3, 5] and m.tokens[4].tolist() == [0, 4]
    assert m.tokens[0].tolist() == [-1, -1] and not m.known(0) and m.known(4)
    expected = torch.softmax(logits[1, [0, 4]], -1)          # renormalised over the kept top k
    torch.testing.assert_close(m.probs[4].float(), expected, atol=1e-3, rtol=0)
    root = m.root_probs(4)
    assert root is not None and root.shape == (6,) and root[1] == 0 and root[0] > 0.5
    assert m.root_probs(1) is None


def test_rows_with_non_finite_logits_are_not_recycled_and_a_saved_nan_row_is_dropped(tmp_path: Path) -> None:
    """NaN/inf logits must not reach the shared, persisted matrix; one that an older version saved is read as
    unseen. (Seen on the service: a NaN row for token 0 on disk, and a step's sizing then failed on NaN scores.)"""
    m = RecyclingMatrix(6, k=2)
    logits = torch.tensor([[0.0, 5, 1, 0, 0, 0],
                           [float("nan")] * 6,
                           [float("-inf")] * 6,
                           [0.0, 0, 0, 7, float("inf"), 6]])
    m.update([3, 4, 0, 5], logits)
    assert m.tokens[3].tolist() == [1, 2]
    assert not m.known(4) and not m.known(0) and not m.known(5)
    assert torch.isfinite(m.probs).all()
    m.probs[3] = float("nan")                          # what an unguarded update could have saved
    m.save(tmp_path / "rec.npz")
    back = RecyclingMatrix.load(tmp_path / "rec.npz", 6, k=2)
    assert not back.known(3) and torch.isfinite(back.probs).all()
    tree = RecyclingProposer(back).propose([1, 3], 8)
    assert len(tree) == 1                              # unseen: nothing recycled after it


def test_node_buckets_survive_nan_and_overflowing_scores() -> None:
    from rasd.decoding.sizing.acceptance import AcceptanceEstimator

    tree = DraftTree.root_only(1)
    a = tree.add(0, 2, "recycling", 1e-310)
    tree.add(a, 3, "recycling", 0.5)                   # 0.5 / 1e-310 overflows to inf
    tree.add(a, 4, "recycling", float("nan"))
    keys = AcceptanceEstimator().node_keys(tree)
    assert [k[3] for k in keys[1:]] == [0, 3, 0]


def test_observe_recycles_every_verified_node_accepted_or_not() -> None:
    m = RecyclingMatrix(TINY_VOCAB, k=4)
    proposer = RecyclingProposer(m)
    tree = DraftTree.chain(5, [7, 9], "x")
    tree.add(0, 11, "x")
    logits = torch.randn(len(tree), TINY_VOCAB)
    proposer.observe([1, 5, 7], tree, Verdict(accepted=[1], bonus=3), logits)
    for node, tok in enumerate(tree.tokens):
        assert m.tokens[tok].tolist() == logits[node].topk(4).indices.tolist()


def test_template_is_best_first_connected_and_prefix_stable() -> None:
    shape = template(20, k=8)
    assert len(shape) == 20
    assert shape[0] == (0, 0) and shape[1] == (1, 0)          # root's best child, then its best child
    for i, (parent, _) in enumerate(shape, start=1):
        assert parent < i
    assert template(12, k=8) == shape[:12]
    score = [1.0]
    for parent, rank in shape:
        score.append(score[parent] * RANK_PRIOR[rank])
    assert score[1:] == sorted(score[1:], reverse=True)


def test_template_tree_is_filled_by_gathers() -> None:
    tree = RecyclingProposer(hand_matrix(), shape="template").propose([4, 2], 6)
    shape = template(6, k=3)
    nodes = {0: 2}
    for i, (parent, rank) in enumerate(shape, start=1):
        nodes[i] = (nodes[parent] + 1 + rank) % 10
    expected = sorted(nodes[i] for i in range(1, 7))
    assert sorted(tree.tokens[1:]) == expected
    for i in range(1, len(tree)):
        parent_tok = tree.tokens[tree.parents[i]]
        assert tree.tokens[i] in [(parent_tok + 1) % 10, (parent_tok + 2) % 10, (parent_tok + 3) % 10]
    assert set(tree.sources[1:]) == {"recycling"}


def brute_force_top(m: RecyclingMatrix, root: int, n: int, depth: int) -> list[float]:
    """The n largest path products over the whole recycled tree down to `depth` (sorted, descending)."""
    scores: list[float] = []
    level = [(root, 1.0)]
    for _ in range(depth):
        nxt = []
        for tok, p in level:
            if not m.known(tok):
                continue
            for cand, q in zip(m.tokens[tok].tolist(), m.probs[tok].float().tolist(), strict=True):
                nxt.append((cand, p * q))
        scores += [p for _, p in nxt]
        level = nxt
    return sorted(scores, reverse=True)[:n]


@pytest.mark.parametrize("n", [1, 3, 7, 12])
def test_optree_tree_holds_the_n_largest_path_products(n: int) -> None:
    m = hand_matrix()
    tree = RecyclingProposer(m, shape="optree", max_depth=5).propose([0, 3], n)
    assert tree.num_draft_tokens == n
    got = sorted(tree.scores[1:], reverse=True)
    np.testing.assert_allclose(got, brute_force_top(m, 3, n, 5), rtol=1e-3)
    for i in range(1, len(tree)):                            # scores are path products of the rows
        parent = tree.parents[i]
        rank = m.tokens[tree.tokens[parent]].tolist().index(tree.tokens[i])
        assert tree.scores[i] == pytest.approx(tree.scores[parent] * float(m.probs[tree.tokens[parent], rank]),
                                               rel=1e-3)
    siblings = [(tree.parents[i], tree.tokens[i]) for i in range(1, len(tree))]
    assert len(siblings) == len(set(siblings))


def test_unseen_root_and_zero_budget_give_plain_decoding() -> None:
    m = hand_matrix()
    for shape in ("optree", "template"):
        proposer = RecyclingProposer(m, shape=shape)
        assert proposer.propose([1, 9], 8).num_draft_tokens == 0
        assert proposer.propose([1, 2], 0).num_draft_tokens == 0
    with pytest.raises(ValueError, match="shape"):
        RecyclingProposer(m, shape="star")
    with pytest.raises(ValueError, match="recycling matrix"):
        make_proposer("recycling")


# ------------------------------------------------------------------------------------------------ persistence


def test_save_load_round_trip_and_wrong_model(tmp_path: Path) -> None:
    m = hand_matrix()
    m.updates = 7
    path = tmp_path / "rec.npz"
    m.save(path)
    back = RecyclingMatrix.load(path, 10, k=3)
    assert torch.equal(back.tokens, m.tokens) and torch.equal(back.probs, m.probs) and back.updates == 7
    with pytest.raises(ValueError, match="another model"):
        RecyclingMatrix.load(path, 12, k=3)
    assert not RecyclingMatrix.load_or_new(path, 12, k=3).known(0)      # another model's file: cold start
    assert RecyclingMatrix.load_or_new(tmp_path / "missing.npz", 10, k=3).updates == 0
    (tmp_path / "bad.npz").write_bytes(b"not a matrix")
    assert RecyclingMatrix.load_or_new(tmp_path / "bad.npz", 10, k=3).updates == 0


def test_a_failed_save_leaves_the_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "rec.npz"
    hand_matrix().save(path)
    before = path.read_bytes()
    newer = RecyclingMatrix(10, k=3)

    def crash(src: str, dst: str) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk gone"):
        newer.save(path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["rec.npz"]


# ------------------------------------------------------------------------------------------------ decoding


def repeated_prompt(length: int, seed: int) -> list[int]:
    head = random_prompt(length - 10, seed)
    return head + head[:10]


@pytest.mark.parametrize("shape", ["optree", "template"])
@pytest.mark.parametrize("seed", [0, 1])
def test_recycling_greedy_equals_hf_and_hot_starts(shape: str, seed: int) -> None:
    """Two requests share one matrix: the second starts hot, and both equal HF greedy."""
    target = tiny_llama(seed)
    matrix = RecyclingMatrix(TINY_VOCAB, k=8)
    decoder = SpeculativeDecoder(target, make_proposer("recycling", recycling=matrix, shape=shape),
                                 sizer=FixedSizer(16))
    accepted = []
    for k, prompt in enumerate([repeated_prompt(40, seed), random_prompt(7, seed + 50)]):
        out = decoder.generate(prompt, 30)
        assert_greedy_equal(target, prompt, out.token_ids, hf_greedy(target, prompt, 30), f"{shape} req {k}")
        accepted.append(out.stats.accepted_by_source.get("recycling", 0))
    assert matrix.updates > 0
    assert sum(accepted) > 0, "recycling never got a token accepted on the tiny model"


def datastore_for(target: torch.nn.Module, prompt: list[int]) -> SuffixArray:
    """The target's own greedy continuation of a prompt (so retrieval nodes get accepted) plus noise."""
    ref = hf_greedy(target, prompt, 24)
    return SuffixArray.from_documents([prompt[-6:] + ref[:20], random_prompt(50, 77)])


@pytest.mark.parametrize(("prune_with", "flat"), [("counts", False), ("counts", True), ("recycling", True)])
def test_rasd_with_recycling_greedy_equals_hf(prune_with: str, flat: bool) -> None:
    """Lossless with recycled nodes as a fallback (a steep curve) and beside every match (a flat one)."""
    target = tiny_llama(0)
    prompt = repeated_prompt(40, 3)
    proposer = make_proposer("rasd", datastores=[datastore_for(target, prompt)],
                             recycling=RecyclingMatrix(TINY_VOCAB), prune_with=prune_with,
                             flat_curve=(lambda n: True) if flat else None)
    decoder = SpeculativeDecoder(target, proposer, sizer=FixedSizer(16))
    for n in (30, 30):                          # the second run starts with a hot matrix
        out = decoder.generate(prompt, n)
        assert_greedy_equal(target, prompt, out.token_ids, hf_greedy(target, prompt, n), f"rasd {prune_with}")
    by_source = out.stats.accepted_by_source
    assert by_source.get("datastore", 0) + by_source.get("context", 0) > 0, by_source


def test_rasd_recycles_only_as_a_fallback_by_default() -> None:
    """With a context match the recycled tree stays out; with none it is the whole proposal."""
    matrix = hand_matrix()
    proposer = make_proposer("rasd", recycling=matrix)
    proposer.start([1, 2, 3, 1, 2], SamplingParams())
    matched = proposer.propose([1, 2, 3, 1, 2], 8)             # "1 2" occurred before: context proposes 3
    assert "context" in matched.sources and "recycling" not in matched.sources
    proposer.start([5, 6], SamplingParams())
    unmatched = proposer.propose([5, 6], 8)
    assert set(unmatched.sources[1:]) == {"recycling"} and unmatched.num_draft_tokens == 8
    with pytest.raises(TypeError, match="recycle_when"):   # removed: `flat_curve` alone decides
        make_proposer("rasd", recycling=matrix, recycle_when="always")


@pytest.mark.parametrize("flat", [True, False])
def test_rasd_auto_recycles_beside_matches_only_on_a_flat_curve(flat: bool) -> None:
    """With `flat_curve` the cost curve (per context length) says whether extra recycled nodes are nearly free."""
    asked: list[int] = []

    def flat_curve(n: int) -> bool:
        asked.append(n)
        return flat

    proposer = make_proposer("rasd", recycling=hand_matrix(), flat_curve=flat_curve)
    proposer.start([1, 2, 3, 1, 2], SamplingParams())
    sources = set(proposer.propose([1, 2, 3, 1, 2], 8).sources)
    assert "context" in sources and ("recycling" in sources) == flat and asked == [5]


def test_curve_is_flat_and_build_decoder_asks_it_with_cost_sizing() -> None:
    from rasd.decoding.runtime.engine import build_decoder
    from rasd.decoding.sizing.cost import CostCurve, curve_is_flat

    gpu = CostCurve("gpu", 512, [1, 16, 64], [0.0268, 0.0269, 0.0276])      # measured on an H200
    cpu = CostCurve("cpu", 512, [1, 16, 64], [0.060, 0.105, 0.190])          # a 2-core CPU
    assert curve_is_flat(gpu) and not curve_is_flat(cpu)

    class Loaded:
        model, name, tokenizer, max_context, device, dtype = tiny_llama(0), "tiny", None, 512, "cpu", "float32"

    assert build_decoder(Loaded(), "rasd").proposer.flat_curve is not None
    assert build_decoder(Loaded(), "rasd", sizing="fixed").proposer.flat_curve is None


def test_rasd_prune_with_needs_its_source() -> None:
    with pytest.raises(ValueError, match="needs a draft source"):
        make_proposer("rasd", recycling=RecyclingMatrix(10), prune_with="draft")
    with pytest.raises(ValueError, match="unknown prune_with"):
        make_proposer("rasd", recycling=RecyclingMatrix(10), prune_with="magic")


def test_recycling_sampling_is_exact() -> None:
    """Temperature 1: recycled nodes are deterministic candidates; the first three tokens keep p exactly."""
    target = tiny_llama(**TARGET)
    params = SamplingParams(temperature=1.0)
    joint = exact_joint(target, PROMPT, params)
    proposer = Recording(make_proposer("recycling", recycling=RecyclingMatrix(SVOCAB, k=4)))
    decoder = SpeculativeDecoder(target, proposer, sizer=FixedSizer(8))
    counts = np.zeros((SVOCAB,) * 3)
    accepted = 0
    for i in range(1000):
        out = decoder.generate(PROMPT, 3, sampling=replace(params, seed=7_000_000 + 2 * i))
        a, b, c = out.token_ids
        counts[a, b, c] += 1
        accepted += out.stats.accepted_by_source.get("recycling", 0)
    assert proposer.max_root_children >= 2
    assert 50 < accepted < 1900, f"acceptances {accepted}: both outcomes must be exercised"
    check_against_exact(counts, joint, "recycling T=1")


class ChainDraft(ProposerBase):
    """A drafter that proposes a fixed chain (or nothing): which sources `rasd` adds beside a draft is pure logic."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def start(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        pass

    def propose(self, context: list[int], max_nodes: int) -> DraftTree:
        return DraftTree.chain(context[-1], self.tokens[:max_nodes], "draft")

    def root_probs(self, context: list[int]) -> None:
        return None


def test_rasd_recycles_beside_no_draft_tree_on_a_steep_curve() -> None:
    """The recycled tree is a fallback for steps where no source has a guess: a draft tree is one. (Drafts 0, 1:
    tokens the matrix does not propose after 6, so no node is credited to recycling instead.)"""
    for flat_curve in (None, lambda n: False):   # no curve (fixed sizing), a steep one
        drafting = make_proposer("rasd", recycling=hand_matrix(), draft_proposer=ChainDraft([0, 1]),
                                 flat_curve=flat_curve)
        drafting.start([5, 6], SamplingParams())
        assert drafting.propose([5, 6], 8).sources[1:] == ["draft", "draft"], flat_curve
        silent = make_proposer("rasd", recycling=hand_matrix(), draft_proposer=ChainDraft([]), flat_curve=flat_curve)
        silent.start([5, 6], SamplingParams())
        assert set(silent.propose([5, 6], 8).sources[1:]) == {"recycling"}, flat_curve
    flat = make_proposer("rasd", recycling=hand_matrix(), draft_proposer=ChainDraft([0, 1]),
                         flat_curve=lambda n: True)
    flat.start([5, 6], SamplingParams())
    assert {"draft", "recycling"} <= set(flat.propose([5, 6], 8).sources)
