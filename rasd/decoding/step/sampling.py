"""Sampling parameters and the logits warping shared by plain and speculative sampling.

Speculative sampling is exact only if the verifier warps the target's logits exactly as plain sampling
would (temperature, then top-k, then top-p, like HF's processors), so both paths call `target_probs`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature == 0 means greedy decoding (argmax of the processed logits).

    The penalties and `logit_bias` ((token id, bias) pairs) are applied before temperature, top-k and top-p,
    to every tree node from its own path (`decoding.logits`)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: str | None = None   # an llguidance grammar (`decoding.grammar.json_grammar`): constrained decoding

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number")
        if any(not math.isfinite(b) for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be finite numbers")

    @property
    def processes_logits(self) -> bool:
        """Whether a penalty, a bias or a grammar changes the target's logits (`decoding.logits`)."""
        return (self.repetition_penalty != 1.0 or bool(self.frequency_penalty) or bool(self.presence_penalty)
                or bool(self.logit_bias) or self.grammar is not None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A generator seeded from `seed` (or from torch's global RNG when no seed is given)."""
        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed if self.seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
        return gen


GREEDY = SamplingParams()


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Warp logits [..., vocab] into the sampling distribution [..., vocab] (float32)."""
    logits = logits.float() / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, gen: torch.Generator) -> int:
    """Draw one token id from a probability vector [vocab]."""
    return int(torch.multinomial(probs, 1, generator=gen).item())


def next_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """The token plain decoding would emit from logits [vocab]."""
    if params.greedy:
        return int(logits.argmax(-1).item())
    assert gen is not None
    return sample(target_probs(logits, params), gen)
