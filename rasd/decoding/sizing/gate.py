"""Whether to run a model drafter at all this step: a two-armed bandit on committed tokens per second.

Why: the cost-aware sizer (`sizers.CostAwareSizer`) can drop every drafted node when they do not pay, but
by then the draft forwards have been paid for. On a CPU a self-draft token costs about a quarter of a target
step (EESD, N = 4 of 30 layers): where it is rarely right (Spec-Bench translation: 0.12 accepted tokens per
step) drafting makes decoding slower than plain decoding, and where retrieval already has the continuation
(extraction, document QA) the draft adds nothing to it. Predicting acceptance from the draft's own
probabilities needs them calibrated; measuring the outcome does not.

`DraftGate` measures it. Every step is credited to its arm, "draft" or "plain" (no model draft: the other
sources, or a plain step), in a context bucket the caller names (the retrieval match class for `rasd`):
the tokens it committed and its wall time, observed at the next `choose` (so it covers the drafts, the
verification and everything else the step did). Per bucket and arm the gate keeps decayed sums of both
(tokens/s = the ratio of the sums, the right mean for throughput). A bucket's choice holds for `block` of
its steps, then the better arm is taken again; the other arm gets a block after `explore_every` blocks, the
interval doubling while it keeps losing (at most `max_backoff` times): a drafter that never pays gets one
block in thirteen, a bound kept short because the kind of text changes between requests (with a back-off
of 32 blocks, a switch from coding prompts to translation would go unnoticed for up to 256 steps).
Blocks, not single steps: a draft that was idle pays a longer catch-up forward on its first step back
(measured: 30 ms against 22 ms for the EESD self-draft), and switching every step would pay it every
time; a block also gives the losing arm enough steps to be measured.

Output is unaffected: the gate only decides which candidates are proposed; verification decides the tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

DRAFT, PLAIN = True, False


@dataclass
class ArmStats:
    """Decayed sums of one arm's steps in one bucket (`pulls`: steps credited)."""

    tokens: float = 0.0
    seconds: float = 0.0
    pulls: int = 0

    def add(self, tokens: int, seconds: float, decay: float) -> None:
        self.tokens = self.tokens * decay + tokens
        self.seconds = self.seconds * decay + seconds
        self.pulls += 1

    @property
    def rate(self) -> float:
        """Committed tokens per second of the steps kept in the sums."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Bucket:
    """Both arms of one context bucket, its current choice and its exploration schedule."""

    arms: dict[bool, ArmStats] = field(default_factory=lambda: {DRAFT: ArmStats(), PLAIN: ArmStats()})
    arm: bool = DRAFT          # the current block's arm
    steps_left: int = 0        # steps left in the current block
    exploring: bool = False    # the current block pulls the losing arm
    since_other: int = 0       # blocks since the losing arm was last pulled
    backoff: int = 1           # the losing arm is pulled every explore_every * backoff blocks
    leader: bool = DRAFT       # the better arm when the current exploration began

    def best(self) -> bool:
        return DRAFT if self.arms[DRAFT].rate >= self.arms[PLAIN].rate else PLAIN


@dataclass
class Pending:
    """The step in progress: its arm, bucket, committed length, start time and the caller's step number."""

    arm: bool
    bucket: int
    length: int
    start: float
    step: int | None = None


class DraftGate:
    """Draft or not, per context bucket, by measured tokens per second (see the module docstring)."""

    def __init__(self, block: int = 8, explore_every: int = 3, max_backoff: int = 4, decay: float = 0.95,
                 clock: Callable[[], float] = time.perf_counter):
        self.block, self.explore_every, self.max_backoff, self.decay = block, explore_every, max_backoff, decay
        self.clock = clock
        self.buckets: dict[int, Bucket] = {}
        self.pending: Pending | None = None
        self.choices = {DRAFT: 0, PLAIN: 0}    # steps per arm (statistics, tests)

    def reset(self) -> None:
        """A new request: the time since the last step of the previous one is not a step."""
        self.pending = None

    def choose(self, context_len: int, bucket: int = 0, step: int | None = None) -> bool:
        """Credit the previous step to its arm, then say whether to run the drafter this step (True = draft).

        `step`: the caller's count of decoding steps, for a caller that does not ask every step (`rasd` asks its
        one-node arm only where nothing free matched): the previous step is credited only when it was the step
        just before, since the time and tokens in between belong to steps of no arm."""
        now = self.clock()
        self._record(context_len, now, step)
        state = self.buckets.setdefault(bucket, Bucket())
        if state.steps_left <= 0:
            self._next_block(state)
        state.steps_left -= 1
        self.pending = Pending(state.arm, bucket, context_len, now, step)
        self.choices[state.arm] += 1
        return state.arm

    def _record(self, context_len: int, now: float, number: int | None = None) -> None:
        """Credit the tokens committed since the pending step, and its time, to its bucket and arm."""
        step, self.pending = self.pending, None
        if step is not None and number is not None and step.step is not None and number != step.step + 1:
            return   # steps of no arm ran in between
        if step is not None and context_len > step.length:
            self.buckets[step.bucket].arms[step.arm].add(context_len - step.length, now - step.start, self.decay)

    def _next_block(self, state: Bucket) -> None:
        """Each arm's first block, then the leader, with a block of the other arm now and then."""
        if state.exploring:   # did the exploration change the leader? then explore eagerly again
            state.backoff = 1 if state.best() != state.leader else min(2 * state.backoff, self.max_backoff)
        state.steps_left, state.exploring = self.block, False
        for arm in (DRAFT, PLAIN):
            if state.arms[arm].pulls < self.block:
                state.arm = arm
                return
        state.arm = state.leader = state.best()
        state.since_other += 1
        if state.since_other >= self.explore_every * state.backoff:
            state.since_other, state.exploring = 0, True
            state.arm = not state.arm

    def share(self) -> float:
        """Fraction of steps that ran the drafter so far."""
        total = self.choices[DRAFT] + self.choices[PLAIN]
        return self.choices[DRAFT] / total if total else 0.0
