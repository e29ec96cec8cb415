"""Where requests decode: one interface (`DecodingBackend`), two places (this process, or a verifier actor).

`Service` (serve/service.py) validates, searches and ingests; every validated request goes to its one
back-end, which it never asks about. `LocalBackend` decodes here: the continuous-batching `Scheduler` on the
service's `ComputeThread`, with what drafting shares across requests (recycling matrix, response history,
draft workers, the sizers' warm state). `RemoteBackend` (distributed/verifier.py) runs a `LocalBackend` in a
`TargetVerifier` Ray actor: the same code decodes either way, so the tokens are the same. The shape follows
Ray Serve LLM's `LLMEngine` (start, stream a request, load, health, stats, close).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch

from rasd.decoding.drafting.history import ResponseHistory
from rasd.decoding.model.kernels import install
from rasd.decoding.proposers import METHODS, RecyclingMatrix, method_spec
from rasd.decoding.proposers.recycling import matrix_path
from rasd.decoding.runtime.compute import ComputeThread
from rasd.decoding.runtime.engine import build_decoder, vocab_size
from rasd.decoding.runtime.prefix_cache import PrefixCache
from rasd.decoding.runtime.scheduler import STALL_S, Overloaded, Scheduler
from rasd.decoding.sizing.protocol import Sizer
from rasd.decoding.step.sampling import SamplingParams
from rasd.distributed.draft_worker import NAME_PREFIX, DraftPool, check_spec, worker_spec
from rasd.errors import ApiError

log = logging.getLogger(__name__)
SAVE_RECYCLING_EVERY = 16   # finished requests between saves of the recycling matrix (2.3 MB, atomic)


@dataclass
class Prepared:
    """A validated request ready to decode (plain values: it travels to a verifier actor)."""

    prompt_ids: list[int]
    method: str
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    sources: list[Any] = field(default_factory=list)   # `rasd.apps.docqa.Source`s: they scope retrieval
    logprobs: int | None = None   # alternatives per token's log-probability; None: none asked for
    repetition: int = 0           # the repetition stop's window (`runtime.repetition`); 0: off


@dataclass
class TokenBlock:
    """A committed block as `events(..., sourced=True)` hands it out."""

    tokens: list[int]
    sources: list[str]            # per token: "prefill", a draft source, or "bonus"
    plain_step_s: float | None    # one plain decoding step at the current context (measured cost curve)
    logprobs: list[Any] | None = None   # per token a `TokenLogprob`, when the request asked for them
    # the sources of the tokens the verification step behind this block committed (None for the first token):
    # more than `sources` when some are held back as a possible repetition (`runtime.repetition`)
    step: list[str] | None = None


@dataclass
class DecodingSettings:
    """What decoding needs from the service's configuration, and nothing of HTTP: a verifier actor is
    started from these (the names are `ServeConfig`'s)."""

    model: str = "default"
    index: str | None = None              # the index folder whose token datastores the retrieval methods read
    draft_model: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    graphs: bool = True
    threads: int | None = None
    docqa_method: str = "rasd"            # warmed up at a document-QA-sized prompt too
    max_batch: int = 8
    max_waiting: int = 16
    prefill_chunk: int = 0
    prefix_cache_mb: int = 1024
    history_mb: int = 64
    draft_workers: int = 0
    draft_worker_model: str | None = None
    draft_worker_options: dict[str, Any] = field(default_factory=dict)
    draft_timeout_s: float = 2.0
    replicas: int = 1                     # with several, each replica names its draft workers apart

    def draft_worker_spec(self) -> str:
        """What the draft workers load: the configured model, the draft model, else the EESD self-draft."""
        return worker_spec(self.draft_worker_model, self.draft_model, self.model)


@dataclass
class WarmUp:
    """Prompts a back-end decodes a few tokens of at start, so that no request pays a method's first-time
    set-up. None: no method warm-up (`chat`), no document-QA-sized prompt (`docqa`)."""

    chat: list[int] | None = None
    docqa: list[int] | None = None


class DecodingBackend(ABC):
    """What a service needs from whatever decodes its requests. Every method but `start` and `events` is
    cheap and safe to call from any thread; none of them raises because the back-end is restarting."""

    @property
    @abstractmethod
    def name(self) -> str | None:
        """Where requests decode, for /v1/info and /healthz: None in this process, else the actor's name."""

    @property
    @abstractmethod
    def threads(self) -> int | None:
        """Torch threads decoding in this process (None: decoding runs in another)."""

    @abstractmethod
    def start(self, warm: WarmUp) -> None:
        """Load what decodes (draft model, scheduler, ...) and warm it up; ready for requests on return."""

    @abstractmethod
    def events(self, p: Prepared, sourced: bool = False) -> AsyncIterator[tuple[str, Any]]:
        """("tokens", block)... then ("done", GenerationOutput); the request leaves the batch when the caller
        stops iterating (that is cancelling). Raises ApiError (429 full, 400 refused, 500/503 failed).

        With `sourced`, or when the request asked for log-probabilities, each block is a `TokenBlock`."""

    @abstractmethod
    def check_capacity(self) -> None:
        """ApiError 429 when no request could join now, before a request costs any work."""

    @abstractmethod
    def load(self) -> tuple[int, int]:
        """(running, waiting) requests."""

    @abstractmethod
    def health_problem(self) -> str | None:
        """Why decoding is stuck so that restarting this process would help, or None."""

    def unavailable(self) -> str | None:
        """Why requests cannot be decoded now though this process is fine (a verifier actor that hangs): /healthz
        reports it, Serve's restart does not cure it. Default: never."""
        return None

    @abstractmethod
    def add_segments(self) -> None:
        """This service committed documents to the index: decode against the new segments' datastores too."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters for /v1/info: at least "draft_workers" (their stats, or None without any)."""

    @abstractmethod
    def close(self) -> None:
        """Stop decoding and keep what outlives the process (the recycling matrix)."""


class IndexHolder:
    """The index a process serves, reopened when any writer (a CLI `add` / `compact`, another replica, this
    service's ingest) committed a new state, so a request never serves a stale one. An Index object stays
    valid for requests already using it (its files are memory-mapped)."""

    def __init__(self, path: str | None, target: Any, compute: ComputeThread, shards: int = 0):
        self.path, self.target, self.compute, self.shards = path, target, compute, shards
        self._reopen_lock = threading.Lock()
        self.stamp: Any = None
        self.index: Any = None
        if path:
            self.replace(compute.run(self._open))

    def _open(self) -> Any:
        from rasd.index.store import Index, check_tokenizer

        if self.shards > 0:
            from rasd.distributed.retrieval import ShardedIndex

            index: Any = ShardedIndex(self.path, self.shards)
        else:
            index = Index.open(self.path)
        check_tokenizer(index.manifest, self.target)
        return index

    def reopen(self) -> None:
        """Serve the latest committed state."""
        if self.path:
            self.replace(self.compute.run(self._open))

    def fresh(self) -> Any:
        """The index as any writer last committed it: reopened when its manifest changed since it was opened."""
        from rasd.index.manifest import stamp_changed

        if self.index is not None and stamp_changed(self.path, self.stamp):
            # never blocking: an ingest in progress waits on the compute thread, which may be the caller
            if self._reopen_lock.acquire(blocking=False):
                try:
                    if stamp_changed(self.path, self.stamp):
                        self.reopen()
                finally:
                    self._reopen_lock.release()
        return self.index

    def replace(self, index: Any) -> None:
        """Serve `index` (this process's own ingest, or a reopen), stamped with the manifest it was opened from:
        never the manifest on disk now, which another writer may have committed after that read, and which this
        replica would then never notice (an index without a stamp is reopened at the next request)."""
        self.index, self.stamp = index, getattr(index, "stamp", None)


class LocalBackend(DecodingBackend):
    """Decoding in this process: one `Scheduler` batches every request into shared target forwards, all of
    its torch work on `compute` (the service's thread: see `rasd.decoding.runtime.compute` for why one)."""

    def __init__(self, settings: DecodingSettings, target: Any, compute: ComputeThread, indexes: IndexHolder):
        self.settings, self.target, self.compute, self.indexes = settings, target, compute, indexes
        self.draft: Any = None
        self.drafts: DraftPool | None = None
        self.scheduler: Scheduler | None = None
        self.recycling: RecyclingMatrix | None = None
        self.history: ResponseHistory | None = None
        self.recycling_path = matrix_path(target.name)
        self._warm: dict[str, dict[str, Any]] = {}   # method -> what the last finished request's sizer learned
        self._finished = 0

    @property
    def name(self) -> str | None:
        return None

    @property
    def threads(self) -> int | None:
        return self.scheduler.loop_threads

    def start(self, warm: WarmUp) -> None:
        self.compute.run(self._start_decoding)
        self.compute.run(self._warm_up, warm)

    def _start_decoding(self) -> None:
        """Draft model, draft workers, recycling matrix and the scheduler: what decodes requests here."""
        from rasd.decoding.model.loading import load_draft

        s = self.settings
        self.draft = load_draft(s.draft_model, self.target)
        self.drafts = self._start_draft_workers() if s.draft_workers > 0 else None
        prefix = PrefixCache(s.prefix_cache_mb << 20) if s.prefix_cache_mb > 0 else None
        self.scheduler = Scheduler(self.target.model, max_batch=s.max_batch, max_waiting=s.max_waiting,
                                   compute=self.compute, prefill_chunk=s.prefill_chunk, prefix_cache=prefix,
                                   step=self.target.step)
        # Token Recycling's matrix is shared by every request (hot start) and outlives the process on disk.
        self.recycling = RecyclingMatrix.load_or_new(self.recycling_path, vocab_size(self.target.model))
        # One history per service, so per index: answers drafted from it were written over these documents.
        self.history = ResponseHistory(max_mb=s.history_mb) if s.history_mb > 0 else None

    def _start_draft_workers(self) -> DraftPool:
        """Named `rasd-draft-<i>` actors in namespace `rasd` (see rasd/distributed/draft_worker.py)."""
        s = self.settings
        spec = s.draft_worker_spec()
        check_spec(spec)
        # one pool per replica: with several, each names its workers apart (rasd-draft-<tag>-<i>)
        prefix = NAME_PREFIX if s.replicas <= 1 else f"{NAME_PREFIX}-{uuid.uuid4().hex[:6]}"
        return DraftPool(spec, s.draft_workers, s.draft_worker_options, device=s.device, dtype=s.dtype,
                         timeout_s=s.draft_timeout_s, name_prefix=prefix)

    def _warm_up(self, warm: WarmUp) -> None:
        """Run the target once before the first request, then a few tokens of every method.

        A fresh process pays for its first forward (allocator, kernel selection): without this the first
        requests after a start are a second or more slower each. The skinny-product forms
        (`kernels.install`, about a second of timings) are chosen here too, not inside the first request's
        decoder.
        """
        install(self.target.model)
        with torch.inference_mode():
            ids = torch.tensor([[int(t) for t in self.target.tokenizer("Warm up.")["input_ids"]]],
                               device=self.target.model.device)
            self.target.model(input_ids=ids)
        if warm.chat is not None:
            self._warm_methods(warm.chat, warm.docqa)

    def _warm_methods(self, chat: list[int], docqa: list[int] | None) -> None:
        """A few tokens of every method this back-end can run, at a chat-sized and (the document-QA method) a
        document-QA-sized prompt, so no request pays a method's first-time set-up (the cost curves of those
        context lengths, measured once per machine and cached; datastores; the recycling matrix; kernels)."""
        s = self.settings
        for method in METHODS:
            try:
                method_spec(method).check(s.model, s.draft_model, has_index=self.indexes.index is not None)
            except ValueError:
                continue                       # refused with a 400 anyway (untrained, no draft model)
            long = method == s.docqa_method and docqa is not None
            for ids in [chat, docqa] if long else [chat]:
                stream = self.stream_for(Prepared(ids, method, 4, SamplingParams(), []), warm=True)
                for _ in stream:
                    pass
                finish_draft(stream)

    def stream_for(self, p: Prepared, warm: bool = False) -> Any:
        """The request's decoder stream (call on the compute thread): its method's decoder over the shared
        stores, its sizer started from the last finished request's."""
        spec = method_spec(p.method)
        index = self.indexes.fresh() if spec.uses_index else self.indexes.index
        datastores = index.datastores() if (index is not None and spec.uses_index) else None
        extra: dict[str, Any] = {"datastores": datastores} if datastores is not None else {}
        if spec.uses_recycling:
            extra["recycling"] = self.recycling
        if spec.uses_history:          # the warm-up's answers go to a throwaway store, not the shared one
            extra["history"] = ResponseHistory(max_mb=1) if warm or self.history is None else self.history
        draft = self.draft
        if spec.remote_draft and self.drafts is not None:   # the draft runs in a worker, not here
            extra["draft_proposer"], draft = self.drafts.remote_draft(), None
        decoder = build_decoder(self.target, p.method, draft=draft, heartbeat=self.scheduler.beat, **extra)
        warm_start(decoder.sizer, self._warm.get(p.method))
        if p.sources and index is not None and spec.uses_index:   # only those draft from documents
            decoder.proposer.scope(index.source_tokens(p.sources))
        return decoder.stream(p.prompt_ids, p.max_tokens, p.sampling, self.target.eos_token_ids, p.stop,
                              logprobs=p.logprobs, repetition=p.repetition)

    async def events(self, p: Prepared, sourced: bool = False) -> AsyncIterator[tuple[str, Any]]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def sink(kind: str, payload: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, payload))

        stream = await self.compute.acall(self.stream_for, p)
        try:
            ticket = self.scheduler.submit(stream, sink)
        except Overloaded as exc:
            finish_draft(stream)
            raise ApiError(429, f"the service is at capacity: {exc}", "rate_limit_error") from exc
        except ValueError as exc:
            finish_draft(stream)
            raise ApiError(400, str(exc)) from exc
        finished, seen, steps = False, 0, -1   # steps: verification steps handed out (the first block is none)
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
                    # a request stopped by the model's context hands out a last empty block of no step
                    step = stream.step_log[steps] if 0 <= steps < len(stream.step_log) else None
                    steps += 1
                    payload = TokenBlock(list(payload), sources, stream.plain_step_s, logprobs, step)
                yield kind, payload
                if finished:
                    return
        finally:
            if not finished:
                self.scheduler.cancel(ticket)
            finish_draft(stream)

    def check_capacity(self) -> None:
        """A request that passes may still meet a full scheduler at submit (others got there first): that too
        is a 429 (`events`)."""
        running, waiting = self.scheduler.load()
        capacity = self.scheduler.max_batch + self.scheduler.max_waiting
        if running + waiting >= capacity:
            raise ApiError(429, f"the service is at capacity: {running} running, {waiting} waiting "
                                f"(batch {self.scheduler.max_batch} + queue {self.scheduler.max_waiting}); "
                                "retry later", "rate_limit_error")

    def load(self) -> tuple[int, int]:
        return self.scheduler.load()

    def health_problem(self) -> str | None:
        if self.scheduler.stalled():
            return f"requests are waiting and no decoding step finished for {STALL_S:g} s"
        return None

    def add_segments(self) -> None:
        """Nothing to do: requests read the datastores through the `IndexHolder` the ingest just updated."""

    def stats(self) -> dict[str, Any]:
        return {"draft_workers": None if self.drafts is None else self.drafts.stats()}

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

    def close(self) -> None:
        """Stop the scheduler and the draft workers; keep what was recycled for the next start. The compute
        thread belongs to whoever made it."""
        self.scheduler.close()
        if self.drafts is not None:
            self.drafts.close()
        self.save_recycling_quietly()   # a read-only home must not turn a clean shutdown into a crash


def finish_draft(stream: Any) -> None:
    """Free a finished request's draft state on its draft worker (a no-op for in-process drafts)."""
    stream.decoder.proposer.finish()


def sizer_state(sizer: Sizer) -> dict[str, Any]:
    """What a request's sizer learned (`Sizer.state`: for cost sizing, acceptance posteriors, latencies, overhead)."""
    return sizer.state()


def warm_start(sizer: Sizer, state: dict[str, Any] | None) -> None:
    """Start a request's sizer from the last finished request's state instead of the prior.

    Why: a fresh sizer spends its first steps trying trees the previous request already learned not to
    try (docs/lab-notes/sizing.md, "service"). Only the decoding speed depends on it; the output never does.
    """
    if state:
        sizer.load_state(state)
