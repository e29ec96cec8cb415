"""Request size limits, checked before a request costs real work (tokenizing, searching, embedding).

Why here and not in the schemas: the limits are the operator's (`ServeConfig`, `serve_config.yaml`), while
the pydantic schemas are module-level. Bodies are bounded by an ASGI middleware before they are parsed; the
fields of a parsed body by `check_request` before anything is tokenized. Every refusal names its field.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

from rasd.errors import ApiError

SEED_RANGE = (-(2**63), 2**63 - 1)   # what a torch generator takes
INGEST_PATH = "/v1/documents"


@dataclass(frozen=True)
class Limits:
    """The operator's bounds on one request (defaults: generous for document QA, small for a CPU)."""

    max_body_bytes: int = 2 * 1024 * 1024           # any JSON body but an ingest
    max_ingest_bytes: int = 64 * 1024 * 1024         # POST /v1/documents
    max_prompt_chars: int = 200_000                  # a prompt, all chat messages together, a question
    max_messages: int = 512
    max_stop: int = 16                               # stop strings per request
    max_stop_chars: int = 256                        # characters per stop string
    max_documents: int = 10_000                      # documents per ingest
    max_document_chars: int = 16_000_000             # characters per document
    max_field_chars: int = 4_096                     # a document's title, source or id; a model or method name
    max_logit_bias: int = 1_024                      # entries of logit_bias
    max_n: int = 8                                   # choices per request (`n`)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(cls.__dataclass_fields__)


def _text(value: str, field: str, limit: int) -> int:
    """The length of a text field after checking it is bounded and valid Unicode (a lone surrogate that JSON
    let through cannot be tokenized)."""
    if len(value) > limit:
        raise ApiError(400, f"{field} has {len(value)} characters; the limit is {limit}", param=field)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"{field} is not valid Unicode (a lone surrogate at {exc.start})", param=field) from exc
    return len(value)


def _texts(values: Iterable[tuple[str, str]], limit: int, total_field: str) -> None:
    """Each (field, text) valid, and all of them together within `limit` characters."""
    total = 0
    for field, value in values:
        total += _text(value, field, limit)
        if total > limit:
            raise ApiError(400, f"{total_field} have more than {limit} characters together", param=total_field)


def check_common(req: Any, limits: Limits) -> None:
    """Fields every generation request has: stop strings, seed, model and method names."""
    stops = req.stop_list()
    if len(stops) > limits.max_stop:
        raise ApiError(400, f"{len(stops)} stop strings; the limit is {limits.max_stop}", param="stop")
    for i, stop in enumerate(stops):
        if not stop:
            raise ApiError(400, "a stop string is empty", param=f"stop.{i}")
        _text(stop, f"stop.{i}", limits.max_stop_chars)
    if req.n > limits.max_n:
        raise ApiError(400, f"n is {req.n}; the limit is {limits.max_n}", param="n")
    if len(getattr(req, "logit_bias", None) or ()) > limits.max_logit_bias:
        raise ApiError(400, f"logit_bias has {len(req.logit_bias)} entries; the limit is {limits.max_logit_bias}",
                       param="logit_bias")
    req.refuse_unsupported()
    if req.seed is not None and not SEED_RANGE[0] <= req.seed <= SEED_RANGE[1]:
        raise ApiError(400, f"seed must be a 64-bit integer ({SEED_RANGE[0]}..{SEED_RANGE[1]})", param="seed")
    for name in ("model", "method"):
        value = getattr(req, name, None)
        if value is not None:
            _text(value, name, limits.max_field_chars)


def check_prompt(req: Any, limits: Limits) -> None:
    check_common(req, limits)
    ids = req.prompt_ids()
    if ids is not None:   # token ids: no more of them than a text's characters (each token is one or more)
        if len(ids) > limits.max_prompt_chars:
            raise ApiError(400, f"prompt has {len(ids)} tokens; the limit is {limits.max_prompt_chars}", param="prompt")
        return
    prompts = req.prompt if isinstance(req.prompt, list) else [req.prompt]
    _texts(((f"prompt.{i}" if isinstance(req.prompt, list) else "prompt", p) for i, p in enumerate(prompts)),
           limits.max_prompt_chars, "prompt")


def check_chat(req: Any, limits: Limits) -> None:
    check_common(req, limits)
    if len(req.messages) > limits.max_messages:
        raise ApiError(400, f"{len(req.messages)} messages; the limit is {limits.max_messages}", param="messages")
    _texts(((f"messages.{i}.content", m.text(i)) for i, m in enumerate(req.messages)), limits.max_prompt_chars,
           "messages")


def check_question(req: Any, limits: Limits) -> None:
    check_common(req, limits)
    _text(req.question, "question", limits.max_prompt_chars)


def check_documents(req: Any, limits: Limits) -> None:
    docs = req.documents
    if len(docs) > limits.max_documents:
        raise ApiError(400, f"{len(docs)} documents; the limit per request is {limits.max_documents}",
                       param="documents")
    for i, doc in enumerate(docs):
        _text(doc.text, f"documents.{i}.text", limits.max_document_chars)
        for name in ("title", "source", "id"):
            value = getattr(doc, name)
            if value is not None:
                _text(value, f"documents.{i}.{name}", limits.max_field_chars)


# ---------------------------------------------------------------------------------------------- body size

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


async def _refuse(send: Send, limit: int) -> None:
    body = json.dumps({"error": {"message": f"the request body is larger than this service's limit of {limit} "
                                            "bytes", "type": "invalid_request_error", "param": None,
                                 "code": 413}}).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    """413 for a body over the limit, before the app reads or parses any of it: from Content-Length when the
    client sends one, else by counting while the body is buffered (at most the limit is ever held)."""

    def __init__(self, app: Callable[..., Awaitable[None]], limits_source: Callable[[], Limits]):
        self.app = app
        self.limits_source = limits_source

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        limits = self.limits_source()
        limit = limits.max_ingest_bytes if scope.get("path") == INGEST_PATH else limits.max_body_bytes
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None:
            if not declared.isdigit() or int(declared) > limit:
                await _refuse(send, limit)
                return
            await self.app(scope, receive, send)   # the server delivers no more than it declared
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message]), send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _refuse(send, limit)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        await self.app(scope, _replay([{"type": "http.request", "body": b"".join(chunks), "more_body": False}],
                                      receive), send)


def _replay(messages: list[Message], then: Receive | None = None) -> Receive:
    """A `receive` that hands out `messages` first, then defers to `then` (disconnect notices)."""
    queue = list(messages)

    async def receive() -> Message:
        if queue:
            return queue.pop(0)
        if then is None:
            return {"type": "http.disconnect"}
        return await then()

    return receive
