"""Decoding statistics: a plain dataclass, kept apart from its exporters (JSON here; metrics elsewhere).

Names follow the field: `mean_accepted_tokens` counts the bonus token, so plain decoding is exactly 1.00.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class DecodeStats:
    """Counters and timers of one generation."""

    method: str = ""
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0          # prompt tokens whose K/V came from the prefix cache
    new_tokens: int = 0
    steps: int = 0                         # verification forwards after prefill
    num_draft_tokens: int = 0              # draft nodes sent to verification (root excluded)
    num_accepted_tokens: int = 0           # draft tokens accepted (bonus excluded)
    accept_lengths: list[int] = field(default_factory=list)        # per step, bonus counted
    accepted_per_position: list[int] = field(default_factory=list)  # [d]: steps that accepted depth d+1
    accepted_by_source: Counter = field(default_factory=Counter)     # source -> tokens; "bonus" included
    drafted_by_source: Counter = field(default_factory=Counter)      # source -> draft nodes verified
    tree_sizes: list[int] = field(default_factory=list)              # draft nodes per step
    # per step, the depth of the verified tree (0: a plain step); the accepted depth is `accept_lengths` - 1
    tree_depths: list[int] = field(default_factory=list)
    pruned_nodes: int = 0                  # candidate nodes dropped by proposer pruning (RASD) before sizing
    prefill_time_s: float = 0.0            # prompt forward up to the first new token
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    bookkeeping_time_s: float = 0.0
    total_time_s: float = 0.0
    finish_reason: str = ""

    def record_step(self, sources: list[str], accepted_sources: list[str], num_draft: int, tree_depth: int) -> None:
        """Account one verification step: `accepted_sources` are the sources of accepted draft nodes,
        `tree_depth` the depth of the verified tree (its deepest node; 0 for the root alone)."""
        self.steps += 1
        self.num_draft_tokens += num_draft
        self.tree_sizes.append(num_draft)
        self.tree_depths.append(tree_depth)
        self.drafted_by_source.update(sources)
        self.num_accepted_tokens += len(accepted_sources)
        self.accepted_by_source.update(accepted_sources)
        self.accepted_by_source["bonus"] += 1
        self.accept_lengths.append(len(accepted_sources) + 1)
        for depth in range(len(accepted_sources)):
            if depth == len(self.accepted_per_position):
                self.accepted_per_position.append(0)
            self.accepted_per_position[depth] += 1

    @property
    def decode_time_s(self) -> float:
        """Wall time after the first new token (the decoding phase)."""
        return max(self.total_time_s - self.prefill_time_s, 0.0)

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens committed per verification step, bonus included (plain decoding = 1.00)."""
        return (self.num_accepted_tokens + self.steps) / self.steps if self.steps else 1.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over drafted tokens (0 when nothing was drafted)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decode-phase throughput: new tokens after the first over the time after the first."""
        t = self.decode_time_s
        return (self.new_tokens - 1) / t if t > 0 and self.new_tokens > 1 else 0.0

    @property
    def e2e_tokens_per_s(self) -> float:
        """Throughput including prefill."""
        return self.new_tokens / self.total_time_s if self.total_time_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready view with the derived rates."""
        out = asdict(self)
        out["accepted_by_source"] = dict(self.accepted_by_source)
        out["drafted_by_source"] = dict(self.drafted_by_source)
        for name in ("decode_time_s", "mean_accepted_tokens", "acceptance_rate", "tokens_per_s",
                     "e2e_tokens_per_s"):
            out[name] = round(getattr(self, name), 4)
        for name in ("prefill_time_s", "draft_time_s", "verify_time_s", "bookkeeping_time_s", "total_time_s"):
            out[name] = round(out[name], 4)
        return out

    def summary(self) -> str:
        """One line for people."""
        src = ", ".join(f"{k} {v}" for k, v in sorted(self.accepted_by_source.items()))
        return (f"{self.new_tokens} tokens in {self.total_time_s:.2f}s ({self.tokens_per_s:.1f} tok/s decode), "
                f"{self.steps} steps, mean accepted {self.mean_accepted_tokens:.2f}, "
                f"accepted by source: {src or '-'}" + (f", pruned {self.pruned_nodes}" if self.pruned_nodes else ""))
