"""The target's verification cost curve: forward latency against the number of tree tokens.

On a CPU a 64-token tree costs several times one token; on a GPU almost the same as one (measured curves:
docs/lab-notes/sizing.md, "cost"). Tree sizing is only sensible against the real curve of the real model on
the real device, so it is measured once per
(model, device, dtype, torch threads, context bucket) and cached as JSON under `$RASD_HOME/cost/`.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from rasd.decoding.model import fast_forward
from rasd.decoding.model.kernels import fast_kernels, install
from rasd.decoding.model.probe import machine_probe, was_busy
from rasd.decoding.model.static_step import StaticRows, StepConfig
from rasd.decoding.step.cache import TreeCache
from rasd.decoding.step.tree import DraftTree
from rasd.decoding.step.verify import tree_forward
from rasd.fsio import atomic_file
from rasd.paths import cost_dir

# Every size up to 6, then two between each power of two. Why not powers of two alone: the kernels change
# form at 4 and 8 rows (`kernels._BUCKETS`), so a tree between two measured sizes costs more than the line
# between them says, and the sizer chose mid-sized trees as if they were cheap (docs/lab-notes/sizing.md).
DEFAULT_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)
CONTEXT_BUCKETS = (256, 1024, 2048, 4096)
# Part of the cache key: bump it whenever the verification kernels change cost, so that curves measured
# with older kernels are measured again instead of steering tree sizes for ever.
CURVE_VERSION = 12  # 3: the lean forward; 4: a load probe beside the latencies; 5: one-row kernels tuned;
# 6: layer kernels chosen in passes over the whole model (a plain step got cheaper against a tree);
# 7: sizes between the powers of two (`DEFAULT_SIZES`); 8: kernel forms re-measured when tuned on a busy machine;
# 9: one form for every layer shape where a whole pass of it beats the per-shape mix; 10: sizes timed up and down;
# 11: oneDNN's packed form among the kernel forms;
# 12: q/k/v and gate/up stacked into one product each (`fast_forward.projections`)
# A curve read (and its probe checked) in this process is trusted for this long: a service builds a decoder
# per request, and reading the file plus timing the probe delayed every request's first token.
TRUSTED_FOR_S = 60.0
_TRUSTED: dict[Path, tuple[float, CostCurve]] = {}   # curve file -> (when checked, curve)


@dataclass
class CostCurve:
    """Median forward latency (seconds) for trees of `sizes` tokens (root included)."""

    key: str
    context_len: int
    sizes: list[int]
    latency_s: list[float]
    probe_s: float | None = None   # `machine_probe()` when the curve was measured (None: not recorded)

    def latency(self, n_tokens: int) -> float:
        """Interpolated latency of a forward over `n_tokens` tree tokens (linear beyond the last size)."""
        n = max(1, n_tokens)
        i = bisect_left(self.sizes, n)
        if i < len(self.sizes) and self.sizes[i] == n:
            return self.latency_s[i]
        if i == 0:
            return self.latency_s[0]
        if i == len(self.sizes):
            i = len(self.sizes) - 1
        x0, x1 = self.sizes[i - 1], self.sizes[i]
        y0, y1 = self.latency_s[i - 1], self.latency_s[i]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1]

    def relative(self) -> list[float]:
        """Latency of each size over the latency of one token (what a person wants to see)."""
        return [lat / self.latency_s[0] for lat in self.latency_s]


def context_bucket(context_len: int) -> int:
    """The measured bucket nearest to a context length on a log scale (cost grows slowly with context)."""
    return min(CONTEXT_BUCKETS, key=lambda b: abs(math.log(b) - math.log(max(context_len, 1))))


def curve_key(model: torch.nn.Module, name: str, device: str, dtype: str, bucket: int,
              step: StepConfig | None = None) -> str:
    """Cache key: a model identity (name + config hash), device, dtype, threads, context bucket, and the
    verification path when it is not the dynamic one (a captured step costs something else)."""
    cfg = json.dumps(model.config.to_dict(), sort_keys=True, default=str)
    digest = hashlib.sha256(cfg.encode()).hexdigest()[:10]
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[-40:]
    path = f"-{step.label}" if step is not None and step.applies(model) else ""
    return (f"{safe}-{digest}-{device.replace(':', '')}-{dtype}-t{torch.get_num_threads()}-ctx{bucket}{path}"
            f"-v{CURVE_VERSION}")


@torch.inference_mode()
def measure_curve(model: torch.nn.Module, context_len: int, sizes: tuple[int, ...] = DEFAULT_SIZES,
                  repeats: int = 5, key: str = "", progress: bool = True, step: StepConfig | None = None,
                  heartbeat: Callable[[], None] | None = None) -> CostCurve:
    """Time tree verification forwards of each size on top of a `context_len`-token cache.

    A chain tree is used: the mask shape, not its pattern, decides the cost. The fastest of `repeats`
    rounds after one warm-up is kept (other processes only ever add time, and a curve measured during a
    burst of load would otherwise forbid speculation until it is re-measured), and latencies are made
    non-decreasing (noise must not make a bigger tree look cheaper than a smaller one). `heartbeat` is called
    after every round: a service's health check must not take a long first measurement for a stuck loop.
    """
    device = next(model.parameters()).device
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (1, context_len), generator=gen).to(device)
    install(model)
    probe = machine_probe()
    cache = TreeCache.for_model(model)
    fast_forward.prefill(model, cache, context)
    forward = _timed_forward(model, cache, step)
    trees = {size: DraftTree.chain(1, [int(t) for t in torch.randint(0, vocab, (size - 1,), generator=gen)],
                                   "probe") for size in sizes}
    times: dict[int, list[float]] = {size: [] for size in sizes}
    # Rounds over all sizes (not all repeats of one size in a row), so drift hits every size alike, in turn up
    # and down: in rounds all going up, one token always came right after the 64-token forward, and curves said
    # 1 and 2 tokens cost the same where decoding paid more for two (docs/lab-notes/sizing.md).
    for rep in tqdm(range(repeats + 1), desc="measuring verification cost curve", disable=not progress,
                    leave=False):
        for size in (sizes if rep % 2 == 0 else tuple(reversed(sizes))):
            _sync(device)
            t0 = time.perf_counter()
            with fast_kernels():
                forward(trees[size])
            _sync(device)
            if rep:
                times[size].append(time.perf_counter() - t0)
        if heartbeat is not None:
            heartbeat()
    probe = (probe + machine_probe()) / 2   # load before and after the timings
    latencies = [min(times[size]) for size in sizes]
    for i in range(1, len(latencies)):
        latencies[i] = max(latencies[i], latencies[i - 1])
    return CostCurve(key=key, context_len=context_len, sizes=list(sizes), latency_s=latencies, probe_s=probe)


def _timed_forward(model: torch.nn.Module, cache: TreeCache, step: StepConfig | None
                   ) -> Callable[[DraftTree], None]:
    """One verification forward of a tree on top of `cache`'s context, undone afterwards: the dynamic
    path's, or the static one's (the curve must price the forward the engine will run)."""
    if step is None or not step.applies(model):
        def dynamic(tree: DraftTree) -> None:
            tree_forward(model, cache, tree)
            cache.crop(-len(tree))
        return dynamic
    rows = StaticRows(model, 1, graphs=step.graphs)
    rows.add_row(cache)

    def static(tree: DraftTree) -> None:
        rows.forward([tree])
        rows.keep_rows(rows.get_seq_length(), [[]])
    return static


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_or_measure(model: torch.nn.Module, name: str, device: str, dtype: str, context_len: int,
                    cache_dir: Path | None = None, step: StepConfig | None = None,
                    heartbeat: Callable[[], None] | None = None) -> CostCurve:
    """The cached curve for this (model, device, dtype, threads, bucket, path), measuring it on first use."""
    bucket = context_bucket(context_len)
    key = curve_key(model, name, device, dtype, bucket, step)
    folder = cache_dir or cost_dir()
    path = folder / f"{key}.json"
    trusted = _TRUSTED.get(path)
    if trusted is not None and time.monotonic() - trusted[0] < TRUSTED_FOR_S and path.exists():
        return trusted[1]
    curve = _read_or_measure(model, path, key, bucket, step, heartbeat)
    _TRUSTED[path] = (time.monotonic(), curve)
    return curve


def _read_or_measure(model: torch.nn.Module, path: Path, key: str, bucket: int,
                     step: StepConfig | None = None, heartbeat: Callable[[], None] | None = None) -> CostCurve:
    """The curve on disk unless it is unreadable or was measured on a busier machine; else a new one."""
    if path.exists():
        try:
            cached = CostCurve(**json.loads(path.read_text()))
        except (ValueError, TypeError):
            cached = None   # a corrupt file is re-measured, never trusted
        if cached is not None and not _measured_busy(cached):
            return cached
    curve = measure_curve(model, bucket, key=key, step=step, heartbeat=heartbeat)
    _atomic_write_json(path, asdict(curve))
    return curve


FLAT_CURVE_RATIO = 1.15   # verifying 16 tree tokens costs < 15% more than one: extra nodes are nearly free


def flat_nodes(curve: CostCurve, ratio: float = FLAT_CURVE_RATIO) -> int:
    """Draft nodes that verify for at most `ratio` x one token's latency (a few on a CPU, most on a GPU), >= 1.

    OPT-Tree's n, tied to the measured curve: the paper's n = 60 assumes a GPU, where wider trees are free.
    """
    one = curve.latency(1)
    fits = [n for n in curve.sizes if curve.latency(n) <= ratio * one]
    return max(max(fits, default=1) - 1, 1)


def curve_is_flat(curve: CostCurve, tokens: int = 16) -> bool:
    """Whether a 16-token tree costs about as much as one token (a GPU's curve; not a CPU's)."""
    return curve.latency(tokens) < FLAT_CURVE_RATIO * curve.latency(1)


def _measured_busy(curve: CostCurve) -> bool:
    """Whether the machine was clearly busier when `curve` was measured than it is now (then re-measure)."""
    return curve.probe_s is not None and was_busy(curve.probe_s, machine_probe())


def _atomic_write_json(path: Path, data: dict) -> None:
    """Write to a temporary file, fsync, rename: readers never see half a file."""
    with atomic_file(path) as fh:
        json.dump(data, fh)
