"""The ingress's side of a shutdown: refuse new requests, let the running ones finish, cut the rest cleanly.

`rasd serve` (on SIGTERM/SIGINT) and `rasd serve --stop` call the ingress's `drain(grace_s)` before they shut
Serve down. From then on every new request gets 503 with `Retry-After` (a load balancer or client retries
elsewhere or later), the requests in flight run on, and those still running when the grace period ends get
a clear error instead of a connection that just breaks: a stream an error event (no [DONE]), any other
request a 503. Why in the ingress: it sees every HTTP request, and it is the only place that can still write
an answer; once Serve is shut down the client sees nothing but a reset.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from rasd.errors import ApiError, error_body

ABORT_WAIT_S = 5.0        # after the grace period, how long the cut requests get to send their error
POLL_S = 0.05
SHUTTING_DOWN = "the service is shutting down"


def shutdown_error(retry_after: int) -> ApiError:
    return ApiError(503, f"{SHUTTING_DOWN}; retry in {retry_after} s (on another instance, or this one once "
                         "restarted)", "service_unavailable")


class Drain:
    """Counts the HTTP requests in flight; once `draining`, new ones are refused, and once `cut`, the rest end.

    Plain flags, polled: Serve may run the `drain` handle call on another thread and event loop than the HTTP
    requests, and an asyncio.Event set from there would not wake them."""

    def __init__(self) -> None:
        self.active = 0
        self.draining = False
        self.cut = False
        self.deadline = 0.0

    def retry_after(self) -> int:
        """Seconds until this instance has stopped: the rest of the grace period, at least 1."""
        return max(1, math.ceil(self.deadline - time.monotonic()))

    async def run(self, grace_s: float) -> dict[str, int]:
        """Refuse new requests, wait up to `grace_s` for the running ones, then cut the rest; what happened."""
        running = self.active
        self.deadline = time.monotonic() + grace_s + ABORT_WAIT_S
        self.draining = True
        await self._until_idle(grace_s)
        cut = self.active
        if cut:
            self.cut = True
            await self._until_idle(ABORT_WAIT_S)
        return {"in_flight": running, "finished": max(0, running - cut), "cut": cut}

    async def _until_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)

    async def _until_cut(self, task: asyncio.Future) -> bool:
        """Wait for `task`; False (the task cancelled) when the grace period ends first."""
        while not task.done():
            if self.cut:
                task.cancel()
                return False
            await asyncio.wait({task}, timeout=POLL_S)
        return True

    async def call(self, awaitable: Awaitable[Any]) -> Any:
        """`awaitable`'s result, or the shutdown 503 when the grace period ends first."""
        task = asyncio.ensure_future(awaitable)
        if not await self._until_cut(task):
            raise shutdown_error(self.retry_after())
        return task.result()

    async def relay(self, lines: AsyncIterator[str]) -> AsyncIterator[str]:
        """A stream's event lines until it ends, or until the grace period ends: then one error event and no
        [DONE], so a client knows the answer is incomplete (the caller cancels the replica's generator)."""
        source = lines.__aiter__()
        while True:
            step = asyncio.ensure_future(source.__anext__())
            if not await self._until_cut(step):
                yield f"data: {json.dumps(shutdown_error(self.retry_after()).body())}\n\n"
                return
            try:
                yield step.result()
            except StopAsyncIteration:
                return


class DrainMiddleware:
    """ASGI middleware, outermost: counts every HTTP request until its answer is sent (a stream included) and,
    while draining, answers new ones 503 with `Retry-After` and `Connection: close` before any other work."""

    def __init__(self, app: Any, drain_source: Any):
        self.app, self.drain_source = app, drain_source

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        drain: Drain = self.drain_source()
        if drain.draining:
            await refuse(send, drain.retry_after())
            return
        drain.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            drain.active -= 1


async def refuse(send: Any, retry_after: int) -> None:
    body = json.dumps(error_body(shutdown_error(retry_after).message, "service_unavailable", None, 503)).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"retry-after", str(retry_after).encode()), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
