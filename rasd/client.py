"""Python client for the rasd HTTP service: completions, chat, document QA, ingest; sync and async.

    from rasd.client import Client
    c = Client("http://127.0.0.1:8000")
    answer = c.ask("How does the else clause of a for loop work?")
    print(answer.answer, answer.sources, answer.stats["mean_accepted_tokens"])
    for text in c.complete_stream("def fib(n):", max_tokens=64):
        print(text, end="")

Retries: 503 (and connection errors) are retried with exponential backoff; 429 too when `retry_busy` is on.
Any other error raises `ApiError` with the service's message.
`python -m rasd.client ask "question"` asks from the command line (used by `make run`).
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

RETRY_STATUSES = {503}
JOB_TIMEOUT_S = 6 * 3600.0     # a 10 MB ingest took 43 minutes on a 2-core CPU beside a stream
BAR_AFTER_S = 3.0              # a job's progress bar appears once it has run this long
POLL_MAX_S = 5.0


class ApiError(RuntimeError):
    """An error response from the service (status + OpenAI-style message)."""

    def __init__(self, status: int, message: str, type_: str = ""):
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message, self.type = status, message, type_


@dataclass
class Completion:
    text: str
    finish_reason: str
    usage: dict[str, Any]           # OpenAI usage, with prompt_tokens_details.cached_tokens
    stats: dict[str, Any]
    raw: dict[str, Any] = field(repr=False, default_factory=dict)


@dataclass
class DocAnswer:
    answer: str
    sources: list[dict[str, Any]]
    finish_reason: str
    usage: dict[str, Any]           # OpenAI usage, with prompt_tokens_details.cached_tokens
    stats: dict[str, Any]


IGNORED_HEADER = "x-rasd-ignored-fields"   # the service's list of fields without effect (`serve.ingress`)


class IgnoredFieldsWarning(UserWarning):
    """The service accepted fields that have no effect there (a misspelt `temprature=0`, a vendor's own)."""


def _raise_for(response: httpx.Response) -> None:
    """An `ApiError` for a refusal; a warning naming the fields the service ignored (`**params` are sent as
    they are, so a misspelt keyword would otherwise pass unseen)."""
    ignored = response.headers.get(IGNORED_HEADER)
    if ignored:
        warnings.warn(f"the service ignored these fields: {ignored}", IgnoredFieldsWarning, stacklevel=3)
    if response.status_code < 400:
        return
    try:
        err = response.json().get("error", {})
        message, type_ = err.get("message", response.text), err.get("type", "")
    except (ValueError, AttributeError):
        message, type_ = response.text, ""
    raise ApiError(response.status_code, message, type_)


def _completion(body: dict[str, Any]) -> Completion:
    choice = body["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return Completion(text=text, finish_reason=choice["finish_reason"], usage=body.get("usage", {}),
                      stats=body.get("rasd", {}), raw=body)


def _answer(body: dict[str, Any]) -> DocAnswer:
    return DocAnswer(answer=body["answer"], sources=body.get("sources", []), finish_reason=body["finish_reason"],
                     usage=body.get("usage", {}), stats=body.get("rasd", {}))


class IncompleteStream(ApiError):
    """A stream that ended without `data: [DONE]`: the server or the connection failed mid-answer, so what was
    received may be truncated (never taken for a whole answer)."""


def _events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """The events of a server-sent stream; an error event raises `ApiError`, an end without [DONE]
    `IncompleteStream`."""
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            err = event["error"]
            raise ApiError(int(err.get("code") or 500), err.get("message", ""), err.get("type", ""))
        yield event
    raise IncompleteStream(502, "the stream ended without [DONE]: the answer may be truncated", "server_error")


def _delta(event: dict[str, Any]) -> str:
    choice = event["choices"][0]
    return choice.get("delta", {}).get("content", "") if "delta" in choice else choice.get("text", "")


class Client:
    """Synchronous client. Timeouts in seconds; `retries` attempts on 503 / connection errors."""

    def __init__(self, url: str = "http://127.0.0.1:8000", api_key: str | None = None, timeout: float = 300.0,
                 retries: int = 3, backoff_s: float = 0.5, retry_busy: bool = False,
                 transport: httpx.BaseTransport | None = None):
        """`transport`: httpx's (a proxy, a test's fault injection); default: a direct connection."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout, transport=transport)
        self.retries, self.backoff_s = retries, backoff_s
        self.retry_statuses = RETRY_STATUSES | ({429} if retry_busy else set())

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _post(self, path: str, payload: dict[str, Any], headers: dict[str, str] | None = None) -> dict[str, Any]:
        return self._send("POST", path, json=payload, headers=headers)

    def _get(self, path: str) -> dict[str, Any]:
        """GET with the same retries as `_post` (a status poll must outlive a replica's restart)."""
        return self._send("GET", path)

    def _send(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        """One request, retried on transport errors and `retry_statuses` with exponential backoff."""
        for attempt in range(self.retries + 1):
            try:
                response = self.http.request(method, path, **kwargs)
            except httpx.TransportError:
                if attempt == self.retries:
                    raise
            else:
                if response.status_code not in self.retry_statuses or attempt == self.retries:
                    _raise_for(response)
                    return response.json()
            time.sleep(self.backoff_s * 2 ** attempt)
        raise AssertionError("unreachable")

    def _stream(self, path: str, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        with self.http.stream("POST", path, json={**payload, "stream": True}) as response:
            if response.status_code >= 400:
                response.read()
            _raise_for(response)
            yield from _events(response.iter_lines())

    # ------------------------------------------------------------------ API
    def health(self) -> dict[str, Any]:
        response = self.http.get("/healthz")
        _raise_for(response)
        return response.json()

    def models(self) -> list[str]:
        response = self.http.get("/v1/models")
        _raise_for(response)
        return [m["id"] for m in response.json()["data"]]

    def complete(self, prompt: str, **params: Any) -> Completion:
        return _completion(self._post("/v1/completions", {"prompt": prompt, **params}))

    def complete_stream(self, prompt: str, **params: Any) -> Iterator[str]:
        for event in self._stream("/v1/completions", {"prompt": prompt, **params}):
            yield _delta(event)

    def chat(self, messages: list[dict[str, str]], **params: Any) -> Completion:
        return _completion(self._post("/v1/chat/completions", {"messages": messages, **params}))

    def chat_stream(self, messages: list[dict[str, str]], **params: Any) -> Iterator[str]:
        for event in self._stream("/v1/chat/completions", {"messages": messages, **params}):
            yield _delta(event)

    def ask(self, question: str, **params: Any) -> DocAnswer:
        return _answer(self._post("/v1/docqa", {"question": question, **params}))

    def ask_stream(self, question: str, **params: Any) -> Iterator[dict[str, Any]]:
        """Events: {"sources": [...]}, then {"delta": text}..., then the final answer object."""
        yield from self._stream("/v1/docqa", {"question": question, **params})

    def add_documents(self, documents: list[dict[str, Any]], idempotency_key: str | None = None,
                      as_job: bool = False, job_timeout_s: float = JOB_TIMEOUT_S,
                      progress: bool | None = None) -> dict[str, Any]:
        """Add documents to the service's index; every retry carries one `Idempotency-Key` (yours, else a new
        random one), so a retry after a lost answer never adds the batch twice.

        A large batch (or `as_job`) becomes a job on the service (202): its status is polled until it is done
        (at most `job_timeout_s`, then `JobTimeout`), with a progress bar after a few seconds (`progress`: None
        shows it on a terminal only, as tqdm does). A job whose replica stopped is posted again under the same
        key (it runs again; the index keeps the batch once). The answer: {"added", "num_documents",
        "num_chunks"} as for a small batch, plus "job"."""
        headers = _ingest_headers(idempotency_key)
        payload = {"documents": documents, **({"async": True} if as_job else {})}
        deadline = time.monotonic() + job_timeout_s
        for attempt in range(self.retries + 1):
            answer = self._post("/v1/documents", payload, headers)
            if "status_url" not in answer:
                return answer
            job = _poll_job(self._get, answer, deadline, progress)
            if not _restart(job) or attempt == self.retries:
                return _job_result(job)
        raise AssertionError("unreachable")


class JobTimeout(ApiError):
    """An ingest job that did not end within the client's `job_timeout_s` (it may still be running)."""


def _ingest_headers(key: str | None) -> dict[str, str]:
    return {"Idempotency-Key": key or f"rasd-client-{uuid.uuid4().hex}"}


def _restart(job: dict[str, Any]) -> bool:
    """A job that failed because its replica stopped (503): posting it again under its key runs it again."""
    return job["status"] == "failed" and (job.get("error") or {}).get("code") == 503


def _job_result(job: dict[str, Any]) -> dict[str, Any]:
    """A finished job as `add_documents` answers; a failed one raises its error."""
    if job["status"] != "done":
        err = job.get("error") or {}
        raise ApiError(int(err.get("code") or 500), err.get("message", "the ingest job failed"), err.get("type", ""))
    return {**(job.get("result") or {"added": job.get("added")}), "job": job["job"]}


def _poll_once(get: Any, answer: dict[str, Any]) -> dict[str, Any]:
    """The job's status; while no replica answers (one restarting), "running" as far as the client knows."""
    try:
        return get(answer["status_url"])
    except (httpx.TransportError, ApiError) as exc:
        if isinstance(exc, ApiError) and exc.status != 503:
            raise
        return {"job": answer["job"], "status": "running", "progress": 0.0, "stage": "unknown"}


def _poll_job(get: Any, answer: dict[str, Any], deadline: float, progress: bool | None) -> dict[str, Any]:
    """Poll a job's status URL until it ends or `deadline` passes (polls 0.25 s apart, growing to POLL_MAX_S);
    a tqdm bar of its progress once it has run BAR_AFTER_S."""
    from tqdm.auto import tqdm

    start, wait, bar = time.monotonic(), min(0.25, POLL_MAX_S), None
    try:
        while True:
            job = _poll_once(get, answer)
            if job["status"] not in ("queued", "running"):
                if bar is not None:
                    bar.update(bar.total - bar.n)
                return job
            if bar is None and time.monotonic() - start >= BAR_AFTER_S and progress is not False:
                bar = tqdm(total=100, desc="ingest", unit="%", disable=None if progress is None else False)
            if bar is not None:
                bar.set_postfix_str(job.get("stage", ""))
                bar.update(max(0, int(job["progress"] * 100) - bar.n))
            if time.monotonic() + wait > deadline:
                raise JobTimeout(504, f"ingest job {job['job']} is still {job['status']} ({job['progress']:.0%}) "
                                      f"after the client's timeout; poll {answer['status_url']}", "timeout")
            time.sleep(wait)
            wait = min(wait * 1.5, POLL_MAX_S)
    finally:
        if bar is not None:
            bar.close()


class AsyncClient:
    """The same API for asyncio code."""

    def __init__(self, url: str = "http://127.0.0.1:8000", api_key: str | None = None, timeout: float = 300.0,
                 retries: int = 3, backoff_s: float = 0.5, retry_busy: bool = False):
        import asyncio

        self._sleep = asyncio.sleep
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=timeout)
        self.retries, self.backoff_s = retries, backoff_s
        self.retry_statuses = RETRY_STATUSES | ({429} if retry_busy else set())

    async def aclose(self) -> None:
        await self.http.aclose()

    async def _post(self, path: str, payload: dict[str, Any], headers: dict[str, str] | None = None
                    ) -> dict[str, Any]:
        for attempt in range(self.retries + 1):
            try:
                response = await self.http.post(path, json=payload, headers=headers)
            except httpx.TransportError:
                if attempt == self.retries:
                    raise
            else:
                if response.status_code not in self.retry_statuses or attempt == self.retries:
                    _raise_for(response)
                    return response.json()
            await self._sleep(self.backoff_s * 2 ** attempt)
        raise AssertionError("unreachable")

    async def _stream(self, path: str, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        async with self.http.stream("POST", path, json={**payload, "stream": True}) as response:
            if response.status_code >= 400:
                await response.aread()
            _raise_for(response)
            lines = [line async for line in response.aiter_lines()]
        for event in _events(iter(lines)):
            yield event

    async def complete(self, prompt: str, **params: Any) -> Completion:
        return _completion(await self._post("/v1/completions", {"prompt": prompt, **params}))

    async def chat(self, messages: list[dict[str, str]], **params: Any) -> Completion:
        return _completion(await self._post("/v1/chat/completions", {"messages": messages, **params}))

    async def ask(self, question: str, **params: Any) -> DocAnswer:
        return _answer(await self._post("/v1/docqa", {"question": question, **params}))

    async def complete_stream(self, prompt: str, **params: Any) -> AsyncIterator[str]:
        async for event in self._stream("/v1/completions", {"prompt": prompt, **params}):
            yield _delta(event)

    async def add_documents(self, documents: list[dict[str, Any]], idempotency_key: str | None = None,
                            as_job: bool = False, job_timeout_s: float = JOB_TIMEOUT_S) -> dict[str, Any]:
        """As `Client.add_documents` (one `Idempotency-Key` across retries, a job polled to its end), without a
        progress bar."""
        headers = _ingest_headers(idempotency_key)
        payload = {"documents": documents, **({"async": True} if as_job else {})}
        deadline = time.monotonic() + job_timeout_s
        for attempt in range(self.retries + 1):
            answer = await self._post("/v1/documents", payload, headers)
            if "status_url" not in answer:
                return answer
            job = await self._poll_job(answer, deadline)
            if not _restart(job) or attempt == self.retries:
                return _job_result(job)
        raise AssertionError("unreachable")

    async def _poll_job(self, answer: dict[str, Any], deadline: float) -> dict[str, Any]:
        wait = 0.25
        while True:
            response = await self.http.get(answer["status_url"])
            if response.status_code in self.retry_statuses:
                job = {"job": answer["job"], "status": "running", "progress": 0.0}
            else:
                _raise_for(response)
                job = response.json()
            if job["status"] not in ("queued", "running"):
                return job
            if time.monotonic() + wait > deadline:
                raise JobTimeout(504, f"ingest job {job['job']} is still {job['status']} after the client's "
                                      f"timeout; poll {answer['status_url']}", "timeout")
            await self._sleep(wait)
            wait = min(wait * 1.5, POLL_MAX_S)


def main(argv: list[str] | None = None) -> int:
    """`python -m rasd.client ask QUESTION [--url URL]`: print the answer, its sources and statistics."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m rasd.client")
    p.add_argument("command", choices=["ask"])
    p.add_argument("question")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=os.environ.get("RASD_API_KEY"), help="default: $RASD_API_KEY")
    p.add_argument("--max-tokens", type=int, default=160)
    args = p.parse_args(argv)
    with Client(args.url, api_key=args.api_key, retries=5) as client:
        try:
            print("Answer: ", end="", flush=True)
            final: dict[str, Any] = {}
            sources: list[dict[str, Any]] = []
            for event in client.ask_stream(args.question, max_tokens=args.max_tokens):
                if "sources" in event:
                    sources = event["sources"]
                elif "delta" in event:
                    print(event["delta"], end="", flush=True)
                else:
                    final = event
        except (ApiError, httpx.HTTPError) as exc:
            print(f"\nerror: {exc}", file=sys.stderr)
            return 1
    print("\n\nSources:")
    for i, s in enumerate(sources, 1):
        print(f"  [{i}] {s.get('title') or s.get('source') or 'doc ' + str(s['doc_id'])} (chunk {s['chunk_id']}, "
              f"score {s['score']:.3f})")
    stats = final.get("rasd", {})
    if final.get("finish_reason") == "repetition":
        print("\n(the answer began to repeat itself and was stopped there)")
    print(f"\n{stats.get('new_tokens')} tokens, {stats.get('tokens_per_s')} tok/s decode, mean accepted "
          f"{stats.get('mean_accepted_tokens')}, accepted by source {stats.get('accepted_by_source')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
