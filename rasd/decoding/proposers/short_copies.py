"""One-token copies of the request's own text, let into `rasd`'s tree only while they have been paying.

Why: beside a drafter, a one-token match of the request's own text offers a bush of continuations of a common
token that is rarely right, and `rasd` leaves it out (`CONTEXT_MIN_NGRAM_WITH_DRAFT`, +4.4% on Spec-Bench). But
where an answer copies its prompt token by token (a summary quoting its article), `pld` accepted 1.8 tokens a
step from such matches and `rasd` without them ran at 0.75x `pld` on the same prompt. Whether the copies would
have been right is known for free a few tokens later, once the text is written: every step's one-token trie is
scored against what followed, and the copies are offered while that running score beats what the drafter's own
nodes have been adding at the steps where nothing was copied (a copying step is one the draft gate gives to the
copies: beside a good head they took its steps at 1.9 tokens a step where the head made 2.4).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rasd.decoding.proposers.pld import NgramIndex, counted_trie
from rasd.decoding.step.tree import DraftTree

PENDING_CAP = 64   # tries waiting for their text; each resolves within `max_len` tokens, so this never binds


@dataclass
class ShortCopies:
    """Per request: the one-token match's trie where copies have been paying, else nothing.

    The score is the decayed mean of how many tokens each earlier trie would have had accepted (the longest
    path of it that the written text follows), over the steps that had a one-token match and no longer one.
    The copies go in once `min_evidence` decayed attempts averaged `min_tokens` or more, and more than the
    drafter's accepted nodes a step where it ran with nothing copied (`observe_rival`), when it has run.
    """

    source: str = "context"
    min_tokens: float = 1.0
    min_evidence: float = 4.0
    decay: float = 0.9
    max_matches: int = 8
    max_len: int = 10
    tokens: float = 0.0
    attempts: float = 0.0
    rival_tokens: float = 0.0
    rival_steps: float = 0.0
    _pending: list[tuple[int, DraftTree]] = field(default_factory=list)

    def reset(self) -> None:
        """A new request: its text, not the last one's, decides."""
        self.tokens, self.attempts, self._pending = 0.0, 0.0, []
        self.rival_tokens, self.rival_steps = 0.0, 0.0

    def pays(self) -> bool:
        """Whether the copies have been right often enough to take room in the tree."""
        bar = max(self.min_tokens, self.rival_tokens / self.rival_steps if self.rival_steps else 0.0)
        return self.attempts >= self.min_evidence and self.tokens >= bar * self.attempts

    def observe_rival(self, accepted: int) -> None:
        """The drafter's accepted nodes at a verified step where nothing was copied: what copies must beat."""
        self.rival_tokens = self.decay * self.rival_tokens + accepted
        self.rival_steps = self.decay * self.rival_steps + 1.0

    def tree(self, index: NgramIndex, context: list[int], max_nodes: int) -> DraftTree | None:
        """The one-token match's trie (bucket 1) when copies pay, else None; either way it is scored later.

        `index` is the request's n-gram index, already extended to `context`."""
        self._score(context)
        conts = index.continuations(1, self.max_matches, self.max_len)
        if not conts or max_nodes <= 0:
            return None
        trie = counted_trie(context[-1], conts, self.source, max_nodes)
        trie.bucket = 1
        self._pending = self._pending[-(PENDING_CAP - 1):] + [(len(context), trie)]
        return trie if self.pays() else None

    def _score(self, context: list[int]) -> None:
        """Fold every trie whose outcome the written text now decides into the running score."""
        waiting = []
        for start, trie in self._pending:
            accepted, decided = followed(trie, context[start:])
            if not decided:
                waiting.append((start, trie))
                continue
            self.tokens = self.decay * self.tokens + accepted
            self.attempts = self.decay * self.attempts + 1.0
        self._pending = waiting


def followed(trie: DraftTree, written: list[int]) -> tuple[int, bool]:
    """How many of `trie`'s tokens the written text follows from its root, and whether that is final (the text
    left the trie, or reached a leaf) rather than still being written."""
    node, depth = 0, 0
    for token in written:
        child = trie.child_with_token(node, token)
        if child is None:
            return depth, True
        node, depth = child, depth + 1
    return depth, not trie.children(node)
