"""Whether to run a model drafter at all this step: a two-armed bandit on committed tokens per second.

Why: the cost-aware sizer (`control.CostAwareSizer`) can drop every drafted node when they do not pay, but
by then the draft forwards have been paid for. On a CPU a self-draft token costs about a quarter of a target
step (EESD, N = 4 of 30 layers): where it is rarely right (Spec-Bench translation: 0.12 accepted tokens per
step) drafting makes decoding slower than plain decoding, and where retrieval already has the continuation
(extraction, document QA) the draft adds nothing to it. Predicting acceptance from the draft's own
probabilities needs them calibrated; measuring the outcome does not.

`DraftGate` measures it. A pull of one arm, "draft" or "plain" (no model draft: the other sources, or a
plain step), lasts `block` steps in one context bucket the caller names (the retrieval match class for
`rasd`). Its reward is observed at the `choose` after it: tokens committed since the pull began and the
wall time since, which covers the drafts, the verifications and everything else the steps did. Blocks,
not single steps: one step's token count is too noisy to compare arms that differ by 10%, and a draft
that was idle pays a longer catch-up forward on its first step back (measured: 30 ms against 22 ms for
the EESD self-draft), which a one-step pull would charge in full. Per bucket and arm the gate keeps decayed sums
of both (tokens/s = the ratio of the sums, the right mean for throughput) and picks the better arm;
the other arm is tried again after `explore_every` steps, the interval doubling while it keeps losing
(at most `max_backoff` times), so a drafter that never pays costs about one step in a hundred.

Output is unaffected: the gate only decides which candidates are proposed; verification decides the tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

DRAFT, PLAIN = True, False


@dataclass
class ArmStats:
    """Decayed sums of one arm's pulls in one bucket."""

    tokens: float = 0.0
    seconds: float = 0.0
    pulls: int = 0

    def add(self, tokens: int, seconds: float, decay: float) -> None:
        self.tokens = self.tokens * decay + tokens
        self.seconds = self.seconds * decay + seconds
        self.pulls += 1

    @property
    def rate(self) -> float:
        """Committed tokens per second of the pulls kept in the sums."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Bucket:
    """Both arms of one context bucket and its exploration schedule."""

    arms: dict[bool, ArmStats] = field(default_factory=lambda: {DRAFT: ArmStats(), PLAIN: ArmStats()})
    since_other: int = 0       # steps since the losing arm was last pulled
    backoff: int = 1           # the losing arm is pulled every explore_every * backoff steps
    leader: bool = DRAFT       # the better arm when the last exploration was scheduled

    def best(self) -> bool:
        return DRAFT if self.arms[DRAFT].rate >= self.arms[PLAIN].rate else PLAIN


@dataclass
class Pending:
    """The pull in progress: its arm, bucket, committed length and start time."""

    arm: bool
    bucket: int
    length: int
    start: float
    exploring: bool
    steps_left: int


class DraftGate:
    """Draft or not, per context bucket, by measured tokens per second (see the module docstring)."""

    def __init__(self, block: int = 8, explore_every: int = 4, max_backoff: int = 8, decay: float = 0.8,
                 min_pulls: int = 2, clock: Callable[[], float] = time.perf_counter):
        self.block = block
        self.explore_every, self.max_backoff, self.decay, self.min_pulls = explore_every, max_backoff, decay, min_pulls
        self.clock = clock
        self.buckets: dict[int, Bucket] = {}
        self.pending: Pending | None = None
        self.choices = {DRAFT: 0, PLAIN: 0}    # pulls per arm (statistics, tests)

    def reset(self) -> None:
        """A new request: the time since the last step of the previous one is not a step."""
        self.pending = None

    def choose(self, context_len: int, bucket: int = 0) -> bool:
        """Say whether to run the drafter this step (True = draft): the current pull's arm while it lasts,
        else record its reward and start a new pull."""
        pull = self.pending
        if pull is not None and pull.steps_left > 0 and pull.bucket == bucket and context_len > pull.length:
            pull.steps_left -= 1
            self.choices[pull.arm] += 1
            return pull.arm
        now = self.clock()
        self._record(context_len, now)
        state = self.buckets.setdefault(bucket, Bucket())
        arm, exploring = self._pick(state)
        self.pending = Pending(arm, bucket, context_len, now, exploring, self.block - 1)
        self.choices[arm] += 1
        return arm

    def _record(self, context_len: int, now: float) -> None:
        """Credit the tokens committed since the pending pull, and the time it took, to its arm."""
        pull, self.pending = self.pending, None
        if pull is None or context_len <= pull.length:
            return
        state = self.buckets[pull.bucket]
        state.arms[pull.arm].add(context_len - pull.length, now - pull.start, self.decay)
        if pull.exploring:   # did the exploration change the leader? then explore eagerly again
            state.backoff = 1 if state.best() != state.leader else min(2 * state.backoff, self.max_backoff)

    def _pick(self, state: Bucket) -> tuple[bool, bool]:
        """(arm, exploring): each arm's first pulls, then the leader, with the other arm now and then."""
        for arm in (DRAFT, PLAIN):
            if state.arms[arm].pulls < self.min_pulls:
                return arm, False
        leader = state.best()
        state.since_other += 1
        if state.since_other >= self.explore_every * state.backoff:
            state.since_other, state.leader = 0, leader
            return not leader, True
        return leader, False

    def share(self) -> float:
        """Fraction of steps that ran the drafter so far."""
        total = self.choices[DRAFT] + self.choices[PLAIN]
        return self.choices[DRAFT] / total if total else 0.0
