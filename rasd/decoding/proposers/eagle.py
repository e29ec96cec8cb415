"""`eagle`: EAGLE-2 trees from the target's feature-level draft head (`rasd.decoding.model.eagle_head`).

The head's cache follows the committed context like a draft model's (`DraftModelProposer`), with one
difference: the input at position t is (f_{t-1}, x_t), the target's feature of the previous position and the
token, so the head can only run over positions whose previous feature the target has computed. The engine
hands those over after every target forward (`observe_hidden`: the prefill's positions, then the root and
the accepted nodes of each verified tree); nothing runs the target for the head.

Inside a draft tree a node's input is (f̂ of its parent, its token): the head's own prediction stands in
for the target's feature that does not exist yet. After verification the tree's entries are dropped and the
accepted tokens are run again with the target's real features (EAGLE's rollback), in the next `propose`.

Tree shape, sampling chains, OPT-Tree and RASD's pruning by the first-token distribution are the draft-model
proposer's (EAGLE-2's dynamic tree is its top-k expansion with a global rerank by path probability p̂).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from rasd.decoding.model.eagle_head import EagleHead
from rasd.decoding.proposers.draft import DraftConfig, DraftModelProposer
from rasd.decoding.sizing.gate import DraftGate
from rasd.decoding.step.cache import GrowableLayer
from rasd.decoding.step.sampling import SamplingParams
from rasd.decoding.step.tree import DraftTree

SOURCE = "eagle"


@dataclass
class EagleConfig(DraftConfig):
    """The EAGLE head's tree knobs: EAGLE-2's dynamic tree (top-8 children, 8 kept per layer, 6 deep)."""

    max_depth: int | None = 6
    top_k: int = 8
    width: int = 8
    min_prob: float | None = 0.02


class EagleProposer(DraftModelProposer):
    """Draft trees from an `EagleHead`; the target's features arrive through `observe_hidden`."""

    name = "eagle"
    wants_hidden = True   # the engine passes the target's final-norm hidden states of committed positions
    config_class = EagleConfig

    def __init__(self, head: EagleHead, gate: DraftGate | None = None, config: DraftConfig | None = None,
                 **fields: Any):
        super().__init__(head, gate, config, **fields)
        self.head = head
        self.source = SOURCE
        if self.config.shape != "optree":
            self.name = "eagle"
        self._reset_features()

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers the head reads beside the final features (EAGLE-3; () for a plain head)."""
        return self.head.taps

    def _new_cache(self) -> GrowableLayer:
        return GrowableLayer()   # the head's one layer

    def _reset_features(self) -> None:
        self.cache = self._new_cache()
        self.cached, self.offset = [], 0
        self.root_logits = None
        self._buf: torch.Tensor | None = None   # [capacity, H]: rows 0..n-1 are the target's features of
        self._n = 0                              # positions feat_start .. feat_start + n - 1
        self.feat_start = 0
        self.node_feats: dict[int, torch.Tensor] = {}   # tree node -> the head's predicted feature [H]

    def start(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        super().start(prompt_ids, sampling)
        self._reset_features()

    @property
    def feats(self) -> torch.Tensor | None:
        """[n, H]: the target's features of positions feat_start .. (None before the first)."""
        return None if self._buf is None else self._buf[: self._n]

    def observe_hidden(self, start: int, hidden: torch.Tensor) -> None:
        """The target's features [n, F] of positions start .. start + n - 1 (contiguous; F = H, or the tapped
        layers' and the final features side by side for a fused head: `decoding.features`).

        Written into a buffer that doubles when full: appending by `torch.cat` copied every feature since the
        prompt's first at every step (9 MB a step after a 4k-token prompt)."""
        hidden = hidden.detach().to(self.dtype)
        if self._buf is None or start > self._known_until() or start < self.feat_start:
            self._buf, self._n, self.feat_start = hidden.clone(), len(hidden), start   # a gap or a restart
            self.cache.crop(-self.cache.get_seq_length())
            self.cached, self.root_logits = [], None
            return
        keep = start - self.feat_start
        need = keep + len(hidden)
        if need > len(self._buf):
            grown = self._buf.new_empty((max(need, 2 * len(self._buf)), self._buf.shape[1]))
            grown[:keep] = self._buf[:keep]
            self._buf = grown
        self._buf[keep:need] = hidden
        self._n = need

    def _known_until(self) -> int:
        """One past the last position whose target feature is known."""
        return self.feat_start + self._n

    def _sync(self, context: list[int]) -> torch.Tensor | None:
        """Make the head's cache hold positions offset .. L-1 and return its logits at the root [vocab].

        None when the target's features do not reach the root's parent (nothing to draft from)."""
        if self.root_logits is not None and self._holds(context):
            return self.root_logits
        root = len(context) - 1
        if self._buf is None or self._known_until() < root or root < 1:
            return None
        if not self.cached:
            floor = max(0, len(context) - self.window) if self.window is not None else 0
            self.offset = max(floor, self.feat_start + 1)
        seen = context[self.offset:]
        common, limit = 0, min(len(self.cached), len(seen) - 1)
        while common < limit and self.cached[common] == seen[common]:
            common += 1
        self.cache.crop(-(self.cache.get_seq_length() - common))
        first = self.offset + common                                       # first position to run
        ids = torch.tensor([context[first:]], dtype=torch.long, device=self.device)           # [1, n]
        feats = self.feats[first - 1 - self.feat_start: root - self.feat_start][None]          # [1, n, H]
        pos = torch.arange(first, len(context), device=self.device)[None]
        t0 = time.perf_counter()
        predicted = self.head(feats, ids, pos, kv=self.cache)                                   # [1, n, H]
        self.cached = list(seen)
        self.node_feats = {0: predicted[0, -1]}
        self.root_logits = self.head.full_logits(predicted[0, -1]).float()   # a draft forward includes its logits
        self._caught_up = ids.shape[1]
        if ids.shape[1] <= 4:
            self._time_forward(t0, later=False)
        return self.root_logits

    def _forward_nodes(self, tree: DraftTree, first: int, context_len: int) -> torch.Tensor:
        """Head logits [n, vocab] for tree nodes first.. (their parents' predicted features as input)."""
        nodes, ids, pos, mask = self._node_inputs(tree, first, context_len)
        feats = torch.stack([self.node_feats[tree.parents[i]] for i in nodes])[None]            # [1, n, H]
        t0 = time.perf_counter()
        predicted = self.head(feats, ids, pos, kv=self.cache, mask=mask)[0]
        for i, node in enumerate(nodes):
            self.node_feats[node] = predicted[i]
        logits = self.head.full_logits(predicted).float()   # [n, vocab]: part of the layer's cost (δ, grow_pays)
        self._time_forward(t0)
        return logits
