"""Tree verification: one target forward over the whole draft tree, then greedy or exact-sampling acceptance.

The verifier knows nothing about where nodes came from; `source` tags only pass through to statistics.
Notation follows the speculative-sampling papers: p = the target's distribution at a node, q = the
distribution a draft token was sampled from (known only for sampled drafts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from rasd.decoding.model import fast_forward
from rasd.decoding.step.cache import TreeCache
from rasd.decoding.step.sampling import SamplingParams, sample, target_probs
from rasd.decoding.step.tree import DraftTree

# a request's logits processors: (tree, logits [T, vocab]) -> processed logits [T, vocab] (`decoding.logits`)
Process = Callable[[DraftTree, torch.Tensor], torch.Tensor]


@dataclass
class Verdict:
    """What one verification step decided: accepted draft nodes (root excluded) and the bonus token."""

    accepted: list[int]   # tree node indices along the accepted path, root excluded
    bonus: int            # the target's own token after the accepted path

    def new_tokens(self, tree: DraftTree) -> list[int]:
        """Tokens committed by this step: accepted drafts then the bonus."""
        return [tree.tokens[i] for i in self.accepted] + [self.bonus]


def batch_inputs(trees: Sequence[DraftTree], row_lengths: Sequence[int], past_len: int, dtype: torch.dtype,
                 device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids [B, T], position_ids [B, T] and the additive mask [B, 1, T, past_len + T] for the trees of
    B rows appended at the shared end `past_len` of a right-padded cache whose row b holds `row_lengths[b]`.

    Every node sees its row's committed context and exactly its own ancestors in the tree; its position is
    the row's length + depth, so a node's logits equal those of decoding its path sequentially. T is the
    largest tree; a shorter tree is padded with copies of its root that see the row's context and themselves
    only (a fully masked query row would give NaNs); their outputs are ignored and their cache entries
    dropped by `keep_rows`.
    """
    batch, width = len(trees), max(len(t) for t in trees)
    input_ids = torch.zeros(batch, width, dtype=torch.long)
    position_ids = torch.zeros(batch, width, dtype=torch.long)
    visible = torch.zeros(batch, width, past_len + width, dtype=torch.bool)
    for b, (tree, length) in enumerate(zip(trees, row_lengths, strict=True)):
        n = len(tree)
        input_ids[b, :n] = torch.tensor(tree.tokens)
        input_ids[b, n:] = tree.tokens[0]
        position_ids[b, :n] = torch.tensor(tree.depths()) + length
        position_ids[b, n:] = length
        visible[b, :, :length] = True
        visible[b, :n, past_len: past_len + n] = tree.ancestor_mask()
        pads = torch.arange(n, width)
        visible[b, pads, past_len + pads] = True
    mask = torch.zeros(batch, width, past_len + width, dtype=dtype)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return input_ids.to(device), position_ids.to(device), mask[:, None].to(device)


def tree_inputs(tree: DraftTree, past_len: int, dtype: torch.dtype, device: torch.device | str
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`batch_inputs` for one request's tree on its own cache: [1, T], [1, T], [1, 1, T, past_len + T]."""
    return batch_inputs([tree], [past_len], past_len, dtype, device)


@torch.inference_mode()
def tree_forward(model: torch.nn.Module, cache: TreeCache, tree: DraftTree) -> torch.Tensor:
    """Run the target over all tree nodes at once; returns logits [T, vocab] (float32).

    The tree's keys/values are appended to `cache`; call `cache.keep()` afterwards to drop rejected nodes.
    """
    past_len = cache.get_seq_length()
    param = next(model.parameters())
    if len(tree) == 1:
        # Plain decoding step: one query sees the whole cache, so no mask is needed, and without one sdpa
        # skips building and applying a [1, 1, 1, past_len + 1] float mask every step.
        input_ids = torch.tensor([tree.tokens], dtype=torch.long, device=param.device)
        position_ids = torch.tensor([[past_len]], dtype=torch.long, device=param.device)
        mask = None
    else:
        input_ids, position_ids, mask = tree_inputs(tree, past_len, param.dtype, param.device)
    return fast_forward.forward(model, cache, input_ids, position_ids, mask)[0].float()


def accept_greedy(tree: DraftTree, logits: torch.Tensor) -> Verdict:
    """Longest path whose every token equals the target's argmax at its parent, plus the bonus token.

    logits: [T, vocab]. Siblings never repeat a token, so at most one child can match at each node.
    """
    argmax = logits.argmax(-1).tolist()   # [T]
    node, accepted = 0, []
    while True:
        child = tree.child_with_token(node, argmax[node])
        if child is None:
            return Verdict(accepted=accepted, bonus=argmax[node])
        accepted.append(child)
        node = child


def accept_sampling(tree: DraftTree, logits: torch.Tensor, params: SamplingParams,
                    gen: torch.Generator) -> Verdict:
    """Exact speculative sampling over a tree (multi-candidate rejection, SpecInfer-style).

    At each node the children are tried one by one. A deterministic candidate x is accepted with
    probability p(x); on rejection p(x) is set to 0 and p renormalised. A candidate sampled from a known q
    is accepted with probability min(1, p(x)/q(x)); on rejection p becomes norm(max(p - q, 0)). When every
    child fails, the bonus token is drawn from what is left of p. Either way the emitted token has exactly
    the distribution p, so the output distribution equals plain sampling.
    """
    probs = target_probs(logits, params)   # [T, vocab]
    node, accepted = 0, []
    while True:
        p = probs[node].clone()
        chosen = None
        for child in tree.children(node):
            x = tree.tokens[child]
            q = tree.q.get(child)
            p, ok = _try_candidate(p, x, q, gen)
            if ok:
                chosen = child
                break
        if chosen is None:
            return Verdict(accepted=accepted, bonus=sample(p, gen))
        accepted.append(chosen)
        node = chosen


def _try_candidate(p: torch.Tensor, x: int, q: torch.Tensor | None, gen: torch.Generator
                   ) -> tuple[torch.Tensor, bool]:
    """One rejection round; returns (the residual distribution, accepted?)."""
    u = float(torch.rand((), generator=gen).item())
    if q is None:
        if u < float(p[x]):
            return p, True
        residual = p.clone()
        residual[x] = 0.0
    else:
        qx = float(q[x])
        if qx > 0 and u < min(1.0, float(p[x]) / qx):
            return p, True
        residual = torch.clamp(p - q.to(p.dtype), min=0.0)
    total = float(residual.sum())
    if total <= 0.0:   # p was (numerically) all on rejected mass: nothing else can be drawn
        return p, False
    return residual / total, False


def accept(tree: DraftTree, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None,
           process: Process | None = None) -> Verdict:
    """The verdict on one tree from its target logits [T, vocab]: greedy match, or exact sampling.

    `process`: the request's penalties / bias, applied to each node's logits from its own path first."""
    if process is not None:
        logits = process(tree, logits)
    if params.greedy:
        return accept_greedy(tree, logits)
    assert gen is not None
    return accept_sampling(tree, logits, params, gen)


@torch.inference_mode()
def verify(model: torch.nn.Module, cache: TreeCache, tree: DraftTree, params: SamplingParams,
           gen: torch.Generator | None, process: Process | None = None) -> tuple[Verdict, torch.Tensor]:
    """Forward the tree, decide acceptance, compact the cache to the accepted path.

    Returns the verdict and the target's raw logits [T, vocab] (proposers such as Token Recycling learn from
    every position, accepted or not).
    """
    past_len = cache.get_seq_length()
    logits = tree_forward(model, cache, tree)
    verdict = accept(tree, logits, params, gen, process)
    cache.keep(past_len, [0, *verdict.accepted])
    return verdict, logits
