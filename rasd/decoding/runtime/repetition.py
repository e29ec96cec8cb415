"""The repetition stop: an answer ends when its newest `window` tokens repeat a span it already holds.

Why: a small model decoding greedily often loops (the same sentence again and again until `max_tokens`), and
copy-based drafting accepts a loop almost for free, so loops read broken and inflate speed. The rule stops a
loop once it is certain (the whole window repeats) and drops that window, so the answer keeps the loop's first
cycle once: output = plain decoding's output stopped by the rule, minus its last `window` tokens.

It is evaluated token by token on committed tokens, in the order plain decoding meets them, so every method
stops at the same token. While the newest tokens repeat an earlier span (but not yet a whole window) they may
still be dropped: a stream holds them back (`RepeatWatch.held`) and releases them once the repeat breaks, like a
partial stop string. In a normal answer that is a few tokens (a common word or two).

The longest suffix that occurs earlier comes from a suffix automaton (Blumer et al. 1985): after each appended
token, the suffix link of the state for the whole output names the longest suffix that also ends earlier;
amortized O(1) per token, so the rule costs nothing next to a decoding step however long the answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_WINDOW = 32     # tokens: longer than a phrase an answer may legitimately repeat, shorter than a sentence loop
MIN_WINDOW = 4          # a shorter window would stop on ordinary repeated phrases ("of the", "in the")
MAX_WINDOW = 1024


def check_window(window: int) -> int:
    """`window` if it is a usable repetition window, else a ValueError naming the range."""
    if isinstance(window, bool) or not isinstance(window, int) or not MIN_WINDOW <= window <= MAX_WINDOW:
        raise ValueError(f"the repetition window must be an integer from {MIN_WINDOW} to {MAX_WINDOW} tokens")
    return window


@dataclass
class _State:
    length: int                                    # longest string this state stands for
    link: int                                      # suffix link (-1 for the root)
    next: dict[int, int] = field(default_factory=dict)


class RepeatWatch:
    """Follows one output token by token: how many newest tokens repeat an earlier span, and when a whole
    `window` does."""

    def __init__(self, window: int = DEFAULT_WINDOW):
        self.window = check_window(window)
        self.states = [_State(0, -1)]
        self.last = 0            # the state of the whole output so far
        self.tokens = 0
        self.repeat = 0          # length of the longest suffix that also ends earlier in the output
        self.fired = False

    def push(self, token: int) -> bool:
        """Append one token; True when the newest `window` tokens now repeat an earlier span (the rule fires)."""
        self._extend(token)
        self.tokens += 1
        self.repeat = self.states[self.states[self.last].link].length if self.last else 0
        self.fired = self.fired or self.repeat >= self.window
        return self.fired

    @property
    def held(self) -> int:
        """Newest tokens that may still turn out to be a repeat, and so must not be shown yet."""
        return self.window if self.fired else min(self.repeat, self.window - 1)

    def _extend(self, token: int) -> None:
        """The suffix automaton's online extension by one symbol."""
        states = self.states
        cur = len(states)
        states.append(_State(states[self.last].length + 1, 0))
        p = self.last
        while p != -1 and token not in states[p].next:
            states[p].next[token] = cur
            p = states[p].link
        if p != -1:
            q = states[p].next[token]
            if states[p].length + 1 == states[q].length:
                states[cur].link = q
            else:
                clone = len(states)
                states.append(_State(states[p].length + 1, states[q].link, dict(states[q].next)))
                while p != -1 and states[p].next.get(token) == q:
                    states[p].next[token] = clone
                    p = states[p].link
                states[q].link = clone
                states[cur].link = clone
        self.last = cur


def first_repeat(tokens: list[int], window: int = DEFAULT_WINDOW) -> int | None:
    """The number of tokens after which the rule fires on `tokens` (None if it never does)."""
    watch = RepeatWatch(window)
    for i, token in enumerate(tokens):
        if watch.push(token):
            return i + 1
    return None


def cut_repeat(tokens: list[int], window: int = DEFAULT_WINDOW) -> tuple[list[int], bool]:
    """`tokens` as the rule leaves them: (stopped where it fires, minus the repeated window; whether it fired).
    What a method with the rule gives, from a reference decoded without it (or with an equivalent stop)."""
    end = first_repeat(tokens, window)
    return (list(tokens), False) if end is None else (list(tokens[: end - window]), True)


def repeats_at_end(tokens: list[int], window: int = DEFAULT_WINDOW) -> bool:
    """Whether the newest `window` of `tokens` repeat an earlier span of them (a stopping criterion's check)."""
    if len(tokens) <= window:
        return False
    tail = tokens[-window:]
    return any(tokens[j: j + window] == tail for j in range(len(tokens) - window))
