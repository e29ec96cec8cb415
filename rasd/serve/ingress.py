"""The HTTP ingress: OpenAI-compatible completions, document QA, ingest, health, metrics and the web page.

It holds no model. It checks the key and the sizes (middlewares, before a body is read), validates the
request, and hands it to a model replica (`serve.replica.RasdServer`) through a deployment handle, with the
prompt's text as `route=`: the prefix-aware request router (`serve.router`) sends it to the replica whose
cache already holds that prefix. Health and metrics are gathered from every replica (`broadcast`).
"""

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException

from rasd.serve.auth import ApiKeyMiddleware, HostCheckMiddleware, resolve_api_key
from rasd.serve.config import ServeConfig
from rasd.serve.drain import Drain, DrainMiddleware
from rasd.serve.ingest import JOB_ID, settled
from rasd.serve.limits import BodyLimitMiddleware, Limits, check_chat, check_documents, check_prompt, check_question
from rasd.serve.metrics import CONTENT_TYPE, merge_metrics, router_metrics
from rasd.serve.openai import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    DocQARequest,
    DocumentsRequest,
    error_body,
)
from rasd.serve.router import shared_state
from rasd.serve.web import static_file

REPLICA_HEADER = "X-Rasd-Replica"      # which replica answered (a chat's turns should share one)
IGNORED_HEADER = "X-Rasd-Ignored-Fields"   # the request's fields without effect here (`_Request.ignored_fields`)
log = logging.getLogger("rasd.serve")
STATE_TIMEOUT_S = 10.0                 # a replica slower than this to report its health counts as unhealthy

api = FastAPI(title="rasd", description="Retrieval-augmented speculative decoding: lossless, faster answers")
api.state.api_key = None       # set by the ingress; the middlewares check key and size before a body is read
api.state.limits = Limits()
api.state.allowed_hosts = []
api.state.drain = Drain()      # `RasdIngress.drain`: refuse new requests, finish or cut the running ones
api.add_middleware(BodyLimitMiddleware, limits_source=lambda: api.state.limits)
api.add_middleware(ApiKeyMiddleware, key_source=lambda: api.state.api_key)
api.add_middleware(HostCheckMiddleware, key_source=lambda: api.state.api_key,
                   hosts_source=lambda: api.state.allowed_hosts)
api.add_middleware(DrainMiddleware, drain_source=lambda: api.state.drain)   # added last: runs first, counts all


@api.exception_handler(ApiError)
async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=getattr(exc, "headers", None) or None)


@api.exception_handler(HTTPException)
async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """FastAPI's own refusals (no such path, wrong HTTP method, an unparsable body) in OpenAI's error shape too."""
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return JSONResponse(error_body(message, kind, None, exc.status_code), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


@api.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    message = f"{param}: {first.get('msg', 'invalid request')}" if param else str(first.get("msg", exc))
    return JSONResponse(error_body(message, "invalid_request_error", param, 400), status_code=400)


def _unwrapped(exc: BaseException) -> BaseException:
    """The replica's own exception inside Ray's wrapper (an ApiError keeps its HTTP status)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def _job_view(record: dict[str, Any]) -> dict[str, Any]:
    """A job's status answer: the record without what only replicas use."""
    return {k: v for k, v in record.items() if k != "live"}


def chat_route(body: ChatRequest) -> str:
    """The text a chat's prefix is judged by: its messages in order, as the chat template lays them out."""
    return "".join(f"\x1e{m['role']}\x1f{m['content']}" for m in body.message_dicts())


def _ignored(body: Any) -> dict[str, str]:
    """The header naming the request's fields without effect (none: no header), each also logged: accepted as
    vLLM accepts them, but never silently (a misspelt `temprature` would otherwise look honoured)."""
    names = ", ".join(_printable(n[:64]) for n in body.ignored_fields()[:32])
    if not names:
        return {}
    log.warning("request fields without effect here, ignored: %s", names)
    return {IGNORED_HEADER: names}


def _printable(name: str) -> str:
    """A client's field name as a header value and a log line can carry it: printable ASCII, others as '?'."""
    return "".join(c if c.isascii() and c.isprintable() else "?" for c in name)


def _release(lines: Any, stream_id: str) -> None:
    """The stream is over for the router (no longer in flight) and for its replica (cancelled); twice is harmless."""
    shared_state().stream_closed(stream_id)
    with contextlib.suppress(Exception):
        lines.cancel()


class RelayResponse(StreamingResponse):
    """A replica's event lines to the client, released when the response ends however it ends: a client that
    leaves cancels the replica's generator, and with it the request's rows in the batch.

    Why here and not in a generator's `finally`: a client that leaves cancels the response while such a
    generator waits at a `yield`, where its `finally` runs only when it is garbage-collected; until then the
    router counted the stream in flight and sent new requests away from an idle replica."""

    def __init__(self, lines: Any, stream_id: str, headers: dict[str, str]):
        super().__init__(api.state.drain.relay(lines), media_type="text/event-stream", headers=headers)
        self.lines, self.stream_id = lines, stream_id

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            _release(self.lines, self.stream_id)


@serve.deployment(name="RasdIngress", max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class RasdIngress:
    """The HTTP face of the service; `replicas` is the handle of the model replicas."""

    def __init__(self, replicas: Any, config: ServeConfig):
        """`config` comes checked and resolved from `build_app`; the key is looked up once more here so that one
        only this replica's environment holds (e.g. a runtime_env) applies too, never less than the builder's."""
        self.config = config
        self.replicas = replicas
        self.api_key = resolve_api_key(self.config.api_key)
        self.limits = Limits(**self.config.limits)
        self.started = time.time()
        api.state.api_key, api.state.limits = self.api_key, self.limits
        api.state.allowed_hosts = list(self.config.allowed_hosts)

    # ------------------------------------------------------------------ web page (no API key: static files)
    @api.get("/", response_class=HTMLResponse)
    async def page(self) -> Response:
        found = static_file("index.html")
        if found is None:
            raise ApiError(404, "the web page is not installed", "not_found_error")
        return Response(found[0], media_type=found[1])

    @api.get("/static/{name}")
    async def static(self, name: str) -> Response:
        found = static_file(name)
        if found is None:
            raise ApiError(404, f"no static file {name!r}", "not_found_error")
        return Response(found[0], media_type=found[1], headers={"Cache-Control": "no-cache"})

    # ------------------------------------------------------------------ state of every replica
    @api.get("/healthz")
    async def healthz(self) -> Any:
        """200 with the service's state (requests summed over replicas), or 503 when a replica's decoding
        loop is dead or stuck with work waiting, or does not answer."""
        states = await self._every_replica("health")
        problems = [s["problem"] if isinstance(s, dict) else f"a replica did not answer: {s}" for s in states]
        problem = next((p for p in problems if p), None) if states else "no replica is running"
        healthy = [s for s in states if isinstance(s, dict)]
        first = healthy[0] if healthy else {}
        body = {"status": "ok" if problem is None else "unhealthy", "problem": problem,
                "model": self.config.model_name, "auth": self.api_key is not None,
                "running": sum(s["running"] for s in healthy), "waiting": sum(s["waiting"] for s in healthy),
                "index": first.get("index"), "torch_threads": first.get("torch_threads"), "omp": first.get("omp"),
                "verifier": first.get("verifier"), "dtype": first.get("dtype"),
                "dtype_reason": first.get("dtype_reason"), "replicas": [
                    {k: s[k] for k in ("replica", "running", "waiting", "problem", "verifier")} for s in healthy]}
        return body if problem is None else JSONResponse(body, status_code=503)

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.config.model_name, "object": "model",
                                            "created": int(self.started), "owned_by": "rasd"}]}

    @api.get("/v1/models/{model}")
    async def model(self, model: str) -> dict[str, Any]:
        """OpenAI's retrieve-a-model (`client.models.retrieve`): this service's one model, else a 404."""
        if model != self.config.model_name:
            raise ApiError(404, f"model {model[:200]!r} is not served here; this service serves "
                                f"{self.config.model_name!r}", "not_found_error", "model")
        return (await self.models())["data"][0]

    @api.get("/v1/info")
    async def info(self) -> dict[str, Any]:
        info = await self._call(self.replicas.info.remote())
        states = await self._every_replica("health")
        return {**info, "replicas": sum(isinstance(s, dict) for s in states)}

    @api.get("/metrics")
    async def metrics(self) -> Response:
        texts = [t for t in await self._every_replica("metrics") if isinstance(t, bytes)]
        router = shared_state()
        return Response(merge_metrics(texts) + router_metrics(router.snapshot(), router.in_flight_now()),
                        media_type=CONTENT_TYPE)

    # ------------------------------------------------------------------ generation
    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest) -> Any:
        check_prompt(body, self.limits)
        return await self._generate("completions", body, body.prompt_text())

    @api.post("/v1/chat/completions")
    async def chat(self, body: ChatRequest) -> Any:
        check_chat(body, self.limits)
        return await self._generate("chat", body, chat_route(body))

    @api.post("/v1/docqa")
    async def docqa(self, body: DocQARequest) -> Any:
        check_question(body, self.limits)
        return await self._generate("docqa", body, body.question)

    @api.post("/v1/documents")
    async def documents(self, body: DocumentsRequest, request: Request) -> Any:
        check_documents(body, self.limits)
        key = request.headers.get("idempotency-key")
        if key is not None and not 1 <= len(key) <= 255:
            raise ApiError(400, "Idempotency-Key must have 1 to 255 characters", param="Idempotency-Key")
        docs = [d.model_dump() for d in body.documents]
        size = sum(len(d["text"].encode("utf-8", "replace")) for d in docs)
        as_job = body.async_ or size > self.config.ingest_job_bytes
        answer = await self._call(self.replicas.documents.remote(docs, key, as_job))
        response = self._response(answer)
        if response.status_code == 202:
            response.headers["Location"] = answer["body"]["status_url"]
        return response

    @api.get("/v1/documents/jobs/{job_id}")
    async def ingest_job(self, job_id: str) -> dict[str, Any]:
        """An ingest job's state, from the replica that runs it, else from its record under the index: one left
        queued or running by a replica that no longer runs is failed (`serve.ingest.settled`)."""
        if not JOB_ID.match(job_id):
            raise ApiError(404, f"no ingest job {job_id[:80]!r}", "not_found_error", "job")
        answers = await self._every_replica("ingest_job", job_id)
        known = [a for a in answers if isinstance(a, dict)]
        if not known:                                       # restarting: the client polls on
            raise ApiError(503, "no replica answered; retry", "service_unavailable")
        records = [a["job"] for a in known if a["job"] is not None]
        if not records:
            raise ApiError(404, f"no ingest job {job_id!r}", "not_found_error", "job")
        live = next((r for r in records if r["live"]), None)
        if live is not None or len(known) < len(answers):   # a replica that did not answer may be running it
            return _job_view(live or records[0])
        return _job_view(settled(records[0], {a["replica"] for a in known}))

    # ------------------------------------------------------------------ shutdown
    async def drain(self, grace_s: float) -> dict[str, int]:
        """Called by `rasd serve` on SIGTERM/SIGINT and by `rasd serve --stop` (a handle call, no HTTP route):
        new requests get 503 + Retry-After from now on, the running ones get `grace_s` to finish, the rest an
        error (`serve.drain`). Returns how many were in flight, finished and cut."""
        log.warning("draining: new requests are refused, running ones get %.0f s", grace_s)
        return await api.state.drain.run(grace_s)

    # ------------------------------------------------------------------ helpers
    async def _generate(self, endpoint: str, body: Any, route: str) -> Any:
        """Hand a request to a replica chosen by its prompt's prefix; a stream starts once it is admitted."""
        ignored = _ignored(body)
        if not body.stream:
            answer = await self._call(self.replicas.complete.remote(endpoint, body, route=route))
            return self._response(answer, ignored)
        stream_id = uuid.uuid4().hex            # the router counts the stream in flight until it is closed
        lines = self.replicas.options(stream=True).stream.remote(endpoint, body, route=route, stream_id=stream_id)
        try:
            replica = await api.state.drain.call(lines.__anext__())
        except BaseException as exc:  # a refusal (429, 400) as its HTTP status; a client gone before the start
            _release(lines, stream_id)
            if isinstance(exc, Exception):
                raise _unwrapped(exc) from None
            raise
        return RelayResponse(lines, stream_id, {REPLICA_HEADER: replica, **ignored})

    @staticmethod
    async def _call(response: Any) -> Any:
        """A replica's answer (its own error unwrapped), or the shutdown 503 once a drain's grace has ended."""
        try:
            return await api.state.drain.call(response)
        except Exception as exc:     # noqa: BLE001 - see _unwrapped
            raise _unwrapped(exc) from None

    @staticmethod
    def _response(answer: dict[str, Any], headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(answer["body"], status_code=answer.get("status", 200),
                            headers={REPLICA_HEADER: answer["replica"], **(headers or {})})

    async def _every_replica(self, method: str, *args: Any) -> list[Any]:
        """`method`'s answer from every running replica (an exception in place of one that failed)."""
        try:
            response = self.replicas.broadcast(method, *args)
            return await asyncio.wait_for(response.results_async(return_exceptions=True), STATE_TIMEOUT_S)
        except Exception as exc:     # noqa: BLE001 - no replica up yet, or none answered in time
            return [exc]
