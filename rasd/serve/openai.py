"""OpenAI-compatible request/response shapes for the service, kept apart from the deployment.

Users bring clients written for OpenAI, vLLM or SGLang: field names, defaults (temperature 1.0, max_tokens
16 for completions), `usage`, `finish_reason` values, server-sent events ending in `data: [DONE]` and the
`{"error": {...}}` body all follow the OpenAI API. rasd's own additions are optional fields (`method`,
`top_k`) and a `rasd` object in responses with the speculative-decoding statistics.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rasd.errors import ApiError, error_body  # noqa: F401  (the schemas' errors; re-exported)

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="rasd/vLLM extension: 0 = off")
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = Field(default=1, ge=1)
    method: str | None = Field(default=None, description="rasd extension: a decoding method (GET /v1/info lists them)")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Request):
    prompt: str | list[str]

    def prompt_text(self) -> str:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise ApiError(400, "only one prompt per request is supported", param="prompt")
            return self.prompt[0]
        return self.prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)


class DocQARequest(_Request):
    question: str
    top_k_sources: int = Field(default=4, ge=1, le=32, description="retrieved chunks cited in the prompt")
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)   # answers from documents: greedy by default


class DocumentIn(BaseModel):
    text: str = Field(min_length=1)
    title: str = ""
    source: str = ""
    id: str | None = None


class DocumentsRequest(BaseModel):
    documents: list[DocumentIn] = Field(min_length=1)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens`: prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_body(rid: str, model: str, text: str, finish: str | None, chat: bool, **extra: Any) -> dict[str, Any]:
    """A whole (non-streamed) response."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], **extra}


def chunk_body(rid: str, model: str, text: str, finish: str | None, chat: bool, first: bool = False,
               **extra: Any) -> dict[str, Any]:
    """One streamed chunk; a chat stream's first chunk carries the role."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], **extra}


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
