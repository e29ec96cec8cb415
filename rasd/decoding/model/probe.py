"""How fast this machine is right now: one fixed product, timed, to tell a busy measurement from a slow machine.

Measurements that are cached for the machine (the verification cost curve, the kernel forms) carry the probe
taken when they were made. Why: one taken while another process held the cores (a test run, a training job,
a second replica loading) is slower everywhere and, once cached, would steer decoding for ever. A cached
measurement whose probe ran clearly slower than the probe now is measured again.
"""

from __future__ import annotations

import time

import torch

# A measurement whose probe ran this much slower than the probe now was made on a busy machine.
STALE_PROBE_RATIO = 1.25


def machine_probe(rounds: int = 15) -> float:
    """Fastest of a few runs of a fixed small matrix product, in seconds."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 576, generator=gen), torch.randn(576, 1536, generator=gen)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(rounds):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
    return best


def was_busy(then_s: float | None, now_s: float) -> bool:
    """Whether a probe of `then_s` (None: not recorded) ran clearly slower than one of `now_s`."""
    return then_s is not None and then_s > STALE_PROBE_RATIO * now_s
