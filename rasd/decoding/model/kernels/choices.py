"""Which product form (`forms`) each weight shape and row count takes on this machine: measured, not assumed,
and kept for the machine so that the next process reads them instead of timing again.

Keys are (out, in, M bucket, dtype, threads, head flag or "bare", approximate); M buckets are 1, 2, 3, 4, 8,
..., 64 (`BUCKETS`). The forms are chosen when `install` patches a model (`tune`), layer weights in passes over
the whole model as a decoding step reads them (`sweep`); a shape first met later is timed then. They are kept in
`$RASD_HOME/kernels/<machine>.json` with the machine probe of their measurement; `RASD_LINEAR=stock|transposed|
packed|padded|onednn|half` forces one form (never saved). Measurements: docs/lab-notes/decoding-speed.md,
"Kernels".

All of it is one `KernelChoices` object (`ACTIVE`), one per process: the forms depend on the machine, not on a
model, so a shape measured for the target serves its draft too. A test that wants a new process swaps in a
fresh one.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from rasd.decoding.model.kernels.forms import (
    COPIES,
    FORMS,
    HALF,
    PACKED_FORMS,
    PADDED,
    STOCK,
    can_pack,
    half,
    onednn_available,
    pack,
    packed_product,
    packing_available,
    unpacked,
    unpacked_form,
)
from rasd.decoding.model.probe import machine_probe, was_busy
from rasd.fsio import write_json_atomic
from rasd.paths import kernel_choices_path

CHOICES_VERSION = 4                       # bump when a form's code or the timing changes what wins
TUNE_ROUNDS = 5
MAX_TUNED_ROWS = 64   # trees; a prefill (hundreds of rows) is not skinny: stock, and no timing on the way
BUCKETS = (1, 2, 3, 4, 8, 16, 32, 64)    # row counts timed at `install`; others take the next one up
EVICT_BYTES = 64 << 20   # more than a core's last-level cache on the machines seen (`KernelChoices.evict`)

Key = tuple[Any, ...]


def rows_bucket(rows: int) -> int:
    """1, 2, 3, then powers of two (5-8 -> 8, ...): `BUCKETS`."""
    return rows if rows <= 3 else 1 << (rows - 1).bit_length()


def key(weight: torch.Tensor, rows: int, head: bool | str, approximate: bool = False) -> Key:
    """A choice's key: (out, in, M bucket, dtype, threads, head flag or "bare", approximate)."""
    return (*weight.shape, rows_bucket(rows), weight.dtype, torch.get_num_threads(), head, approximate)


def forced_form() -> str:
    """`RASD_LINEAR` ("auto": measure)."""
    return os.environ.get("RASD_LINEAR", "auto")


class KernelChoices:
    """The forms chosen in this process, what the machine's file holds, and when each was measured."""

    def __init__(self) -> None:
        self.choices: dict[Key, str] = {}   # key -> form
        self.saved: dict[Key, str] = {}     # what this machine's file holds (read, or written by this process)
        self.loaded: set[str] = set()       # the files read in this process
        self.forced: set[Key] = set()       # keys set by `RASD_LINEAR`, not measured
        self.probes: dict[Key, float] = {}  # key -> `machine_probe()` when measured: a busy one is measured again
        self._evict_buffer: torch.Tensor | None = None

    # ------------------------------------------------------------------ lookups
    def form(self, weight: torch.Tensor, rows: int, head: bool, bare: bool = False, approximate: bool = False
             ) -> str:
        """The fastest form for this weight shape and row count (measured once per process and key). `bare`: a
        weight without a module (`linear.product`): timed with the cache emptied before every product, as
        decoding reads it after the target's weights, and never packed (no module to keep the packed copy on).
        `approximate`: a draft head's weight, which may take the `HALF` form (timed cold too)."""
        k = key(weight, rows, "bare" if bare else head, approximate)
        choice = self.choices.get(k)
        if choice is None:   # the environment is read here, once per key, not on every product
            forced = forced_form()
            if forced in PACKED_FORMS and (bare or not can_pack(weight, forced)):
                forced = STOCK
            if forced == PADDED:   # padding is a one- and three-row form
                forced = unpacked_form(k[2])
            if forced == HALF and not approximate:   # never the target's products
                forced = STOCK
            if forced in FORMS:
                self.forced.add(k)   # never written to the machine's file
            choice = (forced if forced in FORMS
                      else time_forms(self, weight, k[2], head, cold=bare or approximate, approximate=approximate,
                                      packable=not bare))
            self.choices[k] = choice
        return choice

    def readable(self) -> dict[str, str]:
        """What was measured so far: "out x in @ M" (" head", " approximate") -> form."""
        return {f"{k[0]}x{k[1]}@{k[2]}{' head' if k[5] else ''}{' approximate' if k[6] else ''}": v
                for k, v in sorted(self.choices.items(), key=lambda kv: kv[0][:3])}

    def evict(self) -> None:
        """Touch a buffer larger than the last-level cache, so that the next product reads its weight from
        memory."""
        if self._evict_buffer is None:
            self._evict_buffer = torch.zeros(EVICT_BYTES // 4)
        self._evict_buffer.add_(1.0)

    # ------------------------------------------------------------------ the machine's file
    def load(self) -> None:
        """The forms measured by earlier processes on this machine (once per file and process).

        Why: timing every shape and bucket costs each process that loads a model seconds (a serve replica, a
        batch actor, a draft worker, a CLI run), for the same answer every time on the same machine. A forced
        form (`RASD_LINEAR`) reads nothing; a corrupt file is ignored and rewritten by the next measurement.
        A form measured while the machine was busier than it is now (a training job or a second replica holding
        the cores) is dropped and measured again instead of steering verification for ever."""
        if forced_form() != "auto":
            return
        path = choices_file()
        if str(path) in self.loaded:
            return
        self.loaded.add(str(path))
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        now = machine_probe() if rows else 0.0
        for row in rows if isinstance(rows, list) else ():
            parsed = parse_row(row)
            if parsed is None or was_busy(parsed[2], now):
                continue
            k, form, probe = parsed
            self.choices.setdefault(k, form)
            self.saved.setdefault(k, form)
            self.probes.setdefault(k, probe)

    def save(self) -> None:
        """Add what this process measured to the machine's file (atomically; a lost race costs a re-measure)."""
        if forced_form() != "auto":
            return
        new = [k for k in self.choices if k not in self.saved and k not in self.forced]
        if not new:
            return
        self.saved.update({k: self.choices[k] for k in new})
        unstamped = [k for k in new if k not in self.probes]   # met mid-decoding, after the last `install`
        if unstamped:
            now = machine_probe()
            self.probes.update(dict.fromkeys(unstamped, now))
        self.loaded.discard(str(choices_file()))
        self.load()   # merge with what other processes wrote meanwhile
        rows = [[[k[0], k[1], k[2], str(k[3]).removeprefix("torch."), k[4], k[5], k[6]], v, self.probes.get(k, 0.0)]
                for k, v in self.saved.items()]
        try:
            write_json_atomic(choices_file(), rows)
        except OSError:
            pass   # a read-only home: the process keeps its own measurements

    def probe(self) -> float:
        """How fast the machine is right now (`probe.machine_probe`)."""
        return machine_probe()

    def stamp_new(self, known: set[Key], before: float | None) -> None:
        """Record the machine probe around a tuning on the keys it added (the busier end of the two)."""
        if before is None or len(self.choices) <= len(known):
            return
        busiest = max(before, machine_probe())   # load at either end may have slowed the timings between
        for k in self.choices.keys() - known:
            self.probes[k] = max(self.probes.get(k, 0.0), busiest)

    # ------------------------------------------------------------------ measuring layers in passes
    @torch.inference_mode()
    def sweep(self, modules: list[torch.nn.Linear], rows: int, approximate_of: Callable[[torch.nn.Module], bool]
              ) -> None:
        """Choose the form for `rows` rows of every weight shape in `modules` from passes over all of them in
        turn.

        Why not one weight at a time (`time_forms`): timed alone, a layer's weight stays in the cache between
        repetitions, where in decoding each weight is read once per step from memory, after the rest of the
        model. The one-weight timings chose forms that were slower in decoding; a pass over the model in its order
        is what decoding does.
        """
        todo = [m for m in modules if key(m.weight, rows, False, approximate_of(m)) not in self.choices]
        if not todo:
            return
        approximate = all(approximate_of(m) for m in todo)   # a draft head's own modules (`install`)
        inputs = {m.weight.shape[1]: torch.randn(rows, m.weight.shape[1], dtype=m.weight.dtype) for m in todo}
        unpacked_name = unpacked_form(rows)
        forms: dict[str, Any] = {STOCK: lambda m, x: F.linear(x, m.weight),
                                 unpacked_name: lambda m, x: unpacked(unpacked_name, m.weight, x, False)}
        for form in PACKED_FORMS:
            if all(can_pack(m.weight, form) for m in todo):
                forms[form] = lambda m, x, f=form: packed_product(f, x, COPIES.packed(m, f), m.weight, None)
                for m in todo:
                    COPIES.packed(m, form)
        if approximate:
            forms[HALF] = lambda m, x: half(m.weight, x)
        one_of = {(int(m.weight.shape[0]), int(m.weight.shape[1])): m.weight for m in todo}
        # a head's few MB would stay cached between passes, where decoding reads them after the target's weights
        before = self.evict if approximate else None
        chosen = {}
        for shape, times in pass_times(todo, inputs, forms, before_pass=before).items():
            fastest = min(times, key=times.__getitem__)
            chosen[shape] = fastest if times[fastest] < 0.9 * times[STOCK] else STOCK
        for shape, form in uniform_if_faster(todo, inputs, forms, chosen, before).items():
            self.choices[key(one_of[shape], rows, False, approximate)] = form


def uniform_if_faster(modules: list[torch.nn.Linear], inputs: dict[int, torch.Tensor], forms: dict[str, Any],
                      chosen: dict[tuple[int, int], str], before_pass: Any = None) -> dict[tuple[int, int], str]:
    """The per-shape forms, or one form for every shape where a whole pass of it beats the mix by 3%.

    Why: a form's speed depends on its neighbours; a product can be level with another when its neighbours take
    the same form and slower among a mix, so the whole pass decides."""
    if len(set(chosen.values())) <= 1:
        return chosen

    def mixed(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return forms[chosen[(int(module.weight.shape[0]), int(module.weight.shape[1]))]](module, x)

    times = pass_times(modules, inputs, {"mixed": mixed, **forms}, before_pass=before_pass)
    totals = {name: sum(per_shape[name] for per_shape in times.values()) for name in ["mixed", *forms]}
    uniform = min(forms, key=totals.__getitem__)
    return dict.fromkeys(chosen, uniform) if totals[uniform] < 0.97 * totals["mixed"] else chosen


def pass_times(modules: list[torch.nn.Linear], inputs: dict[int, torch.Tensor], forms: dict[str, Any],
               rounds: int = 3, clock: Any = time.perf_counter, before_pass: Any = None,
               ) -> dict[tuple[int, int], dict[str, float]]:
    """Per weight shape and form, the least (over `rounds` passes) summed time of that form's products over all
    `modules` of the shape, each pass running one form over every module in model order (`before_pass()` first,
    when given)."""
    best: dict[tuple[int, int], dict[str, float]] = {}
    order = list(forms)
    for r in range(rounds):
        for name in order[r % len(order):] + order[: r % len(order)]:   # rotate: no form always goes first
            if before_pass is not None:
                before_pass()
            sums: dict[tuple[int, int], float] = {}
            for module in modules:
                shape = (int(module.weight.shape[0]), int(module.weight.shape[1]))
                t0 = clock()
                forms[name](module, inputs[shape[1]])
                sums[shape] = sums.get(shape, 0.0) + clock() - t0
            for shape, total in sums.items():
                slot = best.setdefault(shape, {})
                slot[name] = min(slot.get(name, float("inf")), total)
    return best


@torch.inference_mode()
def time_forms(choices: KernelChoices, weight: torch.Tensor, rows: int, head: bool, cold: bool = False,
               approximate: bool = False, packable: bool = True) -> str:
    """Best of a few interleaved timings of each form; another form must beat `F.linear` by 10% to be used.
    `cold`: empty the cache before every product (`choices.evict`). `packable`: time the packed form (not for a
    bare weight). `approximate`: time the `HALF` form too."""
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
    unpacked_name = unpacked_form(rows)
    forms: dict[str, Any] = {STOCK: lambda: F.linear(x, weight),
                             unpacked_name: lambda: unpacked(unpacked_name, weight, x, head)}
    for form in PACKED_FORMS if packable else ():
        if can_pack(weight, form):
            packed = pack(weight, form)
            forms[form] = lambda f=form, p=packed: packed_product(f, x, p, weight, None)
    if approximate and weight.device.type == "cpu":
        forms[HALF] = lambda: half(weight, x)
    best = dict.fromkeys(forms, float("inf"))
    for _ in range(TUNE_ROUNDS):
        for name, run in forms.items():
            if cold:
                choices.evict()
            t0 = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - t0)
    fastest = min(best, key=best.__getitem__)
    return fastest if best[fastest] < 0.9 * best[STOCK] else STOCK


def parse_row(row: Any) -> tuple[Key, str, float] | None:
    """(key, form, probe) from one row of the machine's file; None for a row this version cannot trust."""
    try:
        (out, inp, rows_, dtype, threads, head, approximate), form, probe = row
        k = (out, inp, rows_, getattr(torch, dtype), threads, head, approximate)
    except (ValueError, TypeError, AttributeError):
        return None
    if form not in FORMS or not isinstance(k[3], torch.dtype) or not isinstance(probe, (int, float)):
        return None
    return k, form, float(probe)


@cache
def machine_id() -> str:
    """This CPU and torch build, as a short name: what the measured forms depend on (besides the threads,
    which are in each key)."""
    cpu = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            cpu = "".join(line for line in fh if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        cpu = platform.processor()
    libraries = f"{packing_available()}|{onednn_available()}"
    ident = f"{platform.machine()}|{cpu}|{os.cpu_count()}|{torch.__version__}|{libraries}"
    return f"{platform.machine()}-{hashlib.sha256(ident.encode()).hexdigest()[:12]}-v{CHOICES_VERSION}"


def choices_file() -> Path:
    """This machine's file of measured forms (read per call: $RASD_HOME may change, in tests)."""
    return kernel_choices_path(machine_id())


ACTIVE = KernelChoices()   # this process's choices; read as `choices.ACTIVE` at each use, so a test can swap it


def active() -> KernelChoices:
    """This process's kernel choices."""
    return ACTIVE


def linear_choices() -> dict[str, str]:
    """What was measured so far, readable: "out x in @ M" (" head", " approximate") -> form."""
    return ACTIVE.readable()
