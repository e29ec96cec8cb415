"""The model replica: a Serve deployment that owns the target model, the index and the batching scheduler
(`Service`), called by the HTTP ingress (`serve.ingress`) through a deployment handle.

Why apart from the HTTP layer: Serve routes a handle call after its arguments exist, so the request router
sees the prompt (`route=`) and can send it to the replica whose prefix cache already holds it; an HTTP request
is routed before its body is read. Like `ray.serve.llm`'s ingress and LLM server.

`route` and `stream_id` are for the router (`serve.router`), not used here.
Every call answers {"replica": id, "body": ...}; a streaming call yields the replica's id first, once the
request is admitted (a 429 or a bad field is an exception before it, which the ingress turns into an HTTP
status), then server-sent-event lines.
"""

import asyncio
import contextlib
import logging
import os
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Any

from ray import serve

from rasd.serve.config import ServeConfig
from rasd.serve.ingest import ACTIVE, status_url
from rasd.serve.openai import (
    FINISH_REASONS,
    ApiError,
    DocQARequest,
    choice_body,
    chunk_body,
    completion_body,
    logprobs_body,
    new_id,
    sse,
    usage,
    usage_chunk,
)
from rasd.serve.service import Prepared, Service
from rasd.text import Detokenizer, SourcedText

log = logging.getLogger(__name__)


def _usage(prompt_tokens: int, output: Any) -> dict[str, Any]:
    """OpenAI `usage` of a finished request, with the prompt tokens the prefix cache served."""
    return usage(prompt_tokens, len(output.token_ids), output.stats.cached_prompt_tokens)


def _stats_view(output: Any) -> dict[str, Any]:
    """The speculative statistics a response carries (the per-step lists are left out)."""
    stats = output.stats.to_dict()
    for name in ("accept_lengths", "tree_sizes", "tree_depths"):
        stats.pop(name, None)
    return stats


def _docqa_stats(output: Any) -> dict[str, Any]:
    """`_stats_view` plus `committed_by_source`: the sources of the tokens actually returned ("prefill" for
    the first). It equals `accepted_by_source` (+ prefill 1) unless a stop condition cut the last block:
    the verifier's counts include the accepted tokens after the stop point, which are never returned."""
    stats = _stats_view(output)
    stats["committed_by_source"] = dict(Counter(output.token_sources))
    return stats


def _plain_view(step_s: float | None) -> dict[str, float] | None:
    """The plain-decoding estimate: one target forward over one token, from the measured cost curve."""
    return None if not step_s else {"step_s": round(step_s, 6), "tokens_per_s": round(1.0 / step_s, 3)}


async def _admitted(events: AsyncIterator[tuple[str, Any]]) -> AsyncIterator[tuple[str, Any]]:
    """A request's events, started up to its first one before the response is: admission (429), a bad
    method or a failed prefill are then real HTTP statuses for a stream too, not an error event after a 200.
    The first event (the prefill's token) is what a streaming client waits for anyway."""
    first = await anext(events, None)

    async def replay() -> AsyncIterator[tuple[str, Any]]:
        if first is None:
            return
        yield first
        async for event in events:
            yield event

    return replay()


def as_api_error(exc: Exception) -> ApiError:
    """`exc` as the error a client receives: itself if it is one, else a 500 naming it (and logged)."""
    if isinstance(exc, ApiError):
        return exc
    log.exception("a stream failed mid-answer")
    return ApiError(500, f"decoding failed mid-answer: {type(exc).__name__}: {exc}", "server_error")


async def _all_choices(runs: list[Any]) -> list[Any]:
    """Every choice's output; one failing cancels the others and its own error is raised (a 429 stays a 429:
    a TaskGroup would wrap it in an ExceptionGroup, which no handler turns into an HTTP status)."""
    if len(runs) == 1:
        return [await runs[0]]
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(run) for run in runs]
    except ExceptionGroup as errors:
        raise errors.exceptions[0] from None
    return [t.result() for t in tasks]


@dataclass
class _ChoiceStream:
    """One choice's text and log-probability offset while its chunks are streamed."""

    text: Detokenizer
    first: bool = True
    offset: int = 0


async def _merged(streams: list[AsyncIterator[tuple[str, Any]]]) -> AsyncIterator[tuple[int, str, Any]]:
    """(choice, kind, payload) from several event streams as they come; a failure in one is handed on as
    ("error", an ApiError) and ends the merge (the other streams are cancelled, their requests leave the batch).

    Why any exception, not only ApiError: one that ended a pump silently would end the merge as if every choice
    had finished, and the truncated text would be followed by [DONE]."""
    queue: asyncio.Queue[tuple[int, str, Any]] = asyncio.Queue()

    async def pump(i: int, events: AsyncIterator[tuple[str, Any]]) -> None:
        try:
            async for kind, payload in events:
                await queue.put((i, kind, payload))
        except Exception as exc:   # noqa: BLE001 - every failure reaches the client as an error event
            await queue.put((i, "error", as_api_error(exc)))
        finally:
            await queue.put((i, "end", None))

    tasks = [asyncio.create_task(pump(i, events)) for i, events in enumerate(streams)]
    try:
        open_streams = len(tasks)
        while open_streams:
            i, kind, payload = await queue.get()
            if kind == "end":
                open_streams -= 1
                continue
            yield i, kind, payload
            if kind == "error":
                return
    finally:
        for task in tasks:
            task.cancel()


@serve.deployment(name="RasdServer", max_ongoing_requests=256, health_check_period_s=10)
class RasdServer:
    """One replica: the target model, the index and the continuous-batching scheduler (see `Service`)."""

    def __init__(self, config: ServeConfig):
        self.config = config           # checked and resolved by `build_app` (`ServeConfig.from_dict/from_args`)
        self.replica_id = _replica_id()
        self.service = Service(self.config, owner=self.replica_id)

    def __del__(self) -> None:
        """Serve calls this when it shuts a replica down: persist the recycling matrix (hot next start)."""
        service = getattr(self, "service", None)
        if service is not None:
            service.close()

    def check_health(self) -> None:
        """Serve restarts the replica when the scheduler thread has died or is stuck."""
        problem = self.service.broken()
        if problem is not None:
            raise RuntimeError(problem)

    # ------------------------------------------------------------------ state (broadcast by the ingress)
    # These run on the replica's event loop, beside every stream: none of them waits on an actor (a verifier's
    # state is what its last ping brought, `distributed.verifier.VerifierWatch`), so a slow or stopped actor
    # never stalls the streams, and /healthz answers at once.
    async def health(self) -> dict[str, Any]:
        service = self.service
        running, waiting = service.load()
        return {"replica": self.replica_id, "problem": service.health_problem(), "running": running,
                "waiting": waiting, "index": None if service.index is None else str(service.index.root),
                "torch_threads": service.backend.threads,
                "omp": os.environ.get("OMP_NUM_THREADS"),
                "verifier": service.backend.name, "dtype": service.target.dtype,
                "dtype_reason": service.target.dtype_reason}

    async def info(self) -> dict[str, Any]:
        return self.service.info()

    async def metrics(self) -> bytes:
        return self.service.metrics.render()

    # ------------------------------------------------------------------ generation
    async def complete(self, endpoint: str, body: Any, route: str | None = None) -> dict[str, Any]:
        """A whole response of /v1/completions ("completions"), /v1/chat/completions ("chat") or /v1/docqa."""
        prepared = await self._prepare(endpoint, body)
        if isinstance(body, DocQARequest):
            return self._answer(await self._docqa(body, prepared))
        return self._answer(await self._generate(endpoint, body, prepared, chat=endpoint == "chat"))

    async def stream(self, endpoint: str, body: Any, route: str | None = None,
                     stream_id: str | None = None) -> AsyncIterator[str]:
        """This replica's id once the request is admitted, then the response's server-sent-event lines.
        Closed early (the client left), every choice's request leaves the batch."""
        prepared = await self._prepare(endpoint, body)
        docqa = isinstance(body, DocQARequest)
        choices = [prepared] if docqa else self.service.choices(prepared, body.n)
        raw = [self.service.events(p, sourced=docqa) for p in choices]
        try:
            streams = [await _admitted(events) for events in raw]
            if docqa:
                lines = self._docqa_stream(prepared, streams[0])
            else:
                lines = self._sse(endpoint, prepared, endpoint == "chat", streams, body)
            yield self.replica_id
            async with contextlib.aclosing(lines) as opened:
                async for line in opened:
                    yield line
        finally:
            for events in raw:       # those never iterated (the client left before the first line) end here
                with contextlib.suppress(RuntimeError):
                    await events.aclose()

    async def documents(self, docs: list[dict[str, Any]], key: str | None, as_job: bool = False) -> dict[str, Any]:
        """An ingest, queued on the service's ingest thread (`serve.ingest`; full: 429 at once). `as_job`, or a
        re-post of a job still queued or running: 202 with the job's status URL at once; else the answer when
        it is committed (a re-post of a finished job: its answer, `"replayed": true`)."""
        job, fresh = await asyncio.to_thread(self.service.ingest, docs, key)   # hashing a large body: off the loop
        if as_job or (not fresh and job.status in ACTIVE):
            return {**self._answer({"job": job.id, "status_url": status_url(job.id), "status": job.status}),
                    "status": 202}
        if job.future is None or not fresh:
            if job.status != "done" or job.result is None:
                raise ApiError(409, f"ingest job {job.id} is {job.status}", param="Idempotency-Key")
            return self._answer({**job.result, "replayed": True})
        # shielded: a client that leaves must not cancel a queued job (it would never run, nor free its place)
        return self._answer(await asyncio.shield(asyncio.wrap_future(job.future)))

    async def ingest_job(self, job_id: str) -> dict[str, Any]:
        """A job's record as this replica knows it (None: unknown here), and this replica's id (`broadcast`)."""
        return {"replica": self.replica_id, "job": await asyncio.to_thread(self.service.ingest_job, job_id)}

    def _answer(self, body: Any) -> dict[str, Any]:
        return {"replica": self.replica_id, "body": body}

    async def _prepare(self, endpoint: str, body: Any) -> Prepared:
        """Admission (429), tokenizing and the request's checks, before any decoding."""
        service = self.service
        if isinstance(body, DocQARequest):
            if body.n != 1:
                raise ApiError(400, "document QA answers with one choice (n=1)", param="n")
            service.check_capacity()
            ids, sources = await asyncio.to_thread(service.docqa_prompt, body.question, body.top_k_sources,
                                                   body.token_limit())
            return service.prepare(body, ids, self.config.docqa_method, 256, sources)
        service.check_capacity()
        service.check_model(body.model)
        if endpoint == "chat":
            ids = await asyncio.to_thread(service.encode_chat, body.message_dicts())
            return service.prepare(body, ids, self.config.method, None)
        given = body.prompt_ids()
        ids = (service.check_token_ids(given) if given is not None
               else await asyncio.to_thread(service.encode_text, body.prompt_text()))
        return service.prepare(body, ids, self.config.method, 16)

    async def _docqa(self, body: DocQARequest, prepared: Prepared) -> dict[str, Any]:
        start = time.perf_counter()
        output = await self.service.run(prepared)
        self.service.metrics.record("docqa", output.stats, time.perf_counter() - start)
        return {"id": new_id("docqa"), "object": "docqa.answer", "model": self.config.model_name,
                "answer": (output.text or "").strip(), "finish_reason": FINISH_REASONS[output.finish_reason],
                "sources": [asdict(s) for s in prepared.sources], "usage": _usage(len(prepared.prompt_ids), output),
                "rasd": _docqa_stats(output), "plain_decoding": _plain_view(output.plain_step_s)}

    # ------------------------------------------------------------------ helpers
    async def _generate(self, endpoint: str, body: Any, prepared: Prepared, chat: bool) -> Any:
        """One response of `body.n` choices, each decoded as its own row of the batch."""
        choices = self.service.choices(prepared, body.n)
        start = time.perf_counter()
        outputs = await _all_choices([self.service.run(p) for p in choices])
        bodies = []
        for i, output in enumerate(outputs):
            self.service.metrics.record(endpoint, output.stats, time.perf_counter() - start)
            logprobs = None if output.logprobs is None else logprobs_body(output.logprobs, self._piece, chat)
            bodies.append(choice_body(i, output.text or "", FINISH_REASONS[output.finish_reason], chat, logprobs))
        total = usage(len(prepared.prompt_ids), sum(len(o.token_ids) for o in outputs),
                      outputs[0].stats.cached_prompt_tokens)
        stats = _stats_view(outputs[0]) if len(outputs) == 1 else [_stats_view(o) for o in outputs]
        return completion_body(new_id("chatcmpl" if chat else "cmpl"), self.config.model_name, bodies, chat,
                               usage=total, rasd=stats)

    def _piece(self, token: int) -> str:
        """One token's text, as the `logprobs` objects show it."""
        return self.service.target.tokenizer.decode([token])

    async def _sse(self, endpoint: str, prepared: Prepared, chat: bool, streams: list[AsyncIterator[tuple[str, Any]]],
                   body: Any) -> AsyncIterator[str]:
        """Server-sent chunks of every choice as its blocks are committed (`index` tells them apart), each
        choice's last chunk with its finish reason, then the usage chunk when asked for, then [DONE]."""
        rid, model = new_id("chatcmpl" if chat else "cmpl"), self.config.model_name
        states = [_ChoiceStream(Detokenizer(self.service.target.tokenizer, prepared.stop)) for _ in streams]
        start, completion, cached = time.perf_counter(), 0, 0
        async with contextlib.aclosing(_merged(streams)) as merged:   # a client gone: every choice stops
            async for i, kind, payload in merged:
                state = states[i]
                if kind == "error":   # an abnormal end: the error event and no [DONE] (the answer is incomplete)
                    self.service.metrics.failed(endpoint, str(payload.status))
                    yield sse(payload.body())
                    return
                if kind == "tokens":
                    tokens = payload.tokens if hasattr(payload, "tokens") else payload
                    delta = state.text.push(tokens)
                    logprobs = None
                    if getattr(payload, "logprobs", None) is not None:
                        logprobs = logprobs_body(payload.logprobs, self._piece, chat, state.offset)
                        state.offset += sum(len(self._piece(t)) for t in tokens)
                    if delta or state.first or logprobs is not None:
                        yield sse(chunk_body(rid, model, delta, None, chat, first=state.first, logprobs=logprobs,
                                             index=i))
                        state.first = False
                    continue
                rest = state.text.finish(payload.text or "")
                completion += len(payload.token_ids)
                cached = payload.stats.cached_prompt_tokens if i == 0 else cached
                yield sse(chunk_body(rid, model, rest, FINISH_REASONS[payload.finish_reason], chat, first=state.first,
                                     index=i, usage=_usage(len(prepared.prompt_ids), payload),
                                     rasd=_stats_view(payload)))
                self.service.metrics.record(endpoint, payload.stats, time.perf_counter() - start)
            else:
                if getattr(body, "include_usage", False):
                    yield sse(usage_chunk(rid, model, chat, usage(len(prepared.prompt_ids), completion, cached)))
        yield sse("[DONE]")

    async def _docqa_stream(self, prepared: Prepared, events: AsyncIterator[tuple[str, Any]]
                            ) -> AsyncIterator[str]:
        """Events: {"sources": [...]} first, then one {"delta": text, "pieces", "token_sources", "step_sources",
        "plain_decoding"} per committed block (the first token's, then one per verification step), then the final
        answer object, then [DONE]. `step_sources`: what the step committed, some of it perhaps held back (a
        possible repetition) and shown by a later block or never (dropped: finish reason "repetition").

        `pieces` split `delta` by the token each character came from (`{"text", "source"}`, concatenating to
        `delta`); `token_sources` has one entry per committed token (an EOS or text held back for a possible
        stop string has a source but no text yet), so counting them gives the final `committed_by_source`.
        """
        yield sse({"sources": [asdict(s) for s in prepared.sources]})
        text = SourcedText(self.service.target.tokenizer, prepared.stop)
        start = time.perf_counter()
        try:
            async for kind, payload in events:
                if kind == "tokens":
                    delta, pieces = text.push(payload.tokens, payload.sources)
                    yield sse({"delta": delta, "pieces": pieces, "token_sources": payload.sources,
                               "step_sources": payload.step, "plain_decoding": _plain_view(payload.plain_step_s)})
                    continue
                rest, pieces = text.finish(payload.text or "")
                if rest:
                    yield sse({"delta": rest, "pieces": pieces, "token_sources": []})
                self.service.metrics.record("docqa", payload.stats, time.perf_counter() - start)
                yield sse({"answer": (payload.text or "").strip(),
                           "finish_reason": FINISH_REASONS[payload.finish_reason],
                           "usage": _usage(len(prepared.prompt_ids), payload),
                           "rasd": _docqa_stats(payload), "accept_lengths": list(payload.stats.accept_lengths),
                           "plain_decoding": _plain_view(payload.plain_step_s)})
        except Exception as exc:   # noqa: BLE001 - an abnormal end: the error event and no [DONE]
            yield sse(as_api_error(exc).body())
            return
        yield sse("[DONE]")


def _replica_id() -> str:
    """This replica's Serve id (the router's and the `X-Rasd-Replica` header's name for it)."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:      # noqa: BLE001 - outside a Serve replica (a unit test): any stable name does
        return f"local-{os.getpid()}"
