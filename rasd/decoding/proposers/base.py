"""The interface every proposer implements: three required methods and optional hooks with defaults.

Required (`Proposer`, like vLLM's `propose()`): `start`, `propose`, `observe`. Optional hooks, each called by
the engine, the bench or the service on every proposer, so a proposer that does not need one inherits the
default from `ProposerBase` (the way Ray Serve LLM's `LLMEngine` abc separates required from optional
methods): nothing in the package asks a proposer whether it has a hook (no getattr/hasattr). A new proposer
subclasses `ProposerBase`; `tests/decoding/test_proposer_contract.py` checks every registered method does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from rasd.decoding.step.sampling import SamplingParams
from rasd.decoding.step.tree import DraftTree
from rasd.decoding.step.verify import Verdict

if TYPE_CHECKING:   # the index package may pull in heavy deps (FAISS); types only
    from rasd.decoding.drafting.history import ResponseHistory
    from rasd.index.suffix_array import SuffixArray


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


class ProposerBase:
    """The required methods (`start`, `propose`, `observe`) plus every optional hook, with its default.

    Subclasses override `propose` (and usually `start` / `observe`) and only the hooks they use.
    """

    name: str = "proposer"

    # The draft module the proposer runs in this process (a draft model, an EAGLE head), or None. Read once by
    # `SpeculativeDecoder.__init__`, which installs its fast kernels on it as on the target.
    model: torch.nn.Module | None = None

    # Whether the proposer drafts from the target's features (EAGLE). When True the engine taps the target's
    # forwards (`features.shared_tap`) and hands each step's new rows to `observe_hidden`.
    wants_hidden: bool = False

    # The target layers whose outputs the proposer reads beside the final features (EAGLE-3's taps); read
    # with `wants_hidden` when the decoder is built.
    feature_layers: tuple[int, ...] = ()

    # The response history the proposer drafts from (SuffixDecoding), or None. The engine adds every normally
    # finished response to it (`GenerationStream._remember`); the bench clears it after its warm-up.
    history: ResponseHistory | None = None

    def start(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        """A new request begins (default: stateless)."""

    def propose(self, context: list[int], max_nodes: int) -> DraftTree:
        """A tree of at most `max_nodes` draft nodes (root excluded); the default drafts nothing."""
        return DraftTree.root_only(context[-1])

    def observe(self, context: list[int], tree: DraftTree, verdict: Verdict, logits: torch.Tensor) -> None:
        """The tree was verified: `context` now includes the committed tokens; logits [T, vocab]."""

    def observe_hidden(self, start: int, hidden: torch.Tensor) -> None:
        """The target's features [n, H] of positions start.. (called only when `wants_hidden`)."""

    def use_sizer(self, sizer: Any) -> None:
        """The decoder's sizer, given once by `build_decoder`: a model drafter asks it where another layer of
        its tree cannot pay and stops there. Default: the proposer does not consult it."""

    def set_datastores(self, datastores: Sequence[SuffixArray] | None) -> None:
        """Replace the whole-index datastores (the bench gives each prompt its own). Default: no index."""

    def scope(self, doc_tokens: Sequence[Sequence[int]] | None) -> None:
        """This request's retrieved documents (token lists; None: none), set before `start` by document QA,
        the service and the bench. Default: the proposer does not draft from documents."""

    def finish(self) -> None:
        """The request ended: free per-request state held elsewhere (a draft worker's). The service calls it
        when a stream closes, however it ended. Default: nothing."""

    # The drafter's role: `rasd` asks the proposer that drafts for it (local, or a draft worker's) these two.

    def root_probs(self, context: list[int]) -> torch.Tensor | None:
        """Next-token probabilities [vocab] after `context`, to prune other sources' branches with; None: this
        proposer has none (or not now), and branches are pruned by their counts. Default: None."""
        return None

    def gate_open(self, context: list[int], beside: DraftTree | None = None) -> bool:
        """Whether drafting pays this step (`beside`: the step's candidates from free sources); asked by `rasd`
        before it prunes with, and runs, its drafter. Default: always."""
        return True



# The optional hooks above, by name (the conformance test checks each against every registered method).
OPTIONAL_HOOKS = ("model", "wants_hidden", "feature_layers", "history", "observe_hidden", "use_sizer",
                  "set_datastores", "scope", "finish", "root_probs", "gate_open")
