"""Sampling parameters and the logits warping shared by plain and speculative sampling.

Speculative sampling is exact only if the verifier warps the target's logits exactly as plain sampling
would (temperature, then top-k, then top-p, like HF's processors), so both paths call `target_probs`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature == 0 means greedy decoding (argmax of the raw logits)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

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
