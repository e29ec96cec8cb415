"""The one small interface every proposer implements (duck-typed, like vLLM's `propose()`)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from rasd.decoding.step.sampling import SamplingParams
from rasd.decoding.step.tree import DraftTree
from rasd.decoding.step.verify import Verdict


@runtime_checkable
class Proposer(Protocol):
    """Guesses the next tokens as a DraftTree rooted at the last committed token.

    `context` is always the prompt plus every committed token; its last element is the root. Proposers may
    keep per-request state between `start` and the end of a request, and learn in `observe`.
    """

    name: str

    def start(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        """A new request begins."""

    def propose(self, context: list[int], max_nodes: int) -> DraftTree:
        """A tree of at most `max_nodes` draft nodes (root excluded)."""
        ...

    def observe(self, context: list[int], tree: DraftTree, verdict: Verdict, logits: torch.Tensor) -> None:
        """The tree was verified: `context` now includes the committed tokens; logits [T, vocab]."""
