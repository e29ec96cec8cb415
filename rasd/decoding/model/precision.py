"""Which dtype a target runs in on this machine (`--dtype auto`): measured, not assumed.

Why measured: a decoding step of a small model streams every weight once, so fewer bytes per weight is most of
the speed; but bf16 is only fast where the device computes it natively (AVX512-BF16 or AMX CPUs, CUDA), a
quantized kernel's speed depends on the CPU, and a dtype is only usable if speculative decoding in it reproduces
plain decoding in it token for token, which needs every tree node computed bit for bit as plain decoding computes
it (`fast_forward.row_exact`). So `auto` lists the candidates, times a typical request in each (a 512-token
prefill, then plain steps and 8- and 32-node tree steps), checks that a tree's logits equal the sequential
steps' bit for bit, and keeps the fastest exact one (fp32, the reference precision, is always a candidate and
wins ties within 5%). The choice is kept per machine, model and thread count in
`$RASD_HOME/precision/<machine>.json`, so the next
process reads it instead of measuring again.

The candidates: fp32 and, where native, bf16. Weight-only int8 / int4 (`kernels.quantized`) are asked for, not
chosen: a single request's timing favoured int4 for the embedded model (4-bit by origin), but the service under
8 concurrent requests was much slower in int4 than in fp32 (docs/lab-notes/precision.md), so `auto` does not
quantize.

`RASD_DTYPE_CANDIDATES=float32,...` replaces the list (the test suite pins float32); `RASD_NATIVE_BF16=0|1`
overrides the device check (a test forcing a machine without native bf16).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from rasd.fsio import write_json_atomic
from rasd.paths import rasd_home, slug

AUTO = "auto"
REFERENCE = "float32"
PROBE_VERSION = 4            # bump when what is timed or checked changes what wins
CONTEXT_TOKENS = 512         # the probe's prompt: a typical document-QA request's context
TREE_NODES = 8               # the tree step timed beside a plain one (a chain: every node's path in place)
LONG_NODES = 32              # and a long one: a copied answer's chain, or 8 batched rows of 4-node trees
STEPS = 64                   # a typical answer's decoding steps: half plain, a quarter each 8- and 32-node trees
ROUNDS = 7                   # timed repetitions of the steps (the median is kept)
MARGIN = 0.95                # a candidate must beat fp32 by 5% to be chosen over it


@dataclass
class DtypeChoice:
    """What `auto` chose and why, as shown at start and in `/healthz`."""

    dtype: str                                               # the dtype the model runs in
    reason: str                                              # one line for a person
    step_ms: dict[str, float] = field(default_factory=dict)  # candidate -> ms of a typical request (`_time_and_check`)
    exact: dict[str, bool] = field(default_factory=dict)     # candidate -> tree logits == sequential steps'

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def native_bf16(device: str) -> bool:
    """Whether `device` computes bf16 natively: CUDA with bf16 support; a CPU with AVX512-BF16 or AMX."""
    forced = os.environ.get("RASD_NATIVE_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


def candidates(device: str, name: str = "") -> list[str]:
    """The dtypes worth timing for model `name` on `device`: fp32 always, bf16 where it is native
    (`RASD_DTYPE_CANDIDATES` replaces the list, e.g. `float32,bfloat16,int4`)."""
    forced = os.environ.get("RASD_DTYPE_CANDIDATES")
    if forced:
        return [d.strip() for d in forced.split(",") if d.strip()]
    return [REFERENCE] + (["bfloat16"] if native_bf16(device) else [])


def choose(name: str, device: str, load: Callable[[str], Any]) -> DtypeChoice:
    """The dtype for model `name` on `device`: read from this machine's file, else measured and saved there.

    `load(dtype)` returns a `LoadedModel` in that dtype (the caller's loader, so a test can pass its own)."""
    options = candidates(device, name)
    if len(options) == 1:
        why = ("the only candidate (RASD_DTYPE_CANDIDATES)" if os.environ.get("RASD_DTYPE_CANDIDATES")
               else f"{device} has no native bf16")
        return DtypeChoice(options[0], f"{options[0]}: {why}")
    key = _key(name, device, options)
    known = _read(key)
    if known is not None:
        return known
    choice = measure(options, load)
    _write(key, choice)
    return choice


def measure(options: list[str], load: Callable[[str], Any]) -> DtypeChoice:
    """Time and check every candidate; keep the fastest exact one (fp32 unless another beats it by `MARGIN`)."""
    step_ms, exact = {}, {}
    for dtype in options:
        print(f"rasd: timing the model in {dtype} (once per machine)", file=sys.stderr)
        loaded = load(dtype)
        step_ms[dtype], exact[dtype] = _time_and_check(loaded.model)
        del loaded
    usable = [d for d in options if d == REFERENCE or exact[d]]
    best = min(usable, key=step_ms.__getitem__)
    if best != REFERENCE and step_ms[best] > MARGIN * step_ms[REFERENCE]:
        best = REFERENCE
    return DtypeChoice(best, _reason(best, step_ms, exact), step_ms, exact)


def _reason(best: str, step_ms: dict[str, float], exact: dict[str, bool]) -> str:
    """One line: the chosen dtype, the request times, and any candidate left out for not being exact."""
    times = ", ".join(f"{d} {ms / 1000:.2f} s" for d, ms in step_ms.items())
    inexact = [d for d, ok in exact.items() if d != REFERENCE and not ok]
    why = f"; {', '.join(inexact)} not exact against its own plain decoding here" if inexact else ""
    return (f"{best}: the fastest exact dtype here (a {CONTEXT_TOKENS}-token prompt and {STEPS} steps, 8- and "
            f"{LONG_NODES}-node trees among them: {times}){why}")


@torch.inference_mode()
def _time_and_check(model: torch.nn.Module) -> tuple[float, bool]:
    """(ms of a typical request: a `CONTEXT_TOKENS` prefill, then `STEPS` steps, half plain, a quarter 8-node and a
    quarter 32-node chains, each step's time the median of `ROUNDS`; whether the 8-node chain's logits equal the
    sequential plain steps' bit for bit). Runs the engine's own forward (`fast_kernels`).

    Why the long chain: a tree's cost per node differs most between dtypes where exactness costs a call per node
    (`exact_attention`); a service verifies long chains (an answer given before) and batches of trees, which a
    single 8-node step would not show (int4 won a single-request timing and lost as a service)."""
    from rasd.decoding.model import fast_forward
    from rasd.decoding.model.kernels import fast_kernels, install, prefill_products
    from rasd.decoding.step.cache import TreeCache
    from rasd.decoding.step.tree import DraftTree
    from rasd.decoding.step.verify import tree_forward

    install(model)
    gen = torch.Generator().manual_seed(0)
    vocab = int(model.config.vocab_size)
    prompt = torch.randint(0, vocab, (1, CONTEXT_TOKENS), generator=gen)
    chain = torch.randint(0, vocab, (TREE_NODES,), generator=gen).tolist()
    with fast_kernels(True):
        prefill_s = []
        for _ in range(2):   # the first warms the kernels up
            cache = TreeCache.for_model(model)
            t0 = time.perf_counter()
            with prefill_products():
                fast_forward.prefill(model, cache, prompt)
            prefill_s.append(time.perf_counter() - t0)
        sequential = [tree_forward(model, cache, DraftTree.root_only(t))[0] for t in chain]
        trees = {"plain": DraftTree.root_only(chain[0]), "tree": DraftTree.chain(chain[0], chain[1:], "probe"),
                 "long": DraftTree.chain(chain[0], (chain * (LONG_NODES // TREE_NODES))[1:], "probe")}
        times: dict[str, list[float]] = {name: [] for name in trees}
        for _ in range(ROUNDS):
            for name, tree in trees.items():
                cache.crop(-(cache.get_seq_length() - CONTEXT_TOKENS))
                t0 = time.perf_counter()
                logits = tree_forward(model, cache, tree)
                times[name].append(time.perf_counter() - t0)
                if name == "tree":
                    exact = all(torch.equal(logits[i], sequential[i]) for i in range(TREE_NODES))
    step = {name: statistics.median(t) for name, t in times.items()}
    request = prefill_s[-1] + STEPS / 2 * step["plain"] + STEPS / 4 * (step["tree"] + step["long"])
    return request * 1000, exact


# ---------------------------------------------------------------------- this machine's file
def _key(name: str, device: str, options: list[str]) -> str:
    return f"{slug(name)}|{device}|{torch.get_num_threads()}|{'+'.join(options)}|v{PROBE_VERSION}"


def choices_path() -> Path:
    """`$RASD_HOME/precision/<machine>.json`: the dtype chosen per model, device and thread count."""
    from rasd.decoding.model.kernels import machine_id

    return rasd_home() / "precision" / f"{slug(machine_id())}.json"


def _rows() -> dict[str, Any]:
    try:
        rows = json.loads(choices_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return rows if isinstance(rows, dict) else {}


def _read(key: str) -> DtypeChoice | None:
    try:
        row = _rows().get(key)
        return DtypeChoice(**row) if isinstance(row, dict) else None
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def _write(key: str, choice: DtypeChoice) -> None:
    path = choices_path()
    rows = _rows()
    rows[key] = choice.to_json()
    try:
        write_json_atomic(path, rows)
    except OSError:
        pass   # a read-only home: the next process measures again
