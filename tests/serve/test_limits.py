"""Request size limits (pure logic): field checks name the field at fault, the body middleware refuses before
the app reads anything. The real service is checked in test_serve.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from rasd.errors import ApiError
from rasd.serve.limits import (
    BodyLimitMiddleware,
    Limits,
    check_chat,
    check_documents,
    check_prompt,
    check_question,
)
from rasd.serve.openai import ChatRequest, CompletionRequest, DocQARequest, DocumentsRequest

SMALL = Limits(max_body_bytes=100, max_ingest_bytes=1000, max_prompt_chars=50, max_messages=3, max_stop=2,
               max_stop_chars=5, max_documents=2, max_document_chars=40, max_field_chars=10)


def refused(check: Any, body: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        check(body, SMALL)
    assert info.value.status == 400
    return info.value


def test_within_limits_passes() -> None:
    check_prompt(CompletionRequest(prompt="x" * 50, stop=["a", "bcdef"], seed=2**63 - 1), SMALL)
    check_chat(ChatRequest(messages=[{"role": "user", "content": "x" * 25}] * 2), SMALL)
    check_question(DocQARequest(question="why?"), SMALL)
    check_documents(DocumentsRequest(documents=[{"text": "t" * 40, "title": "t" * 10}] * 2), SMALL)


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x" * 51}, "prompt"),
    ({"prompt": ["x" * 30, "y" * 30]}, "prompt"),
    ({"prompt": "x", "stop": ["a", "b", "c"]}, "stop"),
    ({"prompt": "x", "stop": ""}, "stop.0"),
    ({"prompt": "x", "stop": ["ok", "toolong"]}, "stop.1"),
    ({"prompt": "x", "seed": 2**63}, "seed"),
    ({"prompt": "x", "seed": -(2**63) - 1}, "seed"),
    ({"prompt": "x", "model": "m" * 11}, "model"),
    ({"prompt": "bad \ud800 surrogate"}, "prompt"),
    ({"prompt": "x", "stop": ["\udfff"]}, "stop.0"),
    ({"prompt": list(range(51))}, "prompt"),
    ({"prompt": [[1], [2]]}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": []}, "prompt"),
])
def test_completion_fields_are_refused_by_name(body: dict[str, Any], param: str) -> None:
    assert refused(check_prompt, CompletionRequest(**body)).param == param


def test_a_prompt_may_be_token_ids_in_either_openai_form() -> None:
    """OpenAI's and vLLM's `prompt` takes token ids, alone or as a list of one; the router gets a text of them
    that no text prompt is."""
    assert CompletionRequest(prompt=[5, 6]).prompt_ids() == [5, 6]
    assert CompletionRequest(prompt=[[5, 6]]).prompt_ids() == [5, 6]
    assert CompletionRequest(prompt="hi").prompt_ids() is None
    assert CompletionRequest(prompt=["hi"]).prompt_text() == "hi"
    assert CompletionRequest(prompt=[5, 6]).prompt_text() not in ("5 6", "[5, 6]")
    check_prompt(CompletionRequest(prompt=list(range(50))), SMALL)


def test_fields_without_effect_are_named_not_dropped_silently() -> None:
    req = ChatRequest(messages=[{"role": "user", "content": "x"}], user="u-1", tool_choice="none", temprature=0)
    req.refuse_unsupported()
    assert req.ignored_fields() == ["temprature", "tool_choice", "user"]
    assert CompletionRequest(prompt="x", temperature=0).ignored_fields() == []


def test_chat_messages_are_bounded_in_count_and_total_size() -> None:
    many = [{"role": "user", "content": "x"}] * 4
    assert refused(check_chat, ChatRequest(messages=many)).param == "messages"
    big = [{"role": "user", "content": "x" * 30}] * 2
    assert refused(check_chat, ChatRequest(messages=big)).param == "messages"
    lone = [{"role": "user", "content": "ok"}, {"role": "user", "content": "\ud83d"}]
    assert refused(check_chat, ChatRequest(messages=lone)).param == "messages.1.content"


def test_question_and_documents() -> None:
    assert refused(check_question, DocQARequest(question="q" * 51)).param == "question"
    three = DocumentsRequest(documents=[{"text": "a"}] * 3)
    assert refused(check_documents, three).param == "documents"
    long = DocumentsRequest(documents=[{"text": "a"}, {"text": "b" * 41}])
    assert refused(check_documents, long).param == "documents.1.text"
    titled = DocumentsRequest(documents=[{"text": "a", "title": "t" * 11}])
    assert refused(check_documents, titled).param == "documents.0.title"


def run_middleware(path: str, chunks: list[bytes], length: int | None, limits: Limits = SMALL
                   ) -> tuple[int, bytes]:
    """Send one POST through the middleware; the inner app echoes the size of the body it read."""
    sent: list[dict[str, Any]] = []
    pending = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(len(body)).encode()})

    async def receive() -> dict[str, Any]:
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(message)

    headers = [(b"content-length", str(length).encode())] if length is not None else []
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    asyncio.run(BodyLimitMiddleware(inner, lambda: limits)(scope, receive, send))
    return sent[0]["status"], sent[1]["body"]


def test_body_over_the_limit_is_413_before_the_app_reads_it() -> None:
    assert run_middleware("/v1/completions", [b"x" * 100], 100) == (200, b"100")
    status, body = run_middleware("/v1/completions", [b"x" * 101], 101)
    assert status == 413 and json.loads(body)["error"]["code"] == 413
    # chunked (no Content-Length): counted while buffered, the app sees the whole body when it fits
    assert run_middleware("/v1/completions", [b"x" * 60, b"y" * 40], None) == (200, b"100")
    assert run_middleware("/v1/completions", [b"x" * 60, b"y" * 41], None)[0] == 413
    # an ingest has its own, larger limit
    assert run_middleware("/v1/documents", [b"x" * 900], 900) == (200, b"900")
    assert run_middleware("/v1/documents", [b"x" * 1001], 1001)[0] == 413
    assert run_middleware("/v1/completions", [b"x"], None, Limits())[0] == 200


def test_config_limits_are_checked_before_ray_starts() -> None:
    pytest.importorskip("ray.serve")
    from rasd.serve.config import ServeConfig

    assert ServeConfig.from_dict({"limits": {"max_stop": 4}}).limits == {"max_stop": 4}
    for bad in ({"max_stop": 0}, {"max_stop": "4"}, {"max_stops": 4}, {"max_stop": True}, ["max_stop"]):
        with pytest.raises(ValueError, match="^limits"):
            ServeConfig.from_dict({"limits": bad})
