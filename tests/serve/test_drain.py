"""The ingress's side of a stop, without Ray: once draining, a new request gets 503 with Retry-After before any
other work; a request in flight runs on and is counted until its answer is sent; one still running when the
grace period ends gets an error (a stream: an error event and no [DONE]); the signals' two steps."""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any

import pytest

from rasd.serve.drain import Drain, DrainMiddleware
from rasd.serve.lifecycle import StopRequested, StopSignals


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


async def lines(n: int, delay: float) -> Any:
    for i in range(n):
        await asyncio.sleep(delay)
        yield f"data: {i}\n\n"
    yield "data: [DONE]\n\n"


async def request(app: Any, path: str = "/v1/completions") -> tuple[int, dict[bytes, bytes], bytes]:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    await app({"type": "http", "path": path, "method": "POST", "headers": []}, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], dict(start["headers"]), b"".join(m.get("body", b"") for m in sent[1:])


def test_a_new_request_while_draining_gets_503_with_retry_after_and_running_ones_finish() -> None:
    drain = Drain()
    served: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:     # a request that takes 0.3 s to answer
        await asyncio.sleep(0.3)
        served.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    wrapped = DrainMiddleware(app, drain_source=lambda: drain)

    async def scenario() -> Any:
        running = asyncio.ensure_future(request(wrapped, "/first"))
        await asyncio.sleep(0.05)
        assert drain.active == 1
        stopping = asyncio.ensure_future(drain.run(grace_s=10))
        await asyncio.sleep(0.05)
        refused = await request(wrapped, "/second")
        return await running, refused, await stopping

    (status, _, body), (refused_status, headers, refused_body), outcome = run(scenario())
    assert status == 200 and body == b"ok" and served == ["/first"], "the running request finished"
    assert refused_status == 503 and int(headers[b"retry-after"]) >= 1 and headers[b"connection"] == b"close"
    error = json.loads(refused_body)["error"]
    assert error["type"] == "service_unavailable" and "shutting down" in error["message"]
    assert outcome == {"in_flight": 1, "finished": 1, "cut": 0} and drain.active == 0


def test_a_stream_still_running_after_the_grace_period_ends_with_an_error_event_not_done() -> None:
    drain = Drain()

    async def scenario() -> tuple[list[str], list[str], dict[str, int]]:
        quick, slow = [], []

        async def consume(out: list[str], source: Any) -> None:
            drain.active += 1                     # as the middleware counts it
            try:
                async for line in drain.relay(source):
                    out.append(line)
            finally:
                drain.active -= 1

        tasks = [asyncio.ensure_future(consume(quick, lines(3, 0.05))),
                 asyncio.ensure_future(consume(slow, lines(1000, 0.05)))]
        await asyncio.sleep(0.02)
        outcome = await drain.run(grace_s=0.5)
        await asyncio.gather(*tasks)
        return quick, slow, outcome

    quick, slow, outcome = run(scenario())
    assert quick[-1] == "data: [DONE]\n\n", "a stream that ends within the grace period ends normally"
    assert "[DONE]" not in "".join(slow) and 3 < len(slow) < 100
    last = json.loads(slow[-1][len("data: "):])
    assert last["error"]["code"] == 503 and "shutting down" in last["error"]["message"]
    assert outcome == {"in_flight": 2, "finished": 1, "cut": 1}


def test_a_call_still_waiting_after_the_grace_period_is_a_503() -> None:
    from rasd.errors import ApiError

    drain = Drain()

    async def scenario() -> None:
        assert await drain.call(asyncio.sleep(0.01, result="answer")) == "answer"
        drain.cut = True
        with pytest.raises(ApiError) as caught:
            await drain.call(asyncio.sleep(30))
        assert caught.value.status == 503

    run(scenario())


def test_the_first_signal_stops_in_order_a_second_forces() -> None:
    """Starting: the first signal interrupts the start (nothing to drain); serving: it only asks for the drain;
    any signal after the first forces the exit."""
    forced: list[int] = []
    starting = StopSignals(force=forced.append)
    with pytest.raises(StopRequested):
        starting._handle(signal.SIGTERM, None)
    starting._handle(signal.SIGINT, None)
    assert forced == [signal.SIGINT]

    serving = StopSignals(force=forced.append)
    serving.serving = True
    serving._handle(signal.SIGTERM, None)
    assert serving.requested.is_set() and serving.name() == "SIGTERM" and forced == [signal.SIGINT]
