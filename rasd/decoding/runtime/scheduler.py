"""Continuous batching on the compute thread: requests join and leave a `BatchDecoder` between steps.

Callers (HTTP handlers, batch jobs) submit a `GenerationStream` and a sink; the process's `ComputeThread`
(see `compute`: all torch work of a service stays on one thread) prefills new requests, steps the whole
batch, and pushes every committed block to its request's sink as soon as the step accepts it. Admission
is bounded: beyond `max_batch` running plus `max_waiting` queued requests, `submit` raises `Overloaded`
at once (a service turns that into HTTP 429) instead of queueing without end.

No Ray here: the Serve deployment and the actors own a `Scheduler` and only move requests in and out.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rasd.decoding.model.static_step import StepConfig
from rasd.decoding.runtime.compute import ComputeThread
from rasd.decoding.runtime.engine import GenerationOutput, GenerationStream
from rasd.decoding.runtime.prefix_cache import PrefixCache
from rasd.decoding.step.batch_decoder import BatchDecoder

log = logging.getLogger(__name__)
STALL_S = 30.0   # busy with no finished step for this long: unhealthy

# A sink receives ("tokens", list[int]), then exactly one of ("done", GenerationOutput) or ("error", str).
Sink = Callable[[str, Any], None]


class Overloaded(RuntimeError):
    """The scheduler is full: the caller should retry later (HTTP 429)."""


@dataclass
class Ticket:
    """A submitted request: its stream, where its events go, and whether its caller gave up."""

    stream: GenerationStream
    sink: Sink
    cancelled: bool = False
    submitted_s: float = field(default_factory=time.perf_counter)


class Scheduler:
    """Runs the batch step loop for all active requests as the worker of a `ComputeThread`."""

    def __init__(self, model: torch.nn.Module, max_batch: int = 8, max_waiting: int = 16, fast: bool = True,
                 threads: int | None = None, compute: ComputeThread | None = None, prefill_chunk: int = 0,
                 prefix_cache: PrefixCache | None = None, step: StepConfig | None = None):
        """`compute`: the process's compute thread (a service's); without one the scheduler starts its own.
        `prefill_chunk`, `prefix_cache`, `step`: see `BatchDecoder` (by default a joining request is prefilled
        at once, no prefix is reused, and CUDA verifies in captured static shapes)."""
        self.batch = BatchDecoder(model, fast=fast, slots=max_batch, chunk_tokens=prefill_chunk,
                                  prefix_cache=prefix_cache, step=step)
        self.max_batch, self.max_waiting = max_batch, max_waiting
        self._owns_compute = compute is None
        self.compute = compute or ComputeThread(threads, name="rasd-scheduler")
        self._cond = self.compute.cond              # one lock for the thread's jobs and this queue
        self._waiting: deque[Ticket] = deque()
        self._active: dict[int, Ticket] = {}        # id(stream) -> ticket
        self._stopped = False
        self._inflight = 0                          # submitted and not yet finished, failed or dropped
        self.steps = 0
        self.last_progress = time.monotonic()       # when a unit of work last finished (or work arrived)
        self.compute.attach(self)

    @property
    def loop_threads(self) -> int:
        """Torch threads the loop runs with (for /healthz)."""
        return self.compute.torch_threads

    # ------------------------------------------------------------------ caller side (any thread)
    def submit(self, stream: GenerationStream, sink: Sink) -> Ticket:
        """Queue a request; raises `Overloaded` when `max_waiting` requests already wait."""
        with self._cond:
            if self._stopped:
                raise Overloaded("the scheduler is shutting down")
            if self._inflight >= self.max_batch + self.max_waiting:
                raise Overloaded(f"{self._inflight} requests admitted (batch {self.max_batch} + queue "
                                 f"{self.max_waiting}); retry later")
            ticket = Ticket(stream, sink)
            if not self._waiting and not self._active:   # idle until now: the clock starts with this request
                self.last_progress = time.monotonic()
            self._waiting.append(ticket)
            self._inflight += 1
            self._cond.notify()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """The caller went away: the request leaves the batch before the next step."""
        ticket.cancelled = True

    def beat(self) -> None:
        """The loop is busy with a long but live piece of work (a first cost-curve measurement): not stuck."""
        self.last_progress = time.monotonic()

    def stalled(self, limit_s: float = STALL_S) -> bool:
        """Requests wait or run and nothing has finished for `limit_s`: the loop is stuck (a hung step, a
        call queued on the compute thread that never returns). `/healthz` turns this into a 503."""
        with self._cond:
            busy = bool(self._waiting or self._active)
        return busy and time.monotonic() - self.last_progress > limit_s

    def load(self) -> tuple[int, int]:
        """(running, waiting) requests: waiting = admitted but not yet in the batch."""
        with self._cond:
            return len(self._active), self._inflight - len(self._active)

    def close(self, timeout: float = 5.0) -> None:
        """Stop taking requests; those still running or waiting get an error event."""
        with self._cond:
            self._stopped = True
        if self._owns_compute:
            self.compute.close(timeout)    # its end calls `stopped`
        else:
            try:
                self.compute.run(self.stopped)
            except RuntimeError:            # the thread had already stopped (and told us)
                pass

    # ------------------------------------------------------------------ the compute thread (Worker)
    def has_work(self) -> bool:
        """Called with the lock held."""
        return not self._stopped and bool(self._waiting or self._active)

    def work_once(self) -> None:
        """Admit and prefill newcomers, drop cancelled requests, step the batch once."""
        with self._cond:
            joining = self._admit()
        try:
            for ticket in joining:
                self._join(ticket)
            self._drop_cancelled()
            if self._active:
                self._step()
            self.last_progress = time.monotonic()
        except Exception as exc:   # a bug or OOM in the shared forward fails the requests in it, not the service
            log.exception("a decoding step failed; its requests end with an error")
            self._fail_all(f"{type(exc).__name__}: {exc}", waiting=False)

    def stopped(self) -> None:
        self._fail_all("the scheduler stopped")

    def _admit(self) -> list[Ticket]:
        """Tickets that may join now (called with the lock held)."""
        joining = []
        while self._waiting and len(self._active) + len(joining) < self.max_batch:
            joining.append(self._waiting.popleft())
        return joining

    def _join(self, ticket: Ticket) -> None:
        if ticket.cancelled:
            self._release()
            return
        try:
            first = self.batch.add(ticket.stream)
        except Exception as exc:
            log.exception("a request failed to join the batch")
            self._release()
            ticket.sink("error", f"{type(exc).__name__}: {exc}")
            return
        if first is None:                               # prefilled chunk by chunk; a step gives its first token
            with self._cond:
                self._active[id(ticket.stream)] = ticket
            return
        ticket.sink("tokens", first)
        if ticket.stream.output is not None:           # finished at its first token
            self._release()
            ticket.sink("done", ticket.stream.output)
            return
        with self._cond:
            self._active[id(ticket.stream)] = ticket

    def _release(self, count: int = 1) -> None:
        with self._cond:
            self._inflight -= count

    def _drop_cancelled(self) -> None:
        for key, ticket in list(self._active.items()):
            if ticket.cancelled:
                self.batch.remove(ticket.stream)
                with self._cond:
                    del self._active[key]
                    self._inflight -= 1

    def _step(self) -> None:
        results = self.batch.step()
        self.steps += 1
        for stream, exc in self.batch.take_failed():   # that request's own part of the step raised
            with self._cond:
                ticket = self._active.pop(id(stream), None)
                if ticket is not None:
                    self._inflight -= 1
            if ticket is not None:
                ticket.sink("error", f"{type(exc).__name__}: {exc}")
        for stream, block in results:
            ticket = self._active.get(id(stream))
            if ticket is None:
                continue
            ticket.sink("tokens", block)   # one per step, empty when what it committed is held back
            if stream.output is not None:
                self._finish(ticket, stream.output)

    def _finish(self, ticket: Ticket, output: GenerationOutput) -> None:
        with self._cond:
            self._active.pop(id(ticket.stream), None)
            self._inflight -= 1
        ticket.sink("done", output)

    def _fail_all(self, message: str, waiting: bool = True) -> None:
        """End the running requests (and the queued ones with `waiting`: the scheduler stops) with `message`.
        A failed step leaves the queued ones queued: they never touched the failed batch."""
        with self._cond:
            tickets = list(self._active.values()) + (list(self._waiting) if waiting else [])
            self._active.clear()
            if waiting:
                self._waiting.clear()
            self._inflight -= len(tickets)
        try:
            self.batch.clear()
        finally:   # whatever happens to the batch, every caller hears why its request ended
            for ticket in tickets:
                ticket.sink("error", message)
