"""The Ray Serve app: OpenAI-compatible completions, document QA, ingest, health and metrics over HTTP.

Config (`ServeConfig`), builder (`build_app`, also the `serve run serve_config.yaml` entry point) and the
deployment are kept apart, like `ray.serve.llm`. The deployment is a thin HTTP layer over `Service`.

`rasd serve` starts (or joins, with `--address`) Ray, deploys the app, prints the URL and stays in the
foreground until interrupted; `--detach` leaves it running on a local Ray cluster and returns (`rasd serve
--stop` shuts it down), which is what `make run` / `make stop` use.
"""


import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from ray import serve

from rasd.serve.auth import ApiKeyMiddleware, resolve_api_key
from rasd.serve.limits import BodyLimitMiddleware, Limits, check_chat, check_documents, check_prompt, check_question
from rasd.serve.loopback import is_single_machine, loopback_env, single_machine_ray
from rasd.serve.metrics import CONTENT_TYPE
from rasd.serve.openai import (
    FINISH_REASONS,
    ApiError,
    ChatRequest,
    CompletionRequest,
    DocQARequest,
    DocumentsRequest,
    choice_body,
    chunk_body,
    completion_body,
    error_body,
    logprobs_body,
    new_id,
    sse,
    usage,
    usage_chunk,
)
from rasd.serve.service import Prepared, ServeConfig, Service, default_threads
from rasd.serve.web import static_file
from rasd.text import Detokenizer, SourcedText

APP_NAME = "rasd"

api = FastAPI(title="rasd", description="Retrieval-augmented speculative decoding: lossless, faster answers")
api.state.api_key = None       # set by the replica; the middlewares check key and size before a body is read
api.state.limits = Limits()
api.add_middleware(BodyLimitMiddleware, limits_source=lambda: api.state.limits)
api.add_middleware(ApiKeyMiddleware, key_source=lambda: api.state.api_key)   # added last: runs first


@api.exception_handler(ApiError)
async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


@api.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    message = f"{param}: {first.get('msg', 'invalid request')}" if param else str(first.get("msg", exc))
    return JSONResponse(error_body(message, "invalid_request_error", param, 400), status_code=400)


def _usage(prompt_tokens: int, output: Any) -> dict[str, Any]:
    """OpenAI `usage` of a finished request, with the prompt tokens the prefix cache served."""
    return usage(prompt_tokens, len(output.token_ids), output.stats.cached_prompt_tokens)


def _stats_view(output: Any) -> dict[str, Any]:
    """The speculative statistics a response carries (the per-step lists are left out)."""
    stats = output.stats.to_dict()
    for name in ("accept_lengths", "tree_sizes"):
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
    """(choice, kind, payload) from several event streams as they come; an ApiError in one is handed on as
    ("error", the error) and ends the merge (the other streams are cancelled, their requests leave the batch)."""
    queue: asyncio.Queue[tuple[int, str, Any]] = asyncio.Queue()

    async def pump(i: int, events: AsyncIterator[tuple[str, Any]]) -> None:
        try:
            async for kind, payload in events:
                await queue.put((i, kind, payload))
        except ApiError as exc:
            await queue.put((i, "error", exc))
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
@serve.ingress(api)
class RasdServer:
    """One replica: the target model, the index and the continuous-batching scheduler (see `Service`)."""

    def __init__(self, config: dict[str, Any]):
        self.config = ServeConfig(**config)
        self.service = Service(self.config)
        self.api_key = resolve_api_key(self.config.api_key)
        self.limits = Limits(**self.config.limits)
        api.state.api_key, api.state.limits = self.api_key, self.limits

    def __del__(self) -> None:
        """Serve calls this when it shuts a replica down: persist the recycling matrix (hot next start)."""
        service = getattr(self, "service", None)
        if service is not None:
            service.close()

    def check_health(self) -> None:
        """Serve restarts the replica when the scheduler thread has died or is stuck."""
        problem = self.service.health_problem()
        if problem is not None:
            raise RuntimeError(problem)

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

    # ------------------------------------------------------------------ small endpoints
    @api.get("/healthz")
    async def healthz(self) -> Any:
        """200 with the service's state, or 503 when its decoding loop is dead or stuck with work waiting."""
        service = self.service
        running, waiting = service.load()
        problem = service.health_problem()
        body = {"status": "ok" if problem is None else "unhealthy", "problem": problem,
                "model": self.config.model_name, "auth": self.api_key is not None,
                "running": running, "waiting": waiting,
                "index": None if service.index is None else str(service.index.root),
                "torch_threads": None if service.scheduler is None else service.scheduler.loop_threads,
                "omp": os.environ.get("OMP_NUM_THREADS"),
                "verifier": None if service.verifier is None else service.verifier.name}
        return body if problem is None else JSONResponse(body, status_code=503)

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.config.model_name, "object": "model",
                                            "created": int(self.service.started), "owned_by": "rasd"}]}

    @api.get("/v1/info")
    async def info(self) -> dict[str, Any]:
        return self.service.info()

    @api.get("/metrics")
    async def metrics(self) -> Response:
        return Response(self.service.metrics.render(), media_type=CONTENT_TYPE)

    # ------------------------------------------------------------------ generation
    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest) -> Any:
        check_prompt(body, self.limits)
        self.service.check_capacity()
        self.service.check_model(body.model)
        ids = await asyncio.to_thread(self.service.encode_text, body.prompt_text())
        prepared = self.service.prepare(body, ids, self.config.method, 16)
        return await self._generate("completions", body, prepared, chat=False)

    @api.post("/v1/chat/completions")
    async def chat(self, body: ChatRequest) -> Any:
        check_chat(body, self.limits)
        self.service.check_capacity()
        self.service.check_model(body.model)
        ids = await asyncio.to_thread(self.service.encode_chat, body.message_dicts())
        prepared = self.service.prepare(body, ids, self.config.method, None)
        return await self._generate("chat", body, prepared, chat=True)

    @api.post("/v1/docqa")
    async def docqa(self, body: DocQARequest) -> Any:
        check_question(body, self.limits)
        if body.n != 1:
            raise ApiError(400, "document QA answers with one choice (n=1)", param="n")
        self.service.check_capacity()
        ids, sources = await asyncio.to_thread(self.service.docqa_prompt, body.question, body.top_k_sources,
                                               body.token_limit())
        prepared = self.service.prepare(body, ids, self.config.docqa_method, 256, sources)
        if body.stream:
            events = await _admitted(self.service.events(prepared, sourced=True))
            return StreamingResponse(self._docqa_stream(prepared, events), media_type="text/event-stream")
        start = time.perf_counter()
        output = await self.service.run(prepared)
        self.service.metrics.record("docqa", output.stats, time.perf_counter() - start)
        return {"id": new_id("docqa"), "object": "docqa.answer", "model": self.config.model_name,
                "answer": (output.text or "").strip(), "finish_reason": FINISH_REASONS[output.finish_reason],
                "sources": [asdict(s) for s in sources], "usage": _usage(len(ids), output),
                "rasd": _docqa_stats(output), "plain_decoding": _plain_view(output.plain_step_s)}

    @api.post("/v1/documents")
    async def documents(self, body: DocumentsRequest, request: Request) -> dict[str, Any]:
        check_documents(body, self.limits)
        key = request.headers.get("idempotency-key")
        if key is not None and not 1 <= len(key) <= 255:
            raise ApiError(400, "Idempotency-Key must have 1 to 255 characters", param="Idempotency-Key")
        try:
            return await asyncio.to_thread(self.service.add_documents, [d.model_dump() for d in body.documents],
                                           key)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="documents") from exc

    # ------------------------------------------------------------------ helpers
    async def _generate(self, endpoint: str, body: Any, prepared: Prepared, chat: bool) -> Any:
        """One response of `body.n` choices, each decoded as its own row of the batch."""
        choices = self.service.choices(prepared, body.n)
        if body.stream:
            events = [await _admitted(self.service.events(p)) for p in choices]
            return StreamingResponse(self._sse(endpoint, prepared, chat, events, body),
                                     media_type="text/event-stream")
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
                if kind == "error":
                    self.service.metrics.failed(endpoint, str(payload.status))
                    yield sse(payload.body())
                    break
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
        """Events: {"sources": [...]} first, then one {"delta": text, "pieces", "token_sources", "plain_decoding"}
        per committed block, then the final answer object, then [DONE].

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
                               "plain_decoding": _plain_view(payload.plain_step_s)})
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
        except ApiError as exc:
            yield sse(exc.body())
        yield sse("[DONE]")


# ---------------------------------------------------------------------------------------------- builder


# The smallest value each numeric limit may take (a replica given less would fail while starting).
CONFIG_MINIMUMS = {"max_batch": 1, "max_waiting": 0, "max_tokens_limit": 1, "prefill_chunk": 0,
                   "prefix_cache_mb": 0, "retrieval_shards": 0, "draft_workers": 0}


def check_config(args: dict[str, Any]) -> None:
    """Raise ValueError for unknown keys or out-of-range limits, before any Ray process starts."""
    unknown = sorted(set(args) - {f.name for f in fields(ServeConfig)})
    if unknown:
        raise ValueError(f"unknown serve config keys: {', '.join(unknown)}")
    check_limits(args.get("limits") or {})
    for key, low in CONFIG_MINIMUMS.items():
        if args.get(key) is not None and int(args[key]) < low:
            raise ValueError(f"{key} must be >= {low} (got {args[key]})")


def app_args(args: dict[str, Any] | None) -> dict[str, Any]:
    """The replica's config: checked, with the key resolved here (the `RASD_API_KEY` of whoever builds the
    app applies, not only one the replica's own environment happens to hold) and threads filled in."""
    args = dict(args or {})
    check_config(args)
    args["api_key"] = resolve_api_key(args.get("api_key"))
    args.setdefault("threads", default_threads())
    return args


def check_limits(limits: dict[str, Any]) -> None:
    """ValueError for a limit name `Limits` does not have, or a value that is not a positive integer."""
    if not isinstance(limits, dict):
        raise ValueError("limits must be a mapping of limit names to positive integers")
    unknown = sorted(set(limits) - set(Limits.names()))
    if unknown:
        raise ValueError(f"unknown limits: {', '.join(unknown)} (known: {', '.join(Limits.names())})")
    for name, value in limits.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"limit {name} must be a positive integer (got {value!r})")


def build_app(args: dict[str, Any] | None = None) -> Any:
    """The Serve application for a config dict (`serve run serve_config.yaml` calls this with its `args`)."""
    args = app_args(args)
    threads = int(args["threads"])
    # the replica gets as many CPUs as it runs threads (Ray would otherwise pin it to one, OMP_NUM_THREADS=1);
    # with a verifier actor the replica only serves HTTP, and the actor sets its torch threads itself
    return RasdServer.options(ray_actor_options={"num_cpus": 0 if args.get("verifier_actor") else threads}
                              ).bind(args)


# ---------------------------------------------------------------------------------------------- CLI


def config_from_args(args: Any) -> dict[str, Any]:
    index = args.index
    if index == "sample":
        from rasd.apps.sample_corpus import ensure_sample_index

        index = str(ensure_sample_index(args.model))   # built here, once, not inside the replica
    return {"model": args.model, "index": index, "draft_model": args.draft_model, "device": args.device,
            "dtype": args.dtype, "graphs": not getattr(args, "no_graphs", False), "method": args.method,
            "docqa_method": args.docqa_method,
            "max_batch": args.max_batch, "prefill_chunk": getattr(args, "prefill_chunk", 0),
            "prefix_cache_mb": getattr(args, "prefix_cache_mb", 256),
            "max_waiting": args.max_waiting, "max_tokens_limit": args.max_tokens_limit,
            "api_key": _cli_api_key(args.api_key), "limits": _cli_limits(getattr(args, "limit", None)),
            "threads": args.threads or default_threads(),
            "retrieval_shards": getattr(args, "retrieval_shards", 0), **draft_worker_config(args),
            **verifier_config(args)}


def _cli_api_key(flag: str | None) -> str | None:
    """`--api-key`, else `RASD_API_KEY` of this shell: resolved here and passed in the config, so the key
    applies even when the replica runs on a Ray started elsewhere, with another environment."""
    from rasd.errors import CliError

    try:
        return resolve_api_key(flag)
    except ValueError as exc:
        raise CliError(str(exc)) from exc


def _cli_limits(pairs: list[str] | None) -> dict[str, int]:
    """`--limit NAME=VALUE` (repeatable) as the `limits` mapping; a one-line error for a malformed pair."""
    from rasd.errors import CliError

    limits: dict[str, int] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition("=")
        if not sep or not value.strip().isdigit():
            raise CliError(f"--limit takes NAME=INTEGER (got {pair!r}); names: {', '.join(Limits.names())}")
        limits[name.strip()] = int(value)
    return limits


def verifier_config(args: Any) -> dict[str, Any]:
    """`--verifier-actor`, `--verifier-gpus`, `--verifier-resources` as ServeConfig keys (either of the
    last two implies the first)."""
    resources = parse_resources(getattr(args, "verifier_resources", None), "--verifier-resources",
                                '{"rasd_verifier": 1}')
    gpus = getattr(args, "verifier_gpus", None)
    options: dict[str, Any] = {}
    if gpus is not None:
        from rasd.errors import CliError

        if gpus < 0:
            raise CliError("--verifier-gpus must be >= 0")
        options["num_gpus"] = gpus
    if resources:
        options["resources"] = resources
    return {"verifier_actor": bool(getattr(args, "verifier_actor", False) or options), "verifier_options": options}


def parse_resources(text: str | None, flag: str, example: str) -> dict[str, float] | None:
    """A JSON object of Ray custom resources from a CLI flag; a one-line CliError otherwise."""
    import json

    from rasd.errors import CliError

    if not text:
        return None
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CliError(f"{flag} is not JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise CliError(f"{flag} must be a JSON object, e.g. '{example}'")
    return parsed


def draft_worker_config(args: Any) -> dict[str, Any]:
    """The draft-worker keys of ServeConfig from `--draft-workers`, `--draft-worker-model/-resources`."""
    from rasd.errors import CliError

    workers = getattr(args, "draft_workers", 0) or 0
    if workers < 0:
        raise CliError("--draft-workers must be >= 0")
    worker_model = getattr(args, "draft_worker_model", None)
    if workers:
        from rasd.distributed.draft_worker import check_spec, worker_spec

        try:
            check_spec(worker_spec(worker_model, args.draft_model, args.model))
        except ValueError as exc:
            raise CliError(str(exc)) from exc
    config: dict[str, Any] = {"draft_workers": workers, "draft_worker_model": worker_model}
    parsed = parse_resources(getattr(args, "draft_worker_resources", None), "--draft-worker-resources",
                             '{"rasd_draft": 1}')
    if parsed:
        config["draft_worker_options"] = {"resources": parsed}
    return config


# Ray Serve's controller runs its control loop every 0.1 s by default: 3-4% of a core on an idle 2-core
# machine, taken from the decoding threads (whose OpenMP barriers then wait for the descheduled one). Measured
# here: the whole idle Ray + Serve background 5.3% -> 2.0% of the CPUs, 8 concurrent document-QA requests
# ≈ 4% faster. One second is ample for one app's health checks and restarts.
LOOPBACK = "127.0.0.1"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
QUIET_RAY_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1.0"}


def ray_env(ray_host: str | None = None, http_host: str = LOOPBACK, http_port: int = 8000) -> dict[str, str]:
    """The environment for a Ray this command starts: the quiet defaults, unless the user set them; with
    `ray_host` on loopback, the bind shim that keeps every port of that Ray there (`serve.loopback`), all
    but the HTTP port when the user asked the service itself to listen beyond this machine."""
    env = {**QUIET_RAY_ENV, **os.environ}
    if ray_host is not None and ray_host in LOOPBACK_HOSTS:
        env.update(loopback_env(None if http_host in LOOPBACK_HOSTS else http_port))
    return env


def run_serve(args: Any) -> int:
    import ray

    from rasd.errors import CliError

    if args.stop:
        return stop_detached()
    if args.index and args.index != "sample" and not os.path.isdir(args.index):
        raise CliError(f"index folder not found: {args.index}")
    config = config_from_args(args)
    try:
        check_config(config)
    except ValueError as exc:
        raise CliError(str(exc).replace("_", "-")) from exc
    ray_host = getattr(args, "ray_host", LOOPBACK)
    if args.detach and not args.address:
        ensure_local_cluster(ray_host, args.host, args.port)
        address: str | None = "auto"
    else:
        address = args.address
    if address is None:                      # ray.init starts the local Ray: it inherits this environment
        os.environ.update(ray_env(ray_host, args.host, args.port))
    if (address is None and ray_host in LOOPBACK_HOSTS) or (address == "auto" and is_single_machine()):
        single_machine_ray()                 # this driver's node address is 127.0.0.1, as the head's
    local = {"_node_ip_address": ray_host} if address is None else {}   # a Ray started here binds ray_host
    ray.init(address=address, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}, **local)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
    except ray.exceptions.RayError as exc:
        # Seen when the machine is saturated: Serve's HTTP proxy misses its readiness checks and is killed.
        raise CliError(f"Ray Serve did not come up ({type(exc).__name__}); if the machine is busy, retry when "
                       f"it is not (logs: /tmp/ray/session_latest/logs/serve/); stop leftovers with "
                       f"`rasd serve --stop`") from exc
    url = f"http://{args.host}:{args.port}"
    _warn_open(args.host, config["api_key"])
    print(f"rasd is serving {config['model']} at {url}  (OpenAI API under {url}/v1, docs at {url}/docs)", flush=True)
    if args.detach:
        print("detached: stop it with `rasd serve --stop` (or `make stop`)", flush=True)
        return 0
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("\nshutting down", file=sys.stderr)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def _warn_open(host: str, key: str | None) -> None:
    """Say whether a key protects the service, and warn when it listens beyond this machine without one."""
    if key is not None:
        print("API key required on every route but /healthz and the web page's files", flush=True)
    elif host not in LOOPBACK_HOSTS:
        print(f"warning: listening on {host} with no API key: anyone who can reach it can use the service "
              f"(set --api-key or RASD_API_KEY)", file=sys.stderr, flush=True)


def _ray_cli() -> str:
    """The `ray` command of this environment (the venv may not be on PATH)."""
    local = Path(sys.executable).parent / "ray"
    return str(local) if local.exists() else "ray"




def head_start_args(ray_host: str = LOOPBACK) -> list[str]:
    """`ray start` arguments of the local head `rasd serve` starts: its servers (GCS, raylet, object manager,
    workers) bind `ray_host`, by default this machine only; no dashboard; token auth stays Ray's default."""
    return ["start", "--head", f"--node-ip-address={ray_host}", "--include-dashboard=false",
            "--disable-usage-stats"]


def ensure_local_cluster(ray_host: str = LOOPBACK, http_host: str = LOOPBACK, http_port: int = 8000) -> None:
    """Start a local head node that outlives this process (a detached service needs one)."""
    probe = subprocess.run([_ray_cli(), "status"], capture_output=True, text=True)
    if probe.returncode == 0:
        return
    started = subprocess.run([_ray_cli(), *head_start_args(ray_host)], capture_output=True, text=True,
                             env=ray_env(ray_host, http_host, http_port))
    if started.returncode != 0:
        from rasd.errors import CliError

        raise CliError(f"could not start a local Ray cluster: {started.stderr.strip().splitlines()[-1:]}")


def stop_detached() -> int:
    import ray

    if is_single_machine():
        single_machine_ray()
    try:
        ray.init(address="auto", log_to_driver=False)
        serve.shutdown()
        ray.shutdown()
    except (ConnectionError, RuntimeError) as exc:
        print(f"no running service found ({exc})", file=sys.stderr)
    subprocess.run([_ray_cli(), "stop"], capture_output=True, text=True)
    print("stopped")
    return 0
