"""OpenAI-compatible request/response shapes for the service, kept apart from the deployment.

Users bring clients written for OpenAI, vLLM or SGLang: field names, defaults (temperature 1.0, max_tokens
16 for completions), `usage`, `finish_reason` values, server-sent events ending in `data: [DONE]` and the
`{"error": {...}}` body all follow the OpenAI API. rasd's own additions are optional fields (`method`,
`top_k`, vLLM's `repetition_penalty`) and a `rasd` object in responses with the speculative-decoding statistics.

Every OpenAI field is honoured or refused: one that would change the answer and that we do not support
(`tools`, `echo`, `best_of`, ...) is a 400 naming it, never silently dropped. Fields without effect here
(`user`, `store`, a vendor's own) are accepted, as vLLM does, and named in the response's
`X-Rasd-Ignored-Fields` header and the service's log (`ignored_fields`), so a typo is seen.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rasd.decoding.runtime.repetition import MAX_WINDOW, MIN_WINDOW
from rasd.errors import ApiError, error_body  # noqa: F401  (the schemas' errors; re-exported)

# the engine's reasons as the API names them; "repetition" (rasd's: the answer began to repeat itself, and the
# repeated part was dropped) only where the request asked for the rule (`stop_on_repetition`)
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "repetition": "repetition"}


def _off(value: Any) -> bool:
    return value is None or value is False or value == "" or value == [] or value == {}


# OpenAI fields that change the answer and that this service does not implement: refused when set (to a
# value other than their "off" value), by name. The `rasd` key says what to do instead.
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "tools": _off, "tool_choice": lambda v: _off(v) or v == "none", "functions": _off,
    "function_call": lambda v: _off(v) or v == "none", "audio": _off, "prediction": _off,
    "modalities": lambda v: _off(v) or v == ["text"], "web_search_options": _off, "reasoning_effort": _off,
    "echo": _off, "suffix": _off, "best_of": lambda v: _off(v) or v == 1,
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")   # kept to refuse the unsupported OpenAI fields by name

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0, description="vLLM extension: 1.0 = off")
    logit_bias: dict[str, float] | None = Field(default=None, description="token id (a string) -> -100..100")
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = Field(
        default=None, description='{"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}}')
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="rasd/vLLM extension: 0 = off")
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = Field(default=1, ge=1, description="choices: decoded as rows of the batch (seeds seed, seed+1, ...)")
    method: str | None = Field(default=None, description="rasd extension: a decoding method (GET /v1/info lists them)")
    stop_on_repetition: bool = Field(
        default=False, description="rasd extension: end the answer (finish_reason \"repetition\") once its newest "
                                   "`repetition_window` tokens repeat a span it already holds; that repeat is dropped")
    repetition_window: int | None = Field(
        default=None, ge=MIN_WINDOW, le=MAX_WINDOW,
        description="rasd extension: the window of `stop_on_repetition` in tokens (default: the service's)")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def refuse_unsupported(self) -> None:
        """400 for an OpenAI field this service would otherwise have to ignore."""
        for name, value in (self.model_extra or {}).items():
            is_off = UNSUPPORTED.get(name)
            if is_off is not None and not is_off(value):
                raise ApiError(400, f"{name} is not supported by this service", param=name)
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")

    def ignored_fields(self) -> list[str]:
        """The fields this request sent that have no effect here (asked after `refuse_unsupported`)."""
        return sorted(self.model_extra or {})

    def token_limit(self) -> int | None:
        """max_completion_tokens (OpenAI's newer name) or max_tokens; both, differing, is a 400."""
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise ApiError(400, "max_tokens and max_completion_tokens differ; send one", param="max_completion_tokens")
        return self.max_completion_tokens or self.max_tokens

    def logit_bias_pairs(self, vocab: int) -> tuple[tuple[int, float], ...]:
        """(token id, bias) pairs, each id a token of this model and each bias in -100..100 (OpenAI's range)."""
        pairs = []
        for key, value in (self.logit_bias or {}).items():
            if not key.strip().isdigit() or int(key) >= vocab:
                raise ApiError(400, f"logit_bias key {key[:40]!r} is not a token id of this model (0..{vocab - 1})",
                               param="logit_bias")
            if not -100.0 <= value <= 100.0:
                raise ApiError(400, f"logit_bias value {value} for token {key} is outside -100..100",
                               param="logit_bias")
            pairs.append((int(key), float(value)))
        return tuple(pairs)

    def grammar(self) -> str | None:
        """The grammar `response_format` asks for (None: free text); 400 naming the field when it is not one we
        can build."""
        fmt = self.response_format
        if fmt is None or fmt.get("type") in (None, "text"):
            return None
        from rasd.decoding.step.grammar import json_grammar

        kind = fmt.get("type")
        if kind == "json_object":
            schema = None
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise ApiError(400, "response_format.json_schema.schema must be a JSON schema object",
                               param="response_format.json_schema.schema")
        else:
            raise ApiError(400, f"response_format type {str(kind)[:40]!r} is not supported (text, json_object, "
                                "json_schema)", param="response_format.type")
        try:
            return json_grammar(schema)
        except ValueError as exc:
            raise ApiError(400, str(exc)[:500], param="response_format") from exc

    def logprobs_k(self) -> int | None:
        """How many alternatives each token's log-probability comes with; None: no log-probabilities."""
        return None

    def repetition(self, default_window: int) -> int:
        """The repetition stop's window for this request (0: off)."""
        if not self.stop_on_repetition:
            if self.repetition_window is not None:
                raise ApiError(400, "repetition_window needs stop_on_repetition: true", param="repetition_window")
            return 0
        return self.repetition_window or default_window

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="a text, or its token ids (OpenAI's and vLLM's forms; one prompt per request)")
    logprobs: int | None = Field(default=None, ge=0, le=20, description="alternatives per token (OpenAI: <= 5)")

    def logprobs_k(self) -> int | None:
        return self.logprobs

    def _one(self) -> str | list[int]:
        """The one prompt: a text or a list of token ids (a list of one of either is that one)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ApiError(400, "only one prompt per request is supported", param="prompt")
            return prompt[0]
        return prompt

    def prompt_ids(self) -> list[int] | None:
        """The prompt's token ids when it was sent as ids (None: a text, tokenized by the service)."""
        one = self._one()
        if isinstance(one, str):
            return None
        if not one:
            raise ApiError(400, "the prompt has no tokens", param="prompt")
        return one

    def prompt_text(self) -> str:
        """The prompt's text, or for token ids a text of them: what the router judges a prefix by."""
        one = self._one()
        return one if isinstance(one, str) else "\x1d" + " ".join(map(str, one))


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None

    def text(self, i: int) -> str:
        """The message's text: a string, or its text parts joined (what OpenAI clients send as parts)."""
        if isinstance(self.content, str):
            return self.content
        if self.content is None:
            raise ApiError(400, "a message without content needs tool calls, which are not supported",
                           param=f"messages.{i}.content")
        texts = []
        for j, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = str(part.get("type"))[:40]
                raise ApiError(400, f"content part of type {kind!r} is not supported (only text)",
                               param=f"messages.{i}.content.{j}")
            texts.append(part["text"])
        return "\n".join(texts)


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def logprobs_k(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def message_dicts(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]


class DocQARequest(_Request):
    question: str
    top_k_sources: int = Field(default=4, ge=1, le=32, description="retrieved chunks cited in the prompt")
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)   # answers from documents: greedy by default
    stop_on_repetition: bool = Field(
        default=True, description="end the answer (finish_reason \"repetition\") once its newest "
                                  "`repetition_window` tokens repeat a span it already holds; that repeat is dropped")


class DocumentIn(BaseModel):
    # rasd's own API: a field it does not store (`metadata`, `url`) is a 400 naming it, not dropped on the way in
    model_config = ConfigDict(extra="forbid")

    text: str = Field(min_length=1)
    title: str = ""
    source: str = ""
    id: str | None = None

    @field_validator("text")
    @classmethod
    def _has_text(cls, text: str) -> str:
        """A whitespace-only document would be skipped by the index writer: refused by name instead, so an
        acknowledged batch is every document sent."""
        if not text.strip():
            raise ValueError("the document's text is only whitespace")
        return text


class DocumentsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    documents: list[DocumentIn] = Field(min_length=1)
    async_: bool = Field(default=False, alias="async", description="answer 202 with an ingest job to poll, "
                                                                   "whatever the batch's size")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens`: prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def choice_body(index: int, text: str, finish: str | None, chat: bool, logprobs: dict[str, Any] | None = None
                ) -> dict[str, Any]:
    """One choice of a whole (non-streamed) response."""
    choice: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": logprobs}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return choice


def completion_body(rid: str, model: str, choices: list[dict[str, Any]], chat: bool, **extra: Any) -> dict[str, Any]:
    """A whole (non-streamed) response."""
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, **extra}


def chunk_body(rid: str, model: str, text: str, finish: str | None, chat: bool, first: bool = False,
               logprobs: dict[str, Any] | None = None, index: int = 0, **extra: Any) -> dict[str, Any]:
    """One streamed chunk of choice `index`; a chat stream's first chunk of each choice carries the role."""
    choice: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": logprobs}
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], **extra}


def usage_chunk(rid: str, model: str, chat: bool, usage_body: dict[str, Any]) -> dict[str, Any]:
    """`stream_options.include_usage`: the last chunk before [DONE], with no choices and the usage."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [], "usage": usage_body}


def logprobs_body(entries: Sequence[Any], piece: Callable[[int], str], chat: bool, offset: int = 0
                  ) -> dict[str, Any] | None:
    """OpenAI's `logprobs` object of some tokens (`TokenLogprob`s): chat's `content` list, or the legacy
    completions shape (tokens, token_logprobs, top_logprobs, text_offset from `offset`)."""
    if chat:
        def one(tok: int, lp: float) -> dict[str, Any]:
            text = piece(tok)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8", "replace"))}

        return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                            for e in entries]}
    tokens = [piece(e.token) for e in entries]
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{piece(t): lp for t, lp in e.top} for e in entries], "text_offset": offsets}


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
