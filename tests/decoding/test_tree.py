"""DraftTree: construction, sibling dedupe, depths, paths, the ancestor mask, pruning and merging."""

from __future__ import annotations

import pytest
import torch

from rasd.decoding.step.tree import DraftTree


def sample_tree() -> DraftTree:
    """Hand-built tree (node: token, parent):

        0: 10 (root)
        ├── 1: 11
        │   ├── 3: 13
        │   │   └── 5: 15
        │   └── 4: 14
        └── 2: 12
            └── 6: 16
    """
    tree = DraftTree.root_only(10)
    assert tree.add(0, 11, "a", 0.9) == 1
    assert tree.add(0, 12, "b", 0.5) == 2
    assert tree.add(1, 13, "a", 0.6) == 3
    assert tree.add(1, 14, "b", 0.2) == 4
    assert tree.add(3, 15, "a", 0.4) == 5
    assert tree.add(2, 16, "b", 0.45) == 6
    return tree


def test_root_only_and_chain() -> None:
    root = DraftTree.root_only(7)
    assert (root.tokens, root.parents, root.sources, root.scores) == ([7], [-1], ["root"], [1.0])
    assert len(root) == 1 and root.num_draft_tokens == 0

    chain = DraftTree.chain(7, [1, 2, 3], "ctx", scores=[0.9, 0.5, 0.1])
    assert chain.tokens == [7, 1, 2, 3]
    assert chain.parents == [-1, 0, 1, 2]
    assert chain.sources == ["root", "ctx", "ctx", "ctx"]
    assert chain.scores == [1.0, 0.9, 0.5, 0.1]
    assert chain.depths() == [0, 1, 2, 3]
    assert chain.num_draft_tokens == 3
    # a chain may repeat a token at different depths (only siblings are deduplicated)
    assert DraftTree.chain(7, [7, 7, 7], "ctx").tokens == [7, 7, 7, 7]


def test_add_dedupes_siblings_keeping_source_and_max_score() -> None:
    tree = sample_tree()
    n = len(tree)
    assert tree.add(0, 12, "other", 0.8) == 2          # existing sibling returned
    assert len(tree) == n
    assert tree.sources[2] == "b"                        # keeps its source
    assert tree.scores[2] == 0.8                         # takes the larger score
    assert tree.add(0, 12, "other", 0.1) == 2
    assert tree.scores[2] == 0.8                         # never lowered
    # the same token under another parent is a new node
    assert tree.add(2, 13, "c", 0.3) == n
    assert tree.parents[n] == 2
    with pytest.raises(IndexError):
        tree.add(len(tree), 1, "x")
    with pytest.raises(IndexError):
        tree.add(-1, 1, "x")


def test_children_depths_and_paths() -> None:
    tree = sample_tree()
    assert tree.children(0) == [1, 2]
    assert tree.children(1) == [3, 4]
    assert tree.children(5) == []
    assert tree.child_with_token(1, 14) == 4
    assert tree.child_with_token(1, 16) is None
    assert tree.depths() == [0, 1, 1, 2, 2, 3, 2]
    assert tree.path_to(0) == []
    assert tree.path_to(5) == [1, 3, 5]
    assert tree.path_to(6) == [2, 6]
    assert [tree.tokens[i] for i in tree.path_to(4)] == [11, 14]


def test_ancestor_mask() -> None:
    tree = sample_tree()
    expected = torch.zeros(7, 7, dtype=torch.bool)
    for node, visible in {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 1, 4], 5: [0, 1, 3, 5],
                          6: [0, 2, 6]}.items():
        expected[node, visible] = True
    mask = tree.ancestor_mask()
    assert mask.dtype == torch.bool and mask.shape == (7, 7)
    assert torch.equal(mask, expected)


def test_add_path_merges_longest_prefix() -> None:
    tree = sample_tree()
    n = len(tree)
    nodes = tree.add_path(0, [11, 13, 99, 98], "d", scores=[0.1, 0.1, 0.05, 0.01])
    assert nodes[:2] == [1, 3]                 # shared prefix reused
    assert nodes[2:] == [n, n + 1]             # the rest appended under node 3
    assert tree.parents[n] == 3 and tree.parents[n + 1] == n
    assert tree.sources[n] == "d" and tree.sources[1] == "a"


def test_subtree_keeps_ancestors_and_remaps() -> None:
    tree = sample_tree()
    q5 = torch.tensor([0.25, 0.75])
    q4 = torch.tensor([0.5, 0.5])
    tree.q = {5: q5, 4: q4}
    tree.bucket = 3
    sub = tree.subtree([5, 6])
    # kept: root, 1, 3, 5 (ancestors of 5), 2, 6 (ancestors of 6), in original order
    assert sub.tokens == [10, 11, 12, 13, 15, 16]
    assert sub.parents == [-1, 0, 0, 1, 3, 2]
    assert sub.sources == ["root", "a", "b", "a", "a", "b"]
    assert sub.scores == [1.0, 0.9, 0.5, 0.6, 0.4, 0.45]
    assert set(sub.q) == {4} and sub.q[4] is q5        # q follows its node; dropped node 4's q is gone
    assert sub.bucket == 3
    assert tree.tokens == [10, 11, 12, 13, 14, 15, 16]  # the original is untouched
    empty = tree.subtree([])
    assert empty.tokens == [10] and empty.parents == [-1]


def test_top_nodes_is_prefix_closed() -> None:
    tree = sample_tree()
    # a deep node scoring higher than its ancestors must not be kept without them
    deep = tree.add(4, 17, "z", 0.95)
    for budget in range(0, tree.num_draft_tokens + 2):
        top = tree.top_nodes(budget)
        assert top.num_draft_tokens == min(budget, tree.num_draft_tokens)
        for i in range(1, len(top)):
            assert 0 <= top.parents[i] < i, "parents must precede children"
        # every kept node's path exists in the original tree
        for i in range(1, len(top)):
            toks = [top.tokens[j] for j in top.path_to(i)]
            node = 0
            for t in toks:
                node = tree.child_with_token(node, t)
                assert node is not None
    # monotone scores: deep node clipped to min along its path (0.9, 0.2, 0.95) -> 0.2
    assert tree.monotone_scores()[deep] == pytest.approx(0.2)
    assert tree.top_nodes(1).tokens == [10, 11]
    assert tree.top_nodes(3).tokens == [10, 11, 12, 13]   # 0.9, 0.6, 0.5 beat 0.45, 0.4, 0.2, 0.2
    assert tree.top_nodes(100) is tree


def test_graft_longest_prefix_merge() -> None:
    tree = sample_tree()
    other = DraftTree.root_only(10)
    a = other.add(0, 11, "x", 0.7)        # matches node 1
    b = other.add(a, 14, "x", 0.99)       # matches node 4: score raised
    other.add(b, 20, "x", 0.3)            # new below node 4
    c = other.add(0, 30, "x", 0.1)        # new root child
    other.q[c] = torch.tensor([1.0])
    n = len(tree)
    out = tree.graft(other)
    assert out is tree
    assert len(tree) == n + 2
    assert tree.scores[4] == 0.99 and tree.sources[4] == "b"
    assert tree.tokens[n] == 20 and tree.parents[n] == 4 and tree.sources[n] == "x"
    assert tree.tokens[n + 1] == 30 and tree.parents[n + 1] == 0
    assert n + 1 in tree.q                  # q travels with a new node of the same source
    with pytest.raises(ValueError):
        tree.graft(DraftTree.root_only(11))
