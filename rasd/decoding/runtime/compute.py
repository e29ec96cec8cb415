"""One compute thread per process: a service runs every torch operation on the same thread.

Why: PyTorch's CPU build parallelises with GNU OpenMP, and libgomp gives each thread that opens a parallel
region its own team of workers; the main thread's team lives as long as the process. Once libgomp manages
more threads than there are CPUs it stops spinning between regions and wakes its workers through the
kernel instead, and a decoding step opens hundreds of short regions, each then paying a wake-up (measured:
docs/lab-notes/decoding-speed.md, "compute thread"). A service used to load its model and embed queries on
one thread and decode on another, and paid that on every step.

So a service owns one `ComputeThread`: its decoding loop (the `Scheduler`, attached as its worker) runs
there, and everything else that touches torch (loading models, warm-up, query and document embedding,
building a request's decoder) is queued to it with `call`/`run`/`acall` and runs between decoding steps.

Long torch work that no request waits for (embedding an ingest) is queued with `run_background` in short
slices: a slice runs when no step is due, or once the decoding loop has had as much time since the last
slice as that slice took (`BACKGROUND_SHARE`), so running streams keep at least half the thread and never
wait for more than one slice.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

import torch

T = TypeVar("T")
log = logging.getLogger(__name__)

# Seconds of decoding owed per second of background work while requests are decoding: 1.0 splits the
# thread evenly between an ingest and the streams beside it (an idle thread gives background work all of it).
BACKGROUND_SHARE = 1.0


class Worker(Protocol):
    """Work the thread does whenever no queued call is waiting (the scheduler's decoding steps)."""

    def has_work(self) -> bool: ...         # called with `ComputeThread.cond` held
    def work_once(self) -> None: ...        # called without it
    def stopped(self) -> None: ...          # the thread is ending


class ComputeThread:
    """A daemon thread that runs queued calls and, in between, its worker's steps; torch threads set once."""

    def __init__(self, threads: int | None = None, name: str = "rasd-compute"):
        self.threads = threads
        self.cond = threading.Condition()
        self.torch_threads = 0              # what the thread runs with (for /healthz)
        self._jobs: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._background: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._owed_s = 0.0                  # decoding time owed to the worker for background work done
        self._worker: Worker | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ any thread
    def attach(self, worker: Worker) -> None:
        """Give the thread its worker (one per thread)."""
        with self.cond:
            if self._worker is not None and self._worker is not worker:
                raise RuntimeError("this compute thread already has a worker")
            self._worker = worker
            self.cond.notify()

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        """Queue `fn(*args, **kwargs)`; on the compute thread itself it runs at once (no deadlock)."""
        return self._enqueue(self._jobs, lambda: fn(*args, **kwargs))

    def _enqueue(self, queue: deque[tuple[Callable[[], Any], Future[Any]]], job: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        if threading.current_thread() is self._thread:
            _settle(future, job)
            return future
        with self.cond:
            if self._stopped:
                raise RuntimeError("the compute thread has stopped")
            queue.append((job, future))
            self.cond.notify()
        return future

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`call` and wait for the result (re-raising its exception) in a blocking thread."""
        return self.call(fn, *args, **kwargs).result()

    def run_background(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Like `run`, for a slice of work no request waits for: it yields to decoding steps (module doc)."""
        return self._enqueue(self._background, lambda: fn(*args, **kwargs)).result()

    async def acall(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`call` awaited from an event loop without blocking it."""
        return await asyncio.wrap_future(self.call(fn, *args, **kwargs))

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        """Stop after the current call or step; queued calls fail, the worker is told."""
        with self.cond:
            self._stopped = True
            self.cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)
        self.torch_threads = torch.get_num_threads()
        while True:
            with self.cond:
                while not self._stopped and not self._jobs and not self._background and not self._worker_busy():
                    self.cond.wait()
                if self._stopped:
                    break
                jobs = list(self._jobs)
                self._jobs.clear()
                worker = self._worker
                busy = self._worker_busy()
                if not busy:
                    self._owed_s = 0.0
                background = self._background.popleft() if self._background and self._owed_s <= 0 else None
            for job, future in jobs:
                if future.set_running_or_notify_cancel():
                    _settle(future, job)
            if background is not None:
                self._run_background(*background, busy)
            if worker is not None:
                self._step(worker, busy)
        self._shutdown()

    def _run_background(self, job: Callable[[], Any], future: Future[Any], busy: bool) -> None:
        """Run one background slice; while requests decode, the worker is owed as long as it took."""
        start = time.perf_counter()
        if future.set_running_or_notify_cancel():
            _settle(future, job)
        if busy:
            self._owed_s += (time.perf_counter() - start) * BACKGROUND_SHARE

    def _step(self, worker: Worker, busy: bool) -> None:
        start = time.perf_counter()
        try:
            worker.work_once()
        except Exception:   # the worker fails its own requests; the thread must outlive its bugs
            log.exception("the compute thread's worker raised; going on")
        if busy:
            self._owed_s = max(self._owed_s - (time.perf_counter() - start), 0.0)

    def _worker_busy(self) -> bool:
        return self._worker is not None and self._worker.has_work()

    def _shutdown(self) -> None:
        with self.cond:
            jobs = list(self._jobs) + list(self._background)
            self._jobs.clear()
            self._background.clear()
            worker = self._worker
        for _, future in jobs:
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError("the compute thread has stopped"))
        if worker is not None:
            worker.stopped()


def _settle(future: Future[Any], job: Callable[[], Any]) -> None:
    try:
        future.set_result(job())
    except BaseException as exc:   # the caller re-raises it; the thread goes on
        future.set_exception(exc)
