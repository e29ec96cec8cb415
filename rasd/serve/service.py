"""The service's request logic, independent of Ray: validate, search, ingest, and hand requests to a back-end.

`Service` owns the target model (here: its tokenizer and limits), the index, and one `DecodingBackend` that decodes
every request (`rasd.distributed.backend`): a `LocalBackend` (by default: a continuous-batching `Scheduler`
in this process, every running request sharing the target's forwards) or a `RemoteBackend` (`--verifier-actor`:
the same in a `TargetVerifier` Ray actor). It never asks which. Its torch work here (loading, query and
document embedding, and with a local back-end every decoding step) runs on one `ComputeThread` (see
`rasd.decoding.runtime.compute` for why: two threads running torch made every decoding step up to 1.5x
slower). The Serve deployment (`replica.py`) only maps HTTP onto these methods, so the logic can be tested
and reused without an HTTP server.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import fields, replace
from typing import Any

from rasd.apps.docqa import Source, fit_sources
from rasd.decoding.proposers import METHODS, method_spec
from rasd.decoding.runtime.compute import ComputeThread
from rasd.decoding.runtime.engine import GenerationOutput, vocab_size
from rasd.decoding.step.grammar import ll_tokenizer
from rasd.decoding.step.sampling import SamplingParams
from rasd.distributed.backend import (
    DecodingBackend,
    DecodingSettings,
    IndexHolder,
    LocalBackend,
    Prepared,
    TokenBlock,
    WarmUp,
    sizer_state,
    warm_start,
)
from rasd.errors import ApiError
from rasd.serve.config import ServeConfig
from rasd.serve.ingest import ACTIVE, IngestJob, IngestQueue, Progress, job_id_for, public
from rasd.serve.metrics import ServiceMetrics
from rasd.text import encode_chat, has_chat_template

__all__ = ["Prepared", "ServeConfig", "Service", "TokenBlock", "decoding_settings", "sizer_state",
           "warm_start"]
INGEST_LOCK_TIMEOUT_S = 60.0   # how long an ingest waits for another writer (CLI, another replica)


def decoding_settings(config: ServeConfig) -> DecodingSettings:
    """The part of the configuration that decoding reads (what a verifier actor is started from)."""
    return DecodingSettings(**{f.name: getattr(config, f.name) for f in fields(DecodingSettings)})


def make_backend(config: ServeConfig, target: Any, compute: ComputeThread, indexes: IndexHolder) -> DecodingBackend:
    """The one place that chooses where requests decode: in this process, or in a verifier actor."""
    settings = decoding_settings(config)
    if config.verifier_actor:
        from rasd.distributed.verifier import RemoteBackend

        return RemoteBackend(settings, config.verifier_options, call_timeout_s=config.verifier_timeout_s,
                             step_timeout_s=config.verifier_step_timeout_s)
    return LocalBackend(settings, target, compute, indexes)


class Service:
    """Target model (tokenizer, limits) + index + a decoding back-end; request handling shared by every HTTP
    endpoint."""

    def __init__(self, config: ServeConfig, decode_only: bool = False, owner: str | None = None):
        """`decode_only`: no search warm-up (a caller that brings prompts it built already); `owner`: this
        replica's name in the ingest jobs' records."""
        from rasd.decoding.model.loading import load_model

        self.config = config
        self.compute = ComputeThread(config.threads)
        self.target = self.compute.run(load_model, config.model, device=config.device, dtype=config.dtype,
                                       graphs=config.graphs)
        # `auto` resolved once, here: the verifier actor and draft workers load the dtype this replica runs in
        config = self.config = replace(config, dtype=self.target.dtype)
        self.indexes = IndexHolder(config.index, self.target, self.compute, config.retrieval_shards)
        self._ingest_lock = threading.Lock()
        self.ingests = IngestQueue(None if self.index is None else self.index.root, owner or f"local-{os.getpid()}",
                                   config.max_ingest_waiting)
        self.backend = make_backend(config, self.target, self.compute, self.indexes)
        self.metrics = ServiceMetrics(self.load)
        if not decode_only and self.index is not None:
            self._search("warm up", 1)    # loads the query embedder before the first request needs it
            self._warm_ingest()
        self.backend.start(self._warm_prompts())
        self.started = time.time()

    def _warm_ingest(self) -> None:
        """The index tokenizer and its fingerprint, loaded once here: on the first ingest's thread they held the
        GIL for seconds while a stream beside it waited for its first token."""
        from rasd.index.chunking import load_tokenizer, tokenizer_fingerprint

        tokenizer_fingerprint(load_tokenizer(self.config.model))

    @property
    def index(self) -> Any:
        """The index as this process last opened it (`self.indexes.fresh()` checks for a newer state)."""
        return self.indexes.index

    def _warm_prompts(self) -> WarmUp:
        """What the back-end warms every method at: a chat-sized prompt and, with an index, a document-QA-sized
        one (built here, where the vector search is)."""
        if not self.config.warm_methods:
            return WarmUp()
        chat = (self.encode_chat([{"role": "user", "content": "Say hello."}])
                if has_chat_template(self.target.tokenizer) else self.encode_text("Say hello."))
        docqa = self.docqa_prompt("How do I use this?", 4, 16)[0] if self.index is not None else None
        return WarmUp(chat, docqa)

    def check_capacity(self) -> None:
        """429 before a request costs any work (tokenizing, vector search, building its decoder) when the
        back-end is already full."""
        self.backend.check_capacity()

    def load(self) -> tuple[int, int]:
        """(running, waiting) requests, wherever they decode."""
        return self.backend.load()

    def healthy(self) -> bool:
        """False when the compute thread has died or decoding is stuck with work waiting."""
        return not self.health_problem()

    def health_problem(self) -> str | None:
        """Why the service cannot answer now (what /healthz reports), or None."""
        return self.broken() or self.backend.unavailable()

    def broken(self) -> str | None:
        """Why this replica is stuck so that restarting it helps (Serve's health check), or None. A verifier
        actor that hangs is not that: a restart would reload the model and lose every request, and the verifier
        serves again once it answers; meanwhile its requests get 503 (`RemoteBackend`)."""
        if not self.compute.is_alive():
            return "the compute thread is not running"
        return self.backend.health_problem()

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
        return Prepared(prompt_ids, method, max_tokens, sampling, req.stop_list(), sources or [], req.logprobs_k(),
                        req.repetition(self.config.repetition_window))

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
        self.indexes.fresh()
        hits = self._search(question, top_k)
        sources = [Source.from_hit(h) for h in hits]
        budget = self.target.max_context - (max_tokens or 256) - 1
        try:
            return fit_sources(self.target.tokenizer, question, sources, min(budget, self.prompt_limit()))
        except ValueError as exc:
            raise ApiError(400, str(exc), param="question") from exc

    # ------------------------------------------------------------------ decoding
    def events(self, p: Prepared, sourced: bool = False) -> AsyncIterator[tuple[str, Any]]:
        """("tokens", block)... then ("done", GenerationOutput): the back-end's own stream, handed out as it
        is, so that closing it takes the request out of the batch at once. With `sourced`, or when the request
        asked for log-probabilities, each block comes as a `TokenBlock` carrying every token's source (and
        log-probability)."""
        return self.backend.events(p, sourced)

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
                "verifier": self.backend.name}

    def draft_stats(self) -> dict[str, Any] | None:
        """The draft workers' counters wherever they run (in the verifier actor, or here); None without any."""
        return self.backend.stats()["draft_workers"]

    # ------------------------------------------------------------------ documents
    def ingest(self, docs: list[dict[str, Any]], idempotency_key: str | None = None) -> tuple[IngestJob, bool]:
        """Queue an ingest on the ingest thread (429 with Retry-After when its queue is full): (the job to wait
        for or to poll, whether it is new). A re-post under the same Idempotency-Key (the same documents, else
        422) gets its job back while it is queued, running or done; a failed one (or one whose replica stopped)
        runs again under the same id, and the index's manifest keeps the batch once however often it runs."""
        self._check_documents(docs)
        claim = None if idempotency_key is None else idempotency_claim(idempotency_key, docs)
        job_id = job_id_for(None if claim is None else claim["key"])
        earlier = self.ingests.get(job_id) if claim is not None else None
        if earlier is not None:
            if earlier.body != claim["body"]:
                raise ApiError(422, "this Idempotency-Key was used with other documents", param="Idempotency-Key")
            if earlier.status == "done" or (earlier.status in ACTIVE and earlier.replica == self.ingests.owner):
                return earlier, False
        job = IngestJob(job_id, self.ingests.owner, len(docs), sum(len(str(d["text"]).encode("utf-8", "replace"))
                                                                    for d in docs),
                        None if claim is None else claim["key"], None if claim is None else claim["body"],
                        attempts=1 if earlier is None else earlier.attempts + 1)
        return self.ingests.submit(job, lambda progress: self._ingest_work(docs, idempotency_key, progress)), True

    def ingest_job(self, job_id: str) -> dict[str, Any] | None:
        """A job's record as this replica knows it (in memory, else stored under the index), with "live": whether
        this replica runs it. A stored record left queued or running whose batch the manifest shows committed is
        done (its replica stopped between the commit and the record)."""
        job = self.ingests.get(job_id)
        if job is None:
            return None
        record = job.record()
        if job.status in ACTIVE and job.replica != self.ingests.owner and job.key and self.index is not None:
            from rasd.index.writer import idempotency_record

            committed = idempotency_record(self.index.root, job.key)
            if committed is not None and committed["body"] == job.body:
                record.update(status="done", stage="done", progress=1.0, added=committed["added"])
        return {**public(record), "live": job.replica == self.ingests.owner}

    def _ingest_work(self, docs: list[dict[str, Any]], key: str | None, progress: Progress) -> dict[str, Any]:
        try:
            return self.add_documents(docs, key, progress)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="documents") from exc

    def _check_documents(self, docs: list[dict[str, Any]]) -> None:
        """400 for what the writer would refuse or skip, before an ingest takes a place in the queue."""
        if self.index is None:
            raise ApiError(400, "this service has no index; start it with --index", param="documents")
        blank = next((i for i, d in enumerate(docs) if not str(d.get("text", "")).strip()), None)
        if blank is not None:   # the writer would skip it: refused by name, so what is acknowledged was all written
            raise ApiError(400, f"document {blank} has no text (only whitespace)", param=f"documents.{blank}.text")

    def add_documents(self, docs: list[dict[str, Any]], idempotency_key: str | None = None,
                      progress: Progress | None = None) -> dict[str, Any]:
        """Append documents as a new index segment (durable when this returns), then serve from it.

        Called on a worker thread, never the compute thread: tokenizing, chunking, suffix arrays and the
        segment's files happen here, beside decoding; only the embedding (torch) goes to the compute thread, as
        background slices of about EMBED_SLICE_S that yield to decoding steps, so running streams keep getting
        tokens at no less than half their rate. Another writer
        holding the index's lock for over INGEST_LOCK_TIMEOUT_S is a 503, not a request that never ends.

        `idempotency_key` (the `Idempotency-Key` header): the batch is added once however often it is sent, by
        whichever replica or process (the key is recorded in the index's manifest with the segment); a replay
        answers what the first attempt added, with `"replayed": true`; the key with another body is a 422.
        `progress(stage, done, total)`: how far it is (`rasd.index.writer.OnProgress`). HTTP ingests come here
        through `ingest` (the ingest thread).
        """
        from rasd.fsio import LockTimeout
        from rasd.index.documents import Document
        from rasd.index.writer import add_documents

        self._check_documents(docs)
        documents = [Document(text=d["text"], title=d.get("title", ""), source=d.get("source", ""),
                              external_id=d.get("id")) for d in docs]
        claim = None if idempotency_key is None else idempotency_claim(idempotency_key, docs)
        with self._ingest_lock:
            if claim is not None and (replay := self._replay(claim)) is not None:
                return replay
            try:
                index = add_documents(self.index.root, documents, model=self.config.model,
                                      run_torch=self.compute.run_background, lock_timeout_s=INGEST_LOCK_TIMEOUT_S,
                                      idempotency=claim, on_progress=progress)
            except LockTimeout as exc:
                raise ApiError(503, str(exc), "service_unavailable") from exc
            if claim is not None and (replay := self._replay(claim)) is not None:
                return replay                        # another process committed this key while we embedded
            if hasattr(self.index, "refresh"):      # sharded: the shards reopen the new committed state
                self.index.refresh()
                index = self.index
            self.indexes.replace(index)
            self.backend.add_segments()             # its token datastores must include the new segment
        # this batch's documents (every one is written: whitespace-only ones are refused before), not the
        # growth since this replica last looked, which would count another writer's commits too
        return {"added": len(documents), "num_documents": index.num_documents, "num_chunks": index.num_chunks}

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
        """Replica shutdown: stop decoding (which keeps what was recycled for the next start)."""
        self.ingests.close()
        self.backend.close()
        self.compute.close()


def idempotency_claim(key: str, docs: list[dict[str, Any]]) -> dict[str, str]:
    """What a write with this key records: hashes of the key and of the documents, and a nonce of this attempt."""
    import hashlib
    import json
    import secrets

    body = hashlib.sha256(json.dumps(docs, sort_keys=True, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    return {"key": hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest(), "body": body.hexdigest(),
            "nonce": secrets.token_hex(8)}

