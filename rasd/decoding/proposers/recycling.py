"""`recycling`: Token Recycling (arXiv 2408.08696) — draft from the target's own earlier top-k candidates.

Every verification forward computes the target's full next-token distribution at EVERY tree node, accepted
or not; plain decoding throws all but one token of it away. Token Recycling keeps, for each token id `t`,
the target's top-k next tokens (and their probabilities, renormalised over those k) the last time `t` was
verified anywhere:

    adjacency [vocab, k] int32 (-1 = never seen),   probs [vocab, k] float16.

A draft tree is read off this matrix from the root, one vectorised gather per layer: a layer's nodes are
the top-ranked entries in the rows of the previous layer's tokens. No training, no draft model, a few MB.
The matrix is shared by all requests of one target model (hot start) and can be persisted atomically.

Tree shapes (`shape`):
- "template": the paper's static tree. A node at rank r of its parent's row gets the prior weight
  `RANK_PRIOR[r]`; the template is the n best nodes by product of priors along the path (n = the node
  budget the cost-aware sizer allows, so the paper's 80-node template shrinks with this CPU's cost curve).
- "optree" (default): the same gathers, but ranked by the recycled probabilities themselves: a node's score
  p̂ = product of the stored probabilities along its path, and each layer keeps the global top-n nodes while
  deepening adds any (OPT-Tree, arXiv 2406.17276, on the recycled distribution instead of a draft model).
Scores are p̂ in both shapes, so the sizer can rank recycled nodes against other sources.
"""

from __future__ import annotations

import heapq
import logging
import threading
from pathlib import Path

import numpy as np
import torch

from rasd import paths
from rasd.decoding.proposers.base import ProposerBase
from rasd.decoding.step.sampling import SamplingParams
from rasd.decoding.step.tree import DraftTree
from rasd.decoding.step.verify import Verdict
from rasd.fsio import atomic_file

SOURCE = "recycling"
# Prior acceptance weight of the r-th ranked candidate in a row, for the static template. A guess shaped
# like a next-token distribution's head (the paper's template also gives most children to rank 0 and 1);
# the default shape is "optree", which uses the recycled probabilities instead.
RANK_PRIOR = (0.6, 0.15, 0.07, 0.05, 0.04, 0.03, 0.02, 0.02)

log = logging.getLogger(__name__)


class RecyclingMatrix:
    """Token → the target's top-k next tokens and their probabilities, overwritten on every verification."""

    def __init__(self, vocab_size: int, k: int = 8):
        if vocab_size < 1 or k < 1:
            raise ValueError("the recycling matrix needs vocab_size >= 1 and k >= 1")
        self.vocab_size, self.k = vocab_size, k
        self.tokens = torch.full((vocab_size, k), -1, dtype=torch.int32)   # [vocab, k]
        self.probs = torch.zeros((vocab_size, k), dtype=torch.float16)     # [vocab, k]
        self.updates = 0
        self._lock = threading.Lock()   # save() must not copy a half-written row batch

    def update(self, node_tokens: list[int], logits: torch.Tensor) -> None:
        """Overwrite the rows of the tree's tokens with the target's top-k at those nodes.

        node_tokens [T]: the token at each verified node; logits [T, vocab]: the target's logits there
        (logits[i] predicts what follows node i). A token occurring twice keeps its last row.

        The stored probabilities are the softmax over the k kept logits, not over the vocabulary: the full
        normaliser (a logsumexp over [T, vocab]) cost as much as the top-k itself on this CPU, every step, for
        scores that only rank tree nodes (the verifier decides acceptance). They overstate a flat row's mass.
        """
        if not node_tokens:
            return
        top = logits[: len(node_tokens)].topk(self.k, dim=-1)               # [T, k]
        probs = top.values.float().softmax(dim=-1)                          # renormalised over the top k
        rows = torch.tensor(node_tokens, dtype=torch.long)
        # A row with NaN or infinite logits (a broken forward, an overflowing half-precision run) would give
        # NaN probabilities that outlive the request: the matrix is shared and saved. Keep the old row.
        indices, finite = top.indices, torch.isfinite(top.values).all(dim=-1)     # [T, k], [T]
        if not bool(finite.all()):
            indices, probs, rows = indices[finite], probs[finite], rows[finite.cpu()]
        with self._lock:
            self.tokens[rows] = indices.to(torch.int32).cpu()
            self.probs[rows] = probs.to(torch.float16).cpu()
            self.updates += 1

    def rows(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(candidate tokens [n, k], probabilities [n, k]) for these tokens: one gather."""
        index = torch.tensor(tokens, dtype=torch.long)
        return self.tokens[index], self.probs[index].float()

    def known(self, token: int) -> bool:
        """Whether the target has been verified at this token at least once."""
        return bool(self.tokens[token, 0] >= 0)

    def root_probs(self, token: int) -> torch.Tensor | None:
        """The recycled next-token distribution after `token` as a sparse [vocab] vector (None if unseen)."""
        if not self.known(token):
            return None
        out = torch.zeros(self.vocab_size)
        valid = self.tokens[token] >= 0
        out[self.tokens[token][valid].long()] = self.probs[token][valid].float()
        return out

    # ------------------------------------------------------------------ persistence
    def save(self, path: Path) -> None:
        """Write atomically (temp file + rename): a crash mid-write leaves the previous file intact."""
        with self._lock:
            tokens, probs = self.tokens.numpy().copy(), self.probs.numpy().copy()
        with atomic_file(path, "wb") as f:
            np.savez(f, tokens=tokens, probs=probs, updates=np.array(self.updates))

    @classmethod
    def load(cls, path: Path, vocab_size: int, k: int = 8) -> RecyclingMatrix:
        """A saved matrix; a clear error when it was saved for another vocabulary or k."""
        with np.load(Path(path)) as data:
            tokens, probs = data["tokens"], data["probs"]
            if tokens.shape != (vocab_size, k):
                raise ValueError(f"recycling matrix {path} has shape {tokens.shape}, expected {(vocab_size, k)}: "
                                 "it was saved for another model")
            out = cls(vocab_size, k)
            out.tokens = torch.from_numpy(tokens.astype(np.int32))
            out.probs = torch.from_numpy(probs.astype(np.float16))
            broken = ~torch.isfinite(out.probs).all(dim=-1)                 # saved by an older, unguarded update
            out.tokens[broken], out.probs[broken] = -1, 0.0
            out.updates = int(data["updates"])
        return out

    @classmethod
    def load_or_new(cls, path: Path | None, vocab_size: int, k: int = 8) -> RecyclingMatrix:
        """Hot start from `path` when it holds a matrix for this vocabulary, else an empty one."""
        if path is not None and Path(path).exists():
            try:
                return cls.load(path, vocab_size, k)
            except Exception as exc:   # noqa: BLE001 - truncated zip, bad array, another model's: all start cold
                log.warning("recycling matrix %s is unusable (%s: %s); starting cold", path, type(exc).__name__,
                            exc)
        return cls(vocab_size, k)


def matrix_path(model_name: str) -> Path:
    """Where a target's recycling matrix is persisted: `$RASD_HOME/recycling/<model>.npz`."""
    return paths.recycling_path(model_name)


def template(n: int, k: int, max_depth: int = 10) -> list[tuple[int, int]]:
    """The static tree: (parent template index, rank in the parent's row) for n nodes, best prior first.

    Index 0 is the root; node i's parent index is < i. Built best-first on products of `RANK_PRIOR`, so a
    template for n nodes is a prefix of the one for n + 1 and is always connected.
    """
    prior = [RANK_PRIOR[r] if r < len(RANK_PRIOR) else RANK_PRIOR[-1] for r in range(k)]
    out: list[tuple[int, int]] = [(-1, -1)]
    depth = [0]
    heap: list[tuple[float, int, int]] = [(-prior[r], 0, r) for r in range(k)]   # (-score, parent, rank)
    score = [1.0]
    while heap and len(out) <= n:
        neg, parent, rank = heapq.heappop(heap)
        out.append((parent, rank))
        score.append(-neg)
        depth.append(depth[parent] + 1)
        node = len(out) - 1
        if depth[node] < max_depth:
            for r in range(k):
                heapq.heappush(heap, (-score[node] * prior[r], node, r))
    return out[1:]


class RecyclingProposer(ProposerBase):
    """Draft trees read off the shared `RecyclingMatrix` (see the module docstring)."""

    name = "recycling"

    def __init__(self, matrix: RecyclingMatrix, shape: str = "optree", max_depth: int = 8, source: str = SOURCE):
        if shape not in ("optree", "template"):
            raise ValueError(f"unknown recycling tree shape {shape!r}; choose optree or template")
        self.matrix, self.shape, self.max_depth, self.source = matrix, shape, max_depth, source
        self._templates: dict[int, list[tuple[int, int]]] = {}

    def start(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        """The matrix is kept across requests (hot start); nothing per request."""

    def propose(self, context: list[int], max_nodes: int) -> DraftTree:
        root = context[-1]
        if max_nodes <= 0 or not self.matrix.known(root):
            return DraftTree.root_only(root)
        if self.shape == "template":
            return self._template_tree(root, max_nodes)
        return self._optree(root, max_nodes)

    def observe(self, context: list[int], tree: DraftTree, verdict: Verdict, logits: torch.Tensor) -> None:
        """Recycle the target's top-k at every verified node, accepted or not."""
        self.matrix.update(tree.tokens, logits)

    def root_probs(self, context: list[int]) -> torch.Tensor | None:
        """The recycled next-token distribution at the root: a probability source for RASD pruning."""
        return self.matrix.root_probs(context[-1])

    def _optree(self, root: int, max_nodes: int) -> DraftTree:
        """Layer by layer: gather the frontier's rows, keep the global top-n nodes by p̂ while deepening adds any."""
        tokens, parents, scores = [root], [-1], [1.0]
        frontier = [0]
        kept: list[tuple[float, int]] = []          # min-heap of (p̂, node) holding the best max_nodes nodes
        for _ in range(self.max_depth):
            cand, probs = self.matrix.rows([tokens[i] for i in frontier])      # [F, k] each
            p_hat = probs * torch.tensor([scores[i] for i in frontier]).unsqueeze(1)
            new = []
            for f, (row, row_p) in enumerate(zip(cand.tolist(), p_hat.tolist(), strict=True)):
                for tok, p in zip(row, row_p, strict=True):     # a row is sorted by probability
                    if tok < 0 or (len(kept) == max_nodes and p <= kept[0][0]):
                        break
                    tokens.append(tok)
                    parents.append(frontier[f])
                    scores.append(p)
                    node = len(tokens) - 1
                    new.append(node)
                    if len(kept) < max_nodes:
                        heapq.heappush(kept, (p, node))
                    else:
                        heapq.heapreplace(kept, (p, node))
            keep = {node for _, node in kept}
            frontier = [node for node in new if node in keep]
            if not frontier:
                break
        tree = DraftTree(tokens=tokens, parents=parents, sources=["root"] + [self.source] * (len(tokens) - 1),
                         scores=scores)
        return tree.subtree(node for _, node in kept).top_nodes(max_nodes)

    def _template_tree(self, root: int, max_nodes: int) -> DraftTree:
        """The static template filled in one gather per layer (a node whose row is unseen has no children)."""
        shape = self._templates.get(max_nodes)
        if shape is None:
            shape = self._templates[max_nodes] = template(max_nodes, self.matrix.k, self.max_depth)
        tree = DraftTree.root_only(root)
        where = {0: 0}                      # template index -> tree node (absent: its parent row was unseen)
        layer = [i + 1 for i, (parent, _) in enumerate(shape) if parent == 0]
        while layer:
            parents = [where[shape[i - 1][0]] for i in layer if shape[i - 1][0] in where]
            live = [i for i in layer if shape[i - 1][0] in where]
            if not live:
                break
            cand, probs = self.matrix.rows([tree.tokens[p] for p in parents])    # [L, k]
            for j, i in enumerate(live):
                rank = shape[i - 1][1]
                token = int(cand[j, rank])
                if token < 0:
                    continue
                parent = parents[j]
                where[i] = tree.add(parent, token, self.source, tree.scores[parent] * float(probs[j, rank]))
            layer = [c + 1 for c, (parent, _) in enumerate(shape) if parent in set(live)]
        return tree
