"""`ar`: no drafts at all, so every step is one token of plain decoding through the same engine."""

from __future__ import annotations

import torch

from rasd.decoding.proposers.base import ProposerBase
from rasd.decoding.step.sampling import SamplingParams
from rasd.decoding.step.tree import DraftTree
from rasd.decoding.step.verify import Verdict


class NoDraftProposer(ProposerBase):
    """The baseline: verification of a root-only tree is exactly one autoregressive step."""

    name = "ar"

    def start(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        """Stateless."""

    def propose(self, context: list[int], max_nodes: int) -> DraftTree:
        return DraftTree.root_only(context[-1])

    def observe(self, context: list[int], tree: DraftTree, verdict: Verdict, logits: torch.Tensor) -> None:
        """Nothing to learn."""
