"""Continuous batching in a background thread: requests join and leave a `BatchDecoder` between steps.

Callers (HTTP handlers, batch jobs) submit a `GenerationStream` and a sink; the loop thread prefills new
requests, steps the whole batch, and pushes every committed block to its request's sink as soon as the
step accepts it. Admission is bounded: beyond `max_batch` running plus `max_waiting` queued requests,
`submit` raises `Overloaded` at once (a service turns that into HTTP 429) instead of queueing without end.

No Ray here: the Serve deployment and the actors own a `Scheduler` and only move requests in and out.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rasd.decoding.batch import BatchDecoder
from rasd.decoding.engine import GenerationOutput, GenerationStream

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
    """Runs the batch step loop for all active requests in one daemon thread."""

    def __init__(self, model: torch.nn.Module, max_batch: int = 8, max_waiting: int = 16, fast: bool = True,
                 threads: int | None = None):
        self.batch = BatchDecoder(model, fast=fast)
        self.max_batch, self.max_waiting = max_batch, max_waiting
        self.threads = threads
        self._waiting: deque[Ticket] = deque()
        self._active: dict[int, Ticket] = {}        # id(stream) -> ticket
        self._cond = threading.Condition()
        self._stopped = False
        self._inflight = 0                          # submitted and not yet finished, failed or dropped
        self.loop_threads = 0                       # torch threads the loop runs with (for /healthz)
        self.steps = 0
        self._thread = threading.Thread(target=self._loop, name="rasd-scheduler", daemon=True)
        self._thread.start()

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
            self._waiting.append(ticket)
            self._inflight += 1
            self._cond.notify()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """The caller went away: the request leaves the batch before the next step."""
        ticket.cancelled = True

    def load(self) -> tuple[int, int]:
        """(running, waiting) requests: waiting = admitted but not yet in the batch."""
        with self._cond:
            return len(self._active), self._inflight - len(self._active)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the loop; requests still running or waiting get an error event."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ loop thread
    def _loop(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)
        self.loop_threads = torch.get_num_threads()
        while True:
            with self._cond:
                while not self._stopped and not self._waiting and not self._active:
                    self._cond.wait()
                if self._stopped:
                    break
                joining = self._admit()
            try:
                for ticket in joining:
                    self._join(ticket)
                self._drop_cancelled()
                if self._active:
                    self._step()
            except Exception as exc:   # a bug or OOM in a step fails the requests in it, not the service
                self._fail_all(f"{type(exc).__name__}: {exc}")
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
            self._release()
            ticket.sink("error", f"{type(exc).__name__}: {exc}")
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
        for stream, block in results:
            ticket = self._active.get(id(stream))
            if ticket is None:
                continue
            if block:
                ticket.sink("tokens", block)
            if stream.output is not None:
                self._finish(ticket, stream.output)

    def _finish(self, ticket: Ticket, output: GenerationOutput) -> None:
        with self._cond:
            self._active.pop(id(ticket.stream), None)
            self._inflight -= 1
        ticket.sink("done", output)

    def _fail_all(self, message: str) -> None:
        with self._cond:
            tickets = list(self._active.values()) + list(self._waiting)
            self._active.clear()
            self._waiting.clear()
            self._inflight -= len(tickets)
        for ticket in tickets:
            self.batch.remove(ticket.stream)
            ticket.sink("error", message)
