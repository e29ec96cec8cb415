"""RASD pruning and fusion on hand-built trees, pruned-node statistics, and exact sampling with `rasd`.

Hand-built trees check the structural promises: longest-prefix grafting, the node budget, no duplicate
siblings, sources kept, sampled (q) nodes first and intact, how many nodes pruning removed. The sampling
test compares the first three tokens of `rasd` (an unrelated draft model + a datastore) with the exact joint
distribution of plain sampling (χ², as in test_sampling_exact.py), and a negative control shows the same
harness rejects the wrong fusion order (deterministic retrieval before the sampled draft node).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from rasd.decoding.drafting.fusion import PruneConfig, branch_of, fuse, graft_within, merge_trees, prune
from rasd.decoding.proposers import make_proposer
from rasd.decoding.runtime.engine import SpeculativeDecoder
from rasd.decoding.runtime.stats import DecodeStats
from rasd.decoding.sizing.sizers import FixedSizer
from rasd.decoding.step.sampling import SamplingParams
from rasd.decoding.step.tree import DraftTree
from rasd.index.suffix_array import SuffixArray
from tests.decoding.test_sampling_exact import (
    ALPHA,
    OTHER,
    PROMPT,
    SVOCAB,
    TARGET,
    WARPED,
    P,
    Q,
    Recording,
    check_against_exact,
    emitted,
    exact_joint,
)
from tests.helpers import hf_greedy, pooled_chisquare, random_prompt, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


def assert_well_formed(tree: DraftTree) -> None:
    """Topological order, no duplicate siblings, one source and score per node."""
    assert len(tree.tokens) == len(tree.parents) == len(tree.sources) == len(tree.scores)
    seen = set()
    for i in range(1, len(tree)):
        assert 0 <= tree.parents[i] < i
        key = (tree.parents[i], tree.tokens[i])
        assert key not in seen, f"duplicate sibling {key}"
        seen.add(key)


def paths(tree: DraftTree) -> set[tuple[tuple[int, str], ...]]:
    """Every root→node path as (token, source) pairs."""
    return {tuple((tree.tokens[j], tree.sources[j]) for j in tree.path_to(i)) for i in range(1, len(tree))}


def retrieval_tree() -> DraftTree:
    """Root 0 with branches 5→6→7 (share 0.5), 8→9 (0.3), 10 (0.2), built as a counted trie would be."""
    tree = DraftTree.root_only(0)
    tree.add_path(0, [5, 6, 7], "datastore", [0.5, 0.5, 0.4])
    tree.add_path(0, [8, 9], "documents", [0.3, 0.3])
    tree.add(0, 10, "context", 0.2)
    return tree


# ------------------------------------------------------------------------------------------------------
# pruning
# ------------------------------------------------------------------------------------------------------

def test_branch_of_names_the_root_child_above_each_node() -> None:
    tree = retrieval_tree()
    assert branch_of(tree) == [0, 1, 1, 1, 4, 4, 6]


def test_prune_by_counts_only() -> None:
    tree = retrieval_tree()
    kept, pruned = prune(tree, None, PruneConfig(max_branches=2))
    assert [kept.tokens[c] for c in kept.children(0)] == [5, 8]
    assert pruned == 1 and kept.num_draft_tokens == 5
    kept, pruned = prune(tree, None, PruneConfig(min_share=0.4))
    assert [kept.tokens[c] for c in kept.children(0)] == [5]
    assert pruned == 3
    assert kept.scores == [1.0, 0.5, 0.5, 0.4], "count-only pruning leaves scores alone"


def test_prune_with_first_token_probabilities() -> None:
    tree = retrieval_tree()
    probs = torch.full((16,), 0.01)
    probs[8], probs[10], probs[5] = 0.6, 0.25, 0.02      # the draft likes 8 and 10, barely 5
    kept, pruned = prune(tree, probs, PruneConfig(top_k=2))
    assert sorted(kept.tokens[c] for c in kept.children(0)) == [8, 10]   # 5 is outside the draft's top 2
    assert pruned == 3
    # scores: branch share × first-token probability; ranking 8 (0.18) before 10 (0.05)
    assert [kept.tokens[c] for c in kept.children(0)] == [8, 10]
    assert kept.scores[1:] == pytest.approx([0.3 * 0.6, 0.3 * 0.6, 0.2 * 0.25])
    kept, pruned = prune(tree, probs, PruneConfig(top_k=16, min_prob=0.2, max_branches=1))
    assert [kept.tokens[c] for c in kept.children(0)] == [8] and pruned == 4
    kept, pruned = prune(tree, probs, PruneConfig(top_k=16, max_branches=8))
    assert pruned == 0 and kept.num_draft_tokens == tree.num_draft_tokens


def test_prune_keeps_sources_and_empty_tree() -> None:
    kept, pruned = prune(retrieval_tree(), None, PruneConfig())
    assert paths(kept) == paths(retrieval_tree()) and pruned == 0
    empty, pruned = prune(DraftTree.root_only(3), torch.ones(4) / 4, PruneConfig())
    assert empty.num_draft_tokens == 0 and pruned == 0


# ------------------------------------------------------------------------------------------------------
# fusion
# ------------------------------------------------------------------------------------------------------

def draft_tree() -> DraftTree:
    """The draft chain 5→6→11 (the draft agrees with retrieval on 5, 6, then diverges)."""
    return DraftTree.chain(0, [5, 6, 11], "draft", [0.9, 0.8, 0.5])


def test_fusion_grafts_under_the_deepest_match() -> None:
    fused = fuse(draft_tree(), retrieval_tree(), max_nodes=64)
    assert_well_formed(fused)
    p = paths(fused)
    # 5→6 matched the draft chain (and is credited to retrieval, which proposed it for free); retrieval's 7
    # hangs under the draft's 6, beside the draft's own 11
    assert ((5, "datastore"), (6, "datastore"), (7, "datastore")) in p
    assert ((5, "datastore"), (6, "datastore"), (11, "draft")) in p
    assert ((8, "documents"), (9, "documents")) in p and ((10, "context"),) in p
    assert fused.num_draft_tokens == 3 + 1 + 2 + 1
    node_7 = next(i for i in range(len(fused)) if fused.tokens[i] == 7)
    assert fused.tokens[fused.parents[node_7]] == 6
    assert fused.scores[1] == 0.9, "a shared node keeps the larger score"


def test_a_shared_node_is_credited_to_the_first_free_source_that_proposed_it() -> None:
    """Fused after the request's own text, a datastore branch that repeats a context node leaves it tagged
    "context"; only the draft's own tags are taken over."""
    draft = DraftTree.chain(0, [10, 4], "eagle", [0.6, 0.3])
    context = DraftTree.root_only(0)
    context.add(0, 10, "context", 0.2)
    store = DraftTree.root_only(0)
    store.add_path(0, [10, 4], "datastore", [0.5, 0.4])
    tree = fuse(fuse(draft, context, 8, {"eagle"}), store, 8, {"eagle"})
    assert tree.tokens == [0, 10, 4] and tree.sources == ["root", "context", "datastore"]


@pytest.mark.parametrize("budget", [0, 3, 4, 5, 6, 7, 100])
def test_fusion_respects_the_budget_best_nodes_first(budget: int) -> None:
    fused = fuse(draft_tree(), retrieval_tree(), max_nodes=budget)
    assert_well_formed(fused)
    assert fused.num_draft_tokens == max(3, min(budget, 7)), "the draft tree is kept whole"
    added = [fused.tokens[i] for i in range(4, len(fused))]
    assert added == [7, 8, 9, 10][: max(budget - 3, 0)], "by score: 7 (0.4), 8 (0.3), 9 (0.3), 10 (0.2)"


def test_graft_within_skips_children_of_nodes_that_did_not_fit() -> None:
    base = DraftTree.root_only(0)
    other = DraftTree.root_only(0)
    other.add_path(0, [1, 2, 3], "datastore", [0.5, 0.5, 0.5])
    other.add(0, 4, "context", 0.9)
    graft_within(base, other, max_nodes=2)
    assert base.tokens == [0, 4, 1] and base.parents == [-1, 0, 0]


def test_fusion_keeps_sampled_nodes_first_with_their_q() -> None:
    draft = DraftTree.root_only(0)
    first = draft.add(0, 8, "draft", 0.4)
    draft.q[first] = torch.full((16,), 1 / 16)
    second = draft.add(first, 9, "draft", 0.2)
    draft.q[second] = torch.full((16,), 1 / 16)
    fused = fuse(draft, retrieval_tree(), max_nodes=64)
    assert_well_formed(fused)
    assert set(fused.q) == {first, second}
    assert fused.children(0)[0] == first, "the sampled node is tried first among the root's children"
    assert fused.child_with_token(first, 9) == second
    assert fused.sources[first] == "documents", "retrieval proposed 8 too: its tag moves, the node's q stays"
    assert fused.sources[second] == "documents" and fused.q[second] is draft.q[second]
    with pytest.raises(ValueError, match="sampled"):
        graft_within(retrieval_tree(), draft)
    with pytest.raises(ValueError, match="roots"):
        fuse(DraftTree.root_only(1), retrieval_tree(), 8)


def test_merge_trees_first_source_owns_shared_nodes() -> None:
    a = DraftTree.chain(0, [1, 2, 3], "documents", [0.5, 0.5, 0.5])
    b = DraftTree.chain(0, [1, 2, 4], "datastore", [1.0, 1.0, 1.0])
    c = DraftTree.chain(0, [1, 5], "context", [0.2, 0.1])
    merged = merge_trees(0, [a, b, c], max_nodes=10)
    assert_well_formed(merged)
    assert paths(merged) >= {((1, "documents"), (2, "documents"), (3, "documents")),
                             ((1, "documents"), (2, "documents"), (4, "datastore")),
                             ((1, "documents"), (5, "context"))}
    assert merged.scores[1] == 1.0
    small = merge_trees(0, [a, b, c], max_nodes=3)
    assert small.tokens == [0, 1, 2, 4], "the top nodes by (monotone) score"


# ------------------------------------------------------------------------------------------------------
# statistics
# ------------------------------------------------------------------------------------------------------

def test_pruned_nodes_reach_the_statistics() -> None:
    """A datastore with many different continuations of the prompt's suffix: count pruning drops some."""
    model = tiny_llama(0)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    first = hf_greedy(model, prompt, 1)[0]      # the root of the first step: lookups end with it
    docs = [[10, first, k, k + 1, k + 2] for k in range(20, 80, 3)]
    proposer = make_proposer("rasd", datastores=[SuffixArray.from_documents(docs)],
                             prune_config=PruneConfig(max_branches=2))
    out = SpeculativeDecoder(model, proposer, sizer=FixedSizer(16)).generate(prompt, 5)
    assert out.stats.pruned_nodes > 0
    assert out.stats.to_dict()["pruned_nodes"] == out.stats.pruned_nodes
    assert f"pruned {out.stats.pruned_nodes}" in out.stats.summary()
    assert "pruned" not in DecodeStats().summary()


# ------------------------------------------------------------------------------------------------------
# exact sampling
# ------------------------------------------------------------------------------------------------------

def fused_tree(gen: torch.Generator) -> DraftTree:
    """RASD's order: the sampled draft node first, deterministic retrieval branches grafted after it."""
    draft = DraftTree.root_only(0)
    x = int(torch.multinomial(Q, 1, generator=gen))
    draft.q[draft.add(0, x, "draft")] = Q
    retrieved = DraftTree.root_only(0)
    retrieved.add(0, 3, "datastore", 0.6)
    retrieved.add(0, 0, "datastore", 0.4)
    return fuse(draft, retrieved, max_nodes=8)


def retrieval_first_tree(gen: torch.Generator) -> DraftTree:
    """The wrong order: retrieval candidates first, the sampled node appended after them (merged into an
    equal deterministic sibling, whose q is then lost)."""
    tree = DraftTree.root_only(0)
    tree.add(0, 3, "datastore", 0.6)
    tree.add(0, 0, "datastore", 0.4)
    x = int(torch.multinomial(Q, 1, generator=gen))
    if tree.child_with_token(0, x) is None:
        tree.q[tree.add(0, x, "draft")] = Q
    return tree


def test_fused_tree_sampling_is_exact_and_the_wrong_order_is_rejected() -> None:
    first, _, accepted = emitted(fused_tree, 20_000, seed=11)
    assert accepted > 2_000
    assert pooled_chisquare(first, P.numpy()) > ALPHA, f"{first / first.sum()} vs {P.tolist()}"
    first, _, _ = emitted(retrieval_first_tree, 5_000, seed=12)
    assert pooled_chisquare(first, P.numpy()) < ALPHA, "the χ² harness failed to reject the wrong order"


def sampling_datastore(model: torch.nn.Module) -> SuffixArray:
    """Continuations of the prompt sampled from the target itself, so that retrieval nodes get accepted."""
    docs = []
    with torch.inference_mode():
        for seed in range(12):
            torch.manual_seed(seed)
            x = torch.tensor([PROMPT])
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=6, do_sample=True,
                                 temperature=1.0, top_k=0, pad_token_id=0)
            docs.append(out[0, len(PROMPT) - 4:].tolist())
    return SuffixArray.from_documents(docs)


@pytest.mark.slow
def test_rasd_sampling_with_a_draft_model_is_exact() -> None:
    """rasd = unrelated draft (sampled, q attached) + datastore under temperature/top-k/top-p."""
    target = tiny_llama(**TARGET)
    joint = exact_joint(target, PROMPT, WARPED)
    proposer = Recording(make_proposer("rasd", tiny_llama(**OTHER), datastores=[sampling_datastore(target)],
                                       draft_options={"max_depth": 2, "min_prob": 0.0}))
    decoder = SpeculativeDecoder(target, proposer, sizer=FixedSizer(16))
    counts = np.zeros((SVOCAB,) * 3)
    by_source: dict[str, int] = {}
    for i in range(1000):
        out = decoder.generate(PROMPT, 3, sampling=replace(WARPED, seed=3_000_000 + 2 * i))
        a, b, c = out.token_ids
        counts[a, b, c] += 1
        for source, n in out.stats.accepted_by_source.items():
            by_source[source] = by_source.get(source, 0) + n
    print(f"accepted by source: {by_source}")
    assert proposer.nodes_with_q > 0 and proposer.max_root_children >= 2
    assert by_source.get("draft", 0) > 50 and by_source.get("datastore", 0) + by_source.get("context", 0) > 50
    check_against_exact(counts, joint, "rasd warped")


def test_rasd_sampling_exact_at_temperature_one_with_pruning() -> None:
    """Temperature 1, the draft's probabilities pruning branches (top_k=2), fewer runs: a second setting."""
    target = tiny_llama(**TARGET)
    params = SamplingParams(temperature=1.0)
    joint = exact_joint(target, PROMPT, params)
    proposer = make_proposer("rasd", tiny_llama(**OTHER), datastores=[sampling_datastore(target)],
                             prune_config=PruneConfig(top_k=2), draft_options={"max_depth": 2, "min_prob": 0.0})
    decoder = SpeculativeDecoder(target, proposer, sizer=FixedSizer(16))
    counts = np.zeros((SVOCAB,) * 3)
    pruned = 0
    for i in range(600):
        out = decoder.generate(PROMPT, 3, sampling=replace(params, seed=5_000_000 + 2 * i))
        a, b, c = out.token_ids
        counts[a, b, c] += 1
        pruned += out.stats.pruned_nodes
    assert pruned > 0
    check_against_exact(counts, joint, "rasd T=1 pruned")


def test_a_draft_model_leaves_room_for_the_requests_own_text() -> None:
    """With a draft model on, context matches still reach the tree: the draft takes at most half the budget
    while the copying sources have candidates (it used to take all of it, and `rasd` with a draft offered a
    tenth of the context matches `pld` did)."""
    model = tiny_llama(0)
    head = random_prompt(20, 3)
    context = head + head[:6]                                   # the last tokens occurred before: a context match
    proposer = make_proposer("rasd", model, draft_options={"top_k": 2, "width": 4, "min_prob": 0.0})
    proposer.start(context, SamplingParams())
    tree = proposer.propose(context, 8)
    assert "context" in tree.sources and "draft" in tree.sources, tree.sources
    assert len(tree) <= 9


def test_with_a_drafter_rasd_copies_no_one_token_match_of_the_requests_own_text() -> None:
    """A context whose last token occurred before, but not its last two: `pld` (and `rasd` without a drafter)
    copy after the one-token match; `rasd` with a drafter leaves that step to the drafter (its one-token bushes
    were rarely right and took the step from the head), unless asked otherwise (`context_min_ngram`) or until
    the request's own text shows that such copies pay (`test_short_copies.py`)."""
    model = tiny_llama(0)
    head = [5, 6, 7, 8, 9, 10, 11, 12]
    context = head + [30, 31, 9]            # 9 occurred before (followed by 10, 11, ...); (31, 9) never did
    draft_options = {"top_k": 2, "width": 4, "min_prob": 0.0}
    for proposer, copies in ((make_proposer("pld"), True), (make_proposer("rasd"), True),
                             (make_proposer("rasd", model, draft_options=draft_options), False),
                             (make_proposer("rasd", model, draft_options=draft_options, context_min_ngram=1), True)):
        proposer.start(context, SamplingParams())
        tree = proposer.propose(context, 8)
        assert ("context" in tree.sources) is copies, (proposer.name, tree.sources)
        if not copies:
            assert "draft" in tree.sources
    longer = head + [30, 8, 9]              # (8, 9) occurred before: a two-token match is copied with a drafter too
    proposer = make_proposer("rasd", model, draft_options=draft_options)
    proposer.start(longer, SamplingParams())
    assert "context" in proposer.propose(longer, 8).sources
