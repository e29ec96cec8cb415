"""The service's request logic, independent of Ray: validate, build a per-request decoder, stream events.

`Service` owns the target model, the index and one continuous-batching `Scheduler`: every running request
shares the target's forwards. All of its torch work (loading, warm-up, query and document embedding, each
request's decoder, the decoding steps) runs on one `ComputeThread` (see `rasd.decoding.runtime.compute` for why:
two threads running torch made every decoding step up to 1.5x slower). The Serve deployment (`serve.py`)
only maps HTTP onto these methods, so the logic can be tested and reused without an HTTP server.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from rasd.apps.docqa import Source, fit_sources, scope_proposer
from rasd.decoding.drafting.history import ResponseHistory
from rasd.decoding.model.kernels import install
from rasd.decoding.proposers import METHODS, RecyclingMatrix, method_spec
from rasd.decoding.proposers.recycling import matrix_path
from rasd.decoding.runtime.compute import ComputeThread
from rasd.decoding.runtime.engine import GenerationOutput, build_decoder, vocab_size
from rasd.decoding.runtime.prefix_cache import PrefixCache
from rasd.decoding.runtime.scheduler import STALL_S, Overloaded, Scheduler
from rasd.decoding.sizing.sizers import CostAwareSizer
from rasd.decoding.step.grammar import ll_tokenizer
from rasd.decoding.step.sampling import SamplingParams
from rasd.distributed.draft_worker import NAME_PREFIX, DraftPool, check_spec, worker_spec
from rasd.errors import ApiError
from rasd.serve.metrics import ServiceMetrics
from rasd.text import encode_chat, has_chat_template

log = logging.getLogger(__name__)
INGEST_LOCK_TIMEOUT_S = 60.0   # how long an ingest waits for another writer (CLI, another replica)
SAVE_RECYCLING_EVERY = 16   # finished requests between saves of the recycling matrix (2.3 MB, atomic)


@dataclass
class ServeConfig:
    """Everything a replica needs; plain values so that it travels through Ray and YAML unchanged."""

    model: str = "default"
    index: str | None = None              # an index folder (`rasd index build`), or None for no documents
    draft_model: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    graphs: bool = True                   # CUDA: verify in captured static shapes (False: eager forwards)
    method: str = "pld"                   # default for /v1/completions and /v1/chat/completions
    docqa_method: str = "rasd"            # default for /v1/docqa
    max_batch: int = 8                    # requests decoded together (one shared forward per step)
    prefill_chunk: int = 0                # > 0: a joining request is prefilled this many tokens per step
    prefix_cache_mb: int = 1024           # K/V of prompt prefixes kept for later requests (0: off)
    warm_methods: bool = True             # decode a few tokens of every method at start (`Service._warm_methods`)
    history_mb: int = 64                  # earlier answers kept as a drafting source (`history`; 0: off)
    max_waiting: int = 16                 # queued beyond the batch; more gets 429
    max_tokens_limit: int = 1024          # the largest max_tokens a request may ask for
    max_prompt_tokens: int | None = None  # default: the model's context minus room for one token
    limits: dict[str, int] = field(default_factory=dict)   # request size limits (`limits.Limits` names)
    retrieval_shards: int = 0             # > 0: the index is served by this many RetrievalShard actors
    draft_workers: int = 0                # > 0: `rasd` requests draft in this many DraftWorker actors
    draft_worker_model: str | None = None  # their model; default draft_model, else "eesd:<model>" (self-draft)
    draft_worker_options: dict[str, Any] = field(default_factory=dict)  # Ray actor options, e.g. resources
    draft_timeout_s: float = 2.0          # a draft call slower than this counts as "no draft"
    verifier_actor: bool = False          # decode in a TargetVerifier actor instead of the HTTP replica
    verifier_options: dict[str, Any] = field(default_factory=dict)  # its Ray options (num_gpus, resources)
    api_key: str | None = None
    threads: int | None = None            # torch threads in the replica (Ray sets OMP_NUM_THREADS=1)
    replicas: int = 1                     # model replicas behind the one endpoint (Serve's num_replicas)
    router: dict[str, Any] = field(default_factory=dict)  # prefix router options (`PrefixAffinityRouter`)
    served_model_name: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return self.served_model_name or ("rasd-" + self.model if self.model == "default" else self.model)


@dataclass
class TokenBlock:
    """A committed block as `Service.events(..., sourced=True)` hands it out."""

    tokens: list[int]
    sources: list[str]            # per token: "prefill", a draft source, or "bonus"
    plain_step_s: float | None    # one plain decoding step at the current context (measured cost curve)
    logprobs: list[Any] | None = None   # per token a `TokenLogprob`, when the request asked for them


@dataclass
class Prepared:
    """A validated request ready to decode."""

    prompt_ids: list[int]
    method: str
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    sources: list[Source] = field(default_factory=list)
    logprobs: int | None = None   # alternatives per token's log-probability; None: none asked for


class Service:
    """Target model + index + scheduler; request handling shared by every HTTP endpoint."""

    def __init__(self, config: ServeConfig, decode_only: bool = False):
        """`config.verifier_actor`: decoding runs in a `TargetVerifier` actor and this object keeps HTTP-side
        work (validation, search, ingest). `decode_only`: this object *is* that actor's service."""
        from rasd.decoding.model.loading import load_model

        self.config = config
        self.compute = ComputeThread(config.threads)
        self.target = self.compute.run(load_model, config.model, device=config.device, dtype=config.dtype,
                                       graphs=config.graphs)
        self._index_stamp = manifest_stamp(config.index)
        self.index = self.compute.run(self._open_index, config.index) if config.index else None
        self._ingest_lock = threading.Lock()
        self._reopen_lock = threading.Lock()
        self._warm: dict[str, dict[str, Any]] = {}   # method -> what the last finished request's sizer learned
        self._finished = 0
        self.verifier: Any = None
        self.draft = self.drafts = self.scheduler = self.recycling = self.history = None
        if config.verifier_actor:
            from rasd.distributed.verifier import RemoteVerifier

            self.verifier = RemoteVerifier(config, Service)
        else:
            self.compute.run(self._start_decoding)
        self.metrics = ServiceMetrics(self.load)
        self.compute.run(self._warm_up, search=not decode_only, forward=self.verifier is None)
        self.started = time.time()

    def _start_decoding(self) -> None:
        """Draft model, draft workers, recycling matrix and the scheduler: what decodes requests here."""
        from rasd.decoding.model.loading import load_draft

        config = self.config
        self.draft = load_draft(config.draft_model, self.target)
        self.drafts = self._start_draft_workers() if config.draft_workers > 0 else None
        prefix = PrefixCache(config.prefix_cache_mb << 20) if config.prefix_cache_mb > 0 else None
        self.scheduler = Scheduler(self.target.model, max_batch=config.max_batch, max_waiting=config.max_waiting,
                                   compute=self.compute, prefill_chunk=config.prefill_chunk, prefix_cache=prefix,
                                   step=self.target.step)
        # Token Recycling's matrix is shared by every request (hot start) and outlives the process on disk.
        self.recycling_path = matrix_path(self.target.name)
        self.recycling = RecyclingMatrix.load_or_new(self.recycling_path, vocab_size(self.target.model))
        # One history per service, so per index: answers drafted from it were written over these documents.
        self.history = ResponseHistory(max_mb=config.history_mb) if config.history_mb > 0 else None

    def _warm_up(self, search: bool, forward: bool) -> None:
        """Load the query embedder and run the target once before the first request.

        A fresh process pays for its first forward (allocator, kernel selection) and, lazily, for loading
        the embedder: without this the first requests after a start are a second or more slower each. The
        skinny-product forms (`kernels.install`, about a second of timings) are chosen here too, not inside
        the first request's decoder.
        """
        if search and self.index is not None:
            self._search("warm up", 1)
        if forward:
            install(self.target.model)
            with torch.inference_mode():
                ids = torch.tensor([self.encode_text("Warm up.")], device=self.target.model.device)
                self.target.model(input_ids=ids)
            if self.scheduler is not None and self.config.warm_methods:
                self._warm_methods()

    def _warm_methods(self) -> None:
        """A few tokens of every method this service can run, at a chat-sized and a document-QA-sized prompt,
        so no request pays a method's first-time set-up (the cost curves of those context lengths, measured
        once per machine and cached; datastores; the recycling matrix; kernels)."""
        chat = (self.encode_chat([{"role": "user", "content": "Say hello."}])
                if has_chat_template(self.target.tokenizer) else self.encode_text("Say hello."))
        docqa = self.docqa_prompt("How do I use this?", 4, 16)[0] if self.index is not None else None
        for method in METHODS:
            try:
                method_spec(method).check(self.config.model, self.config.draft_model,
                                          has_index=self.index is not None)
            except ValueError:
                continue                       # refused with a 400 anyway (untrained, no draft model)
            long = method == self.config.docqa_method and docqa is not None
            for ids in [chat, docqa] if long else [chat]:
                prepared = Prepared(ids, method, 4, SamplingParams(), [])
                stream = self._stream_for(prepared, warm=True)
                for _ in stream:
                    pass
                finish_draft(stream)

    def check_capacity(self) -> None:
        """429 before a request costs any work (tokenizing, vector search, building its decoder) when the
        local scheduler is already full. A request that passes may still meet a full scheduler at submit
        (others got there first): that too is a 429 (`events`). With a verifier actor the actor decides."""
        if self.verifier is not None:
            return
        running, waiting = self.scheduler.load()
        capacity = self.scheduler.max_batch + self.scheduler.max_waiting
        if running + waiting >= capacity:
            raise ApiError(429, f"the service is at capacity: {running} running, {waiting} waiting "
                                f"(batch {self.scheduler.max_batch} + queue {self.scheduler.max_waiting}); "
                                "retry later", "rate_limit_error")

    def load(self) -> tuple[int, int]:
        """(running, waiting) requests, wherever they decode."""
        return self.verifier.load() if self.verifier is not None else self.scheduler.load()

    def healthy(self) -> bool:
        """False when the local scheduler thread has died or is stuck with work waiting (a verifier actor is
        restarted by Ray itself)."""
        return not self.health_problem()

    def health_problem(self) -> str | None:
        """Why the service is unhealthy, or None."""
        if not self.compute.is_alive():
            return "the compute thread is not running"
        if self.scheduler is not None and self.scheduler.stalled():
            return f"requests are waiting and no decoding step finished for {STALL_S:g} s"
        return None

    def reopen_index(self) -> None:
        """Serve the latest committed index state (after another process added documents)."""
        if self.config.index:
            stamp = manifest_stamp(self.config.index)
            self.index = self.compute.run(self._open_index, self.config.index)
            self._index_stamp = stamp

    def fresh_index(self) -> Any:
        """The index as any writer last committed it (a CLI `add` / `compact`, another replica): reopened
        when its manifest changed since it was opened, so a request never serves a stale state. The old
        Index object stays valid for requests already using it (its files are memory-mapped)."""
        if self.index is not None and manifest_stamp(self.config.index) != self._index_stamp:
            # never blocking: an ingest in progress waits on the compute thread, which may be the caller
            if self._reopen_lock.acquire(blocking=False):
                try:
                    if manifest_stamp(self.config.index) != self._index_stamp:
                        self.reopen_index()
                finally:
                    self._reopen_lock.release()
        return self.index

    def _open_index(self, path: str) -> Any:
        from rasd.index.store import Index, check_tokenizer

        if self.config.retrieval_shards > 0:
            from rasd.distributed.retrieval import ShardedIndex

            index: Any = ShardedIndex(path, self.config.retrieval_shards)
        else:
            index = Index.open(path)
        check_tokenizer(index.manifest, self.target)
        return index

    def draft_worker_spec(self) -> str:
        """What the draft workers load: the configured model, the draft model, else the EESD self-draft."""
        return worker_spec(self.config.draft_worker_model, self.config.draft_model, self.config.model)

    def _start_draft_workers(self) -> DraftPool:
        """Named `rasd-draft-<i>` actors in namespace `rasd` (see rasd/distributed/draft_worker.py)."""
        spec = self.draft_worker_spec()
        check_spec(spec)
        # one pool per replica: with several, each names its workers apart (rasd-draft-<tag>-<i>)
        prefix = NAME_PREFIX if self.config.replicas <= 1 else f"{NAME_PREFIX}-{uuid.uuid4().hex[:6]}"
        return DraftPool(spec, self.config.draft_workers, self.config.draft_worker_options,
                         device=self.config.device, dtype=self.config.dtype, timeout_s=self.config.draft_timeout_s,
                         name_prefix=prefix)

    # ------------------------------------------------------------------ validation
    def check_model(self, name: str | None) -> None:
        if name and name not in (self.config.model_name, self.config.model):
            raise ApiError(404, f"model {name!r} is not served here; this service serves "
                                f"{self.config.model_name!r}", "not_found_error", "model")

    def check_method(self, method: str) -> None:
        """400 before any work when the method is unknown or lacks what it needs (an index, a draft model,
        trained weights under $RASD_HOME): its `MethodSpec` says what that is."""
        try:
            method_spec(method).check(self.config.model, self.config.draft_model, has_index=self.index is not None)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="method") from exc

    def prompt_limit(self) -> int:
        return self.config.max_prompt_tokens or self.target.max_context - 1

    def prepare(self, req: Any, prompt_ids: list[int], default_method: str, default_max: int | None,
                sources: list[Source] | None = None) -> Prepared:
        """Check a request's limits and sampling fields; raises ApiError with the field at fault."""
        method = req.method or default_method
        self.check_method(method)
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if len(prompt_ids) > self.prompt_limit():
            raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens; the limit is {self.prompt_limit()}",
                           param="prompt")
        room = self.target.max_context - len(prompt_ids)
        max_tokens = req.token_limit() or default_max or min(self.config.max_tokens_limit, room)
        if max_tokens > self.config.max_tokens_limit:
            raise ApiError(400, f"max_tokens {max_tokens} exceeds this service's limit "
                                f"{self.config.max_tokens_limit}", param="max_tokens")
        if max_tokens > room:
            raise ApiError(400, f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                                f"model's context of {self.target.max_context}", param="max_tokens")
        grammar = req.grammar()
        if grammar is not None:
            try:
                ll_tokenizer(self.target.tokenizer, vocab_size(self.target.model))
            except ValueError as exc:
                raise ApiError(400, str(exc), param="response_format") from exc
        sampling = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
                                  repetition_penalty=req.repetition_penalty, frequency_penalty=req.frequency_penalty,
                                  presence_penalty=req.presence_penalty,
                                  logit_bias=req.logit_bias_pairs(vocab_size(self.target.model)),
                                  grammar=grammar)
        return Prepared(prompt_ids, method, max_tokens, sampling, req.stop_list(), sources or [], req.logprobs_k())

    # ------------------------------------------------------------------ prompts
    def encode_text(self, text: str) -> list[int]:
        return [int(t) for t in self.target.tokenizer(text)["input_ids"]]

    def check_token_ids(self, ids: list[int]) -> list[int]:
        """A prompt sent as token ids, each a token of this model (else a 400 naming the first that is not)."""
        vocab = vocab_size(self.target.model)
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"prompt token {bad} ({ids[bad]}) is not a token id of this model (0..{vocab - 1})",
                           param=f"prompt.{bad}")
        return ids

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if not has_chat_template(self.target.tokenizer):
            raise ApiError(400, "this model has no chat template; use /v1/completions", param="messages")
        return encode_chat(self.target.tokenizer, messages)

    def _search(self, question: str, top_k: int) -> list[Any]:
        """Vector search; a retrieval shard that is down (and not back in time) is a 503, not a crash."""
        try:
            return self.compute.run(self.index.search, question, k=top_k)
        except Exception as exc:       # Ray's actor errors when the index is sharded
            if type(exc).__module__.startswith("ray"):
                raise ApiError(503, f"the retrieval index is unavailable: {type(exc).__name__}",
                               "service_unavailable") from exc
            raise

    def docqa_prompt(self, question: str, top_k: int, max_tokens: int | None) -> tuple[list[int], list[Source]]:
        if self.index is None:
            raise ApiError(400, "this service has no index; start it with --index", param="question")
        if not question.strip():
            raise ApiError(400, "the question is empty", param="question")
        self.fresh_index()
        hits = self._search(question, top_k)
        sources = [Source.from_hit(h) for h in hits]
        budget = self.target.max_context - (max_tokens or 256) - 1
        try:
            return fit_sources(self.target.tokenizer, question, sources, min(budget, self.prompt_limit()))
        except ValueError as exc:
            raise ApiError(400, str(exc), param="question") from exc

    # ------------------------------------------------------------------ decoding
    def _stream_for(self, p: Prepared, warm: bool = False) -> Any:
        spec = method_spec(p.method)
        index = self.fresh_index() if spec.uses_index else self.index
        datastores = index.datastores() if (index is not None and spec.uses_index) else None
        extra = {"datastores": datastores} if datastores is not None else {}
        if spec.uses_recycling:
            extra["recycling"] = self.recycling
        if spec.uses_history:          # the warm-up's answers go to a throwaway store, not the shared one
            extra["history"] = ResponseHistory(max_mb=1) if warm or self.history is None else self.history
        draft = self.draft
        if spec.remote_draft and self.drafts is not None:   # the draft runs in a worker, not here
            extra["draft_proposer"], draft = self.drafts.remote_draft(), None
        heartbeat = None if self.scheduler is None else self.scheduler.beat
        decoder = build_decoder(self.target, p.method, draft=draft, heartbeat=heartbeat, **extra)
        warm_start(decoder.sizer, self._warm.get(p.method))
        if p.sources and self.index is not None and spec.uses_index:   # only those draft from documents
            scope_proposer(decoder.proposer, self.index, p.sources)
        return decoder.stream(p.prompt_ids, p.max_tokens, p.sampling, self.target.eos_token_ids, p.stop,
                              logprobs=p.logprobs)

    async def events(self, p: Prepared, sourced: bool = False) -> AsyncIterator[tuple[str, Any]]:
        """("tokens", block)... then ("done", GenerationOutput); the request leaves the batch if abandoned.

        With `sourced`, or when the request asked for log-probabilities, each block comes as a `TokenBlock`
        carrying every token's source (and log-probability).
        """
        if self.verifier is not None:
            async for event in self.verifier.events(p, sourced):
                yield event
            return
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def sink(kind: str, payload: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, payload))

        stream = await self.compute.acall(self._stream_for, p)
        try:
            ticket = self.scheduler.submit(stream, sink)
        except Overloaded as exc:
            finish_draft(stream)
            raise ApiError(429, f"the service is at capacity: {exc}", "rate_limit_error") from exc
        except ValueError as exc:
            finish_draft(stream)
            raise ApiError(400, str(exc)) from exc
        finished, seen = False, 0
        try:
            while True:
                kind, payload = await queue.get()
                if kind == "error":
                    finished = True
                    raise ApiError(500, f"decoding failed: {payload}", "server_error")
                finished = kind == "done"
                if finished:
                    self._warm[p.method] = sizer_state(stream.decoder.sizer)
                    self._finished += 1
                    if self._finished % SAVE_RECYCLING_EVERY == 0:
                        await asyncio.to_thread(self.save_recycling_quietly)
                if (sourced or p.logprobs is not None) and kind == "tokens":
                    # token_sources only grows, and a block's sources are appended before it is handed out
                    part = slice(seen, seen + len(payload))
                    sources = stream.token_sources[part]
                    logprobs = None if stream.token_logprobs is None else stream.token_logprobs[part]
                    seen += len(payload)
                    payload = TokenBlock(list(payload), sources, stream.plain_step_s, logprobs)
                yield kind, payload
                if finished:
                    return
        finally:
            if not finished:
                self.scheduler.cancel(ticket)
            finish_draft(stream)

    def save_recycling(self) -> None:
        """Persist the recycling matrix (atomic: a crash mid-save keeps the previous file)."""
        self.recycling.save(self.recycling_path)

    def save_recycling_quietly(self) -> None:
        """`save_recycling` during a request: a full disk or a read-only home is a warning, never a failed
        request (the matrix lives on in memory; the previous file stays as it was)."""
        try:
            self.save_recycling()
        except Exception as exc:   # noqa: BLE001 - whatever the filesystem says, the answer was already made
            log.warning("could not save the recycling matrix to %s (%s: %s)", self.recycling_path,
                        type(exc).__name__, exc)

    @staticmethod
    def choices(p: Prepared, n: int) -> list[Prepared]:
        """`n` copies of a request, one per choice: each its own row of the batch and its own seed (seed + i
        when one was given, so a seeded request with n > 1 is reproducible and its choices differ)."""
        seed = p.sampling.seed
        return [p if i == 0 else replace(p, sampling=replace(p.sampling, seed=None if seed is None else seed + i))
                for i in range(n)]

    async def run(self, p: Prepared) -> GenerationOutput:
        """Decode to completion (non-streaming requests)."""
        async for kind, payload in self.events(p):
            if kind == "done":
                return payload
        raise ApiError(500, "decoding ended without a result", "server_error")

    def info(self) -> dict[str, Any]:
        """What the web page shows about this service."""
        index = self.index
        return {"model": self.config.model_name, "method": self.config.method,
                "docqa_method": self.config.docqa_method, "methods": list(METHODS),
                "max_tokens_limit": self.config.max_tokens_limit,
                "index": None if index is None else {"num_documents": index.num_documents,
                                                     "num_chunks": index.num_chunks},
                "draft_workers": self.draft_stats(),
                "verifier": None if self.verifier is None else self.verifier.name}

    def draft_stats(self) -> dict[str, Any] | None:
        """The draft workers' counters wherever they run (in the verifier actor, or here); None without any."""
        if self.verifier is not None:
            return self.verifier.info()["draft_workers"]
        return None if self.drafts is None else self.drafts.stats()

    # ------------------------------------------------------------------ documents
    def add_documents(self, docs: list[dict[str, Any]], idempotency_key: str | None = None) -> dict[str, Any]:
        """Append documents as a new index segment (durable when this returns), then serve from it.

        Called on a worker thread, never the compute thread: tokenizing, chunking, suffix arrays and the
        segment's files happen here, beside decoding; only the embedding (torch) goes to the compute thread, as
        background slices of about EMBED_SLICE_S that yield to decoding steps, so running streams keep getting
        tokens at no less than half their rate. Another writer
        holding the index's lock for over INGEST_LOCK_TIMEOUT_S is a 503, not a request that never ends.

        `idempotency_key` (the `Idempotency-Key` header): the batch is added once however often it is sent, by
        whichever replica or process (the key is recorded in the index's manifest with the segment); a replay
        answers what the first attempt added, with `"replayed": true`; the key with another body is a 422.
        """
        from rasd.fsio import LockTimeout
        from rasd.index.documents import Document
        from rasd.index.writer import add_documents

        if self.index is None:
            raise ApiError(400, "this service has no index; start it with --index", param="documents")
        documents = [Document(text=d["text"], title=d.get("title", ""), source=d.get("source", ""),
                              external_id=d.get("id")) for d in docs]
        claim = None if idempotency_key is None else idempotency_claim(idempotency_key, docs)
        with self._ingest_lock:
            before = self.index.num_documents
            if claim is not None and (replay := self._replay(claim)) is not None:
                return replay
            try:
                index = add_documents(self.index.root, documents, model=self.config.model,
                                      run_torch=self.compute.run_background, lock_timeout_s=INGEST_LOCK_TIMEOUT_S,
                                      idempotency=claim)
            except LockTimeout as exc:
                raise ApiError(503, str(exc), "service_unavailable") from exc
            if claim is not None and (replay := self._replay(claim)) is not None:
                return replay                        # another process committed this key while we embedded
            if hasattr(self.index, "refresh"):      # sharded: the shards reopen the new committed state
                self.index.refresh()
                index = self.index
            self.index, self._index_stamp = index, manifest_stamp(self.config.index)
            if self.verifier is not None:           # its token datastores must include the new segment
                self.verifier.refresh_index()
        return {"added": index.num_documents - before, "num_documents": index.num_documents,
                "num_chunks": index.num_chunks}

    def _replay(self, claim: dict[str, str]) -> dict[str, Any] | None:
        """The answer to an already committed idempotency key (None: not committed, or committed by us now)."""
        from rasd.index.store import Index
        from rasd.index.writer import idempotency_record

        record = idempotency_record(self.index.root, claim["key"])
        if record is None or record["nonce"] == claim["nonce"]:
            return None
        if record["body"] != claim["body"]:
            raise ApiError(422, "this Idempotency-Key was used with other documents", param="Idempotency-Key")
        index = Index.open(self.index.root)
        return {"added": record["added"], "num_documents": index.num_documents, "num_chunks": index.num_chunks,
                "replayed": True}

    def close(self) -> None:
        """Replica shutdown: stop the scheduler, keep what was recycled for the next start."""
        if self.verifier is not None:
            self.verifier.close()
            self.compute.close()
            return
        self.scheduler.close()
        self.compute.close()
        if self.drafts is not None:
            self.drafts.close()
        self.save_recycling_quietly()   # a read-only home must not turn a clean shutdown into a crash


def idempotency_claim(key: str, docs: list[dict[str, Any]]) -> dict[str, str]:
    """What a write with this key records: hashes of the key and of the documents, and a nonce of this attempt."""
    import hashlib
    import json
    import secrets

    body = hashlib.sha256(json.dumps(docs, sort_keys=True, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    return {"key": hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest(), "body": body.hexdigest(),
            "nonce": secrets.token_hex(8)}


def manifest_stamp(index: str | None) -> tuple[int, int, int] | None:
    """What changes when any writer commits the index (an atomic rename of its manifest): inode, size, mtime."""
    if not index:
        return None
    try:
        st = os.stat(os.path.join(index, "manifest.json"))
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def finish_draft(stream: Any) -> None:
    """Free a finished request's draft state on its draft worker (a no-op for in-process drafts)."""
    stream.decoder.proposer.finish()


def default_threads(replicas: int = 1) -> int:
    """The node's cores shared by its replicas: one replica decodes for everyone (batching), so it should
    use them all; several split them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, replicas))


def sizer_state(sizer: Any) -> dict[str, Any]:
    """What a cost-aware sizer learned in one request (acceptance posteriors, latencies, overhead)."""
    if not isinstance(sizer, CostAwareSizer):
        return {}
    return {"counts": copy.deepcopy(sizer.estimator.counts), "observed": dict(sizer.observed),
            "observed_all": sizer.observed_all, "overhead_s": sizer.overhead_s}


def warm_start(sizer: Any, state: dict[str, Any] | None) -> None:
    """Start a request's sizer from the last finished request's state instead of the prior.

    Why: a fresh sizer spends its first steps trying trees the previous request already learned not to
    try (one request alone through the service ran at 0.91x HF end to end with cold sizers). Only the
    decoding speed depends on it; the output never does.
    """
    if state and isinstance(sizer, CostAwareSizer):
        sizer.estimator.counts = copy.deepcopy(state["counts"])
        sizer.observed = dict(state["observed"])
        sizer.observed_all = state.get("observed_all")
        sizer.overhead_s = state["overhead_s"]
