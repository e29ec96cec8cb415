"""The `Sizer` protocol: how much of a proposed draft tree one verification forward should check.

Every step the engine asks its sizer three things, in this order:

1. `budget(context_len)`: how many draft nodes to ask the proposers for (they stop there);
2. `cut(tree, context_len)`: the prefix-closed subtree of the proposed tree to verify (possibly the root
   alone: a plain decoding step);
3. `observe(tree, accepted, overhead_s, verify_s)`: learn from the verdict on the tree `cut` returned.

`plain_step_s(context_len)` reports a plain step's measured latency where the policy knows it (statistics,
batch width). `batch_sized` says whether a batch may size this row's tree jointly with the other rows'
(`sizing.batch_width`; such a sizer has an `estimator`, an `acceptance.AcceptanceEstimator`).

`state()` / `load_state(state)` carry what a sizer learned as plain JSON-able data, so that a later request
(the service's warm start) or another process can start from it without reading the sizer's attributes.
`load_state(s.state())` leaves a sizer deciding as `s` would from then on, as far as that knowledge goes; a
policy that learns nothing returns `{}`.

Exactness under sampling: a depth limit that does not look at the current step's tokens keeps every node
sampled from q with the chain it was drawn in (it is just a shorter draft), so it stays exact. A score cut
would drop a sampled node *because of its own value*, which biases the proposal away from q: the policies
therefore decide a sampled node by what was known before it was drawn (its parent's confidence, its depth),
and deterministic nodes by their own.

The policies by name live in `sizing.sizers` (`SIZINGS`, `make_sizer`).
"""

from __future__ import annotations

from typing import Any, Protocol

from rasd.decoding.step.tree import DraftTree


class Sizer(Protocol):
    """The interface every tree-size policy implements (see the module docstring)."""

    batch_sized: bool

    def budget(self, context_len: int) -> int:
        """Largest tree (draft nodes) worth asking proposers for."""
        ...

    def plain_step_s(self, context_len: int) -> float | None:
        """Latency of one plain decoding step at this context, if the policy measured it."""
        ...

    def cut(self, tree: DraftTree, context_len: int) -> DraftTree:
        """The prefix-closed subtree to verify."""
        ...

    def observe(self, tree: DraftTree, accepted: list[int], overhead_s: float,
                verify_s: float | None = None) -> None:
        """Learn from the verdict on `tree` (the tree `cut` returned)."""
        ...

    def state(self) -> dict[str, Any]:
        """What this sizer learned, as plain JSON-able data ({} when it learns nothing)."""
        ...

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from what `state()` of a sizer of the same kind returned."""
        ...


class SizerDefaults:
    """What a policy without a cost curve answers: no plain-step estimate, a batch keeps its own cut, and
    nothing learned to carry."""

    batch_sized = False   # True: a batch may size this row's tree jointly with the others (`sizing.batch_width`)

    def plain_step_s(self, context_len: int) -> float | None:
        """The measured latency of one plain decoding step at this context, when the policy knows it."""
        return None

    def state(self) -> dict[str, Any]:
        """A policy that learns nothing has nothing to carry."""
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        """Nothing to restore (see `state`)."""
