"""Whether to run a model drafter at all this step: a two-armed bandit on committed tokens per second.

Why: the cost-aware sizer (`cost_aware.CostAwareSizer`) can drop every drafted node when they do not pay, but
by then the draft forwards have been paid for. On a CPU a self-draft token costs a sizeable share of a target
step (EESD): where it is rarely right drafting makes decoding slower than plain decoding, and where retrieval
already has the continuation (extraction, document QA) the draft adds nothing to it. Predicting acceptance
from the draft's own probabilities needs them calibrated; measuring the outcome does not.

`DraftGate` measures it. Every step is credited to its arm, "draft" or "plain" (no model draft: the other
sources, or a plain step), in a context bucket the caller names (the retrieval match class for `rasd`):
the tokens it committed and its wall time, observed at the next `choose` (so it covers the drafts, the
verification and everything else the step did). A bucket's choice holds for `block` of its steps. The arms
are compared in pairs of adjacent blocks: each time a block of one arm follows a block of the other, the log
of their tokens/s ratio is one sample, and the sign of the samples' decayed sum says which arm leads. The first
blocks alternate; then the leader runs, with a block of the other arm after `explore_every` blocks, the
interval doubling while the other keeps losing (at most `max_backoff` times): a drafter that never pays gets
one block in thirteen, a bound kept short because the kind of text changes between requests.

Why pairs: the kind of text moves both arms' rates far more than the arms differ. Rates kept per arm
compared the leader's recent blocks with the other arm's blocks of hundreds of steps before, on other text,
and the gate then kept the slower arm on most prompts. Adjacent blocks see the same text, and a block of the
other arm between two of the leader's gives two samples whose drift cancels. Blocks, not single steps: a
draft that was idle pays a longer catch-up forward on its first step back, and switching every step would
pay it every time; a block also gives the losing arm enough steps to be measured.

Measurements behind these choices: docs/lab-notes/sizing.md, "gate".

Output is unaffected: the gate only decides which candidates are proposed; verification decides the tokens.
"""

from __future__ import annotations

import math
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


WARMUP, LEAD, EXPLORE, CONFIRM = "warmup", "lead", "explore", "confirm"   # a bucket's phases


@dataclass
class Bucket:
    """Both arms of one context bucket: rates (statistics), the paired comparison that decides, the schedule."""

    arms: dict[bool, ArmStats] = field(default_factory=lambda: {DRAFT: ArmStats(), PLAIN: ArmStats()})
    arm: bool = DRAFT          # the current block's arm
    steps_left: int = 0        # steps left in the current block
    block: ArmStats = field(default_factory=ArmStats)   # the current block's credited steps (undecayed)
    last: tuple[bool, float] | None = None   # the arm and tokens/s of the latest block with credited steps
    lead: float = 0.0          # decayed sum of the paired samples log(draft rate / plain rate)
    samples: int = 0
    phase: str = WARMUP        # alternating blocks / the leader / one block of the other / the leader after it
    since_other: int = 0       # leader blocks since the other arm was last pulled
    backoff: int = 1           # the other arm is pulled every explore_every * backoff blocks
    leader: bool = DRAFT

    def best(self) -> bool:
        """The arm the paired samples favour (draft on a tie)."""
        return DRAFT if self.lead >= 0 else PLAIN

    def pair(self, decay: float) -> None:
        """Close the block just run: one sample against the block before it when that was the other arm's."""
        rate = self.block.rate
        if rate > 0:
            if self.last is not None and self.last[0] != self.arm:
                sample = math.log(rate / self.last[1])
                self.lead = self.lead * decay + (sample if self.arm == DRAFT else -sample)
                self.samples += 1
            self.last = (self.arm, rate)
        self.block = ArmStats()


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
                 pair_decay: float = 0.8, warmup: int = 3, clock: Callable[[], float] = time.perf_counter):
        """`decay`: per step, of the arms' rates (statistics); `pair_decay`: per sample, of the paired
        comparison that decides; `warmup`: samples taken by alternating blocks before the leader runs."""
        self.block, self.explore_every, self.max_backoff, self.decay = block, explore_every, max_backoff, decay
        self.pair_decay, self.warmup = pair_decay, warmup
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
            state = self.buckets[step.bucket]
            state.arms[step.arm].add(context_len - step.length, now - step.start, self.decay)
            if step.arm == state.arm:
                state.block.add(context_len - step.length, now - step.start, 1.0)

    def _next_block(self, state: Bucket) -> None:
        """Close the block that ended, then pick the next one's arm by the bucket's phase."""
        started = state.arms[DRAFT].pulls + state.arms[PLAIN].pulls > 0   # read in the warm-up only
        state.pair(self.pair_decay)
        state.steps_left = self.block
        if state.phase == WARMUP:
            if state.samples < self.warmup:
                state.arm = (not state.arm) if started else DRAFT
                return
            state.phase, state.leader = LEAD, state.best()
        elif state.phase == EXPLORE:     # back to the leader: a second sample, drift cancelled
            state.phase = CONFIRM
            state.arm = state.leader
            return
        elif state.phase == CONFIRM:     # explore eagerly again when the other arm took the lead
            changed = state.best() != state.leader
            state.backoff = 1 if changed else min(2 * state.backoff, self.max_backoff)
            state.phase, state.leader = LEAD, state.best()
        else:
            state.since_other += 1
            if state.since_other >= self.explore_every * state.backoff:
                state.since_other, state.phase = 0, EXPLORE
                state.arm = not state.leader
                return
        state.arm = state.leader

    def share(self) -> float:
        """Fraction of steps that ran the drafter so far."""
        total = self.choices[DRAFT] + self.choices[PLAIN]
        return self.choices[DRAFT] / total if total else 0.0
