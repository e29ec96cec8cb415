"""What a client receives when a stream ends abnormally: an error event and no [DONE], which rasd's client
turns into an exception; never truncated text that looks complete (issue 67, "Silent truncation")."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from rasd.client import ApiError, IncompleteStream, _events  # noqa: E402
from rasd.errors import ApiError as ServerError  # noqa: E402
from rasd.serve.replica import _merged  # noqa: E402


async def _choice(blocks: int, fail_after: int | None = None) -> AsyncIterator[tuple[str, Any]]:
    for i in range(blocks):
        if i == fail_after:
            raise RuntimeError("injected failure after the first block")
        yield "tokens", [i]
        await asyncio.sleep(0)
    yield "done", None


async def _merge(streams: list[AsyncIterator[tuple[str, Any]]]) -> list[tuple[int, str, Any]]:
    return [event async for event in _merged(streams)]


def test_a_failure_inside_a_choice_ends_the_merge_with_an_error() -> None:
    events = asyncio.run(_merge([_choice(5), _choice(5, fail_after=1)]))
    kinds = [kind for _, kind, _ in events]
    assert kinds[-1] == "error" and "done" not in [k for i, k, _ in events if i == 1]
    error = events[-1][2]
    assert isinstance(error, ServerError) and error.status == 500 and "injected failure" in error.message


def test_the_merge_of_healthy_choices_ends_with_every_done() -> None:
    events = asyncio.run(_merge([_choice(3), _choice(2)]))
    assert sorted(i for i, kind, _ in events if kind == "done") == [0, 1]


def test_the_client_raises_on_a_stream_without_done_or_with_an_error() -> None:
    whole = ['data: {"delta": "a"}', "", "data: [DONE]"]
    assert list(_events(iter(whole))) == [{"delta": "a"}]
    with pytest.raises(IncompleteStream):
        list(_events(iter(['data: {"delta": "a"}', ""])))   # the connection closed mid-answer
    with pytest.raises(ApiError) as info:
        list(_events(iter(['data: {"delta": "a"}', 'data: {"error": {"code": 500, "message": "boom"}}'])))
    assert info.value.status == 500 and not isinstance(info.value, IncompleteStream)
