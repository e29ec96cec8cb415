"""When the tuned products and attention apply: per thread, inside `fast_kernels()`, outside `prefill_products()`.

Why a thread-local mode and not a model flag: one model serves the engine's fast path and HF baselines (and
tests comparing the two) in the same process, sometimes on different threads at once; the switch belongs to
the call, not to the weights.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class _Mode(threading.local):
    on = False        # inside `fast_kernels()`
    prefill = False   # inside `prefill_products()`


_MODE = _Mode()


def fast_enabled() -> bool:
    """Whether this thread is inside `fast_kernels()` (the engine's fast path; see also `fast_forward`)."""
    return _MODE.on


def tuned_products() -> bool:
    """Whether products take their tuned forms here: inside `fast_kernels()`, outside `prefill_products()`."""
    return _MODE.on and not _MODE.prefill


@contextmanager
def prefill_products() -> Iterator[None]:
    """Inside `fast_kernels()`, compute every product as `F.linear` for the block (attention keeps its kernels).

    Why: the rest of a prompt after a prefix-cache hit is a few rows, which a tuned form would multiply; its
    logits and keys must equal a whole-prompt prefill's bit for bit (hundreds of rows, always `F.linear`), or a
    request would decode differently with and without the cache. oneDNN's packed rows, for one, differ from MKL's
    in the last bit."""
    previous = _MODE.prefill
    _MODE.prefill = True
    try:
        yield
    finally:
        _MODE.prefill = previous


@contextmanager
def fast_kernels(enabled: bool = True) -> Iterator[None]:
    """Use the faster skinny products in this thread for the duration of the block."""
    previous = _MODE.on
    _MODE.on = enabled
    try:
        yield
    finally:
        _MODE.on = previous
