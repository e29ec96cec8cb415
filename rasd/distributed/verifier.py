"""`TargetVerifier`: the target model and its continuous batch in a Ray actor, apart from the HTTP replica.

By default the Serve replica decodes in its own process (`LocalBackend`, like Ray Serve LLM's
engine-in-replica). With `rasd serve --verifier-actor` the service's back-end is a `RemoteBackend`: the
decoding half (target, scheduler, recycling matrix, draft workers, the index's token datastores) moves into
this actor, and the replica keeps HTTP, validation, vector search and ingest. Why:

- placement: the actor takes `--verifier-gpus` / `--verifier-resources`, so on a cluster the target sits
  on GPU nodes while the HTTP replica and retrieval stay on CPU nodes (`cluster.yaml`);
- failure: when the verifier process dies, the replica is still there. Ray restarts the actor
  (`max_restarts=-1`) and the replica sends the requests it had in flight again, skipping the tokens already
  streamed: greedy and seeded requests come out whole and identical. Only an unseeded sampled request that
  had already streamed tokens gets HTTP 503 with a message saying so (the Python client retries 503), never
  Serve's bare 500 for a dead replica.

The actor runs a `LocalBackend`, the in-replica code, so tokens are identical to the in-replica path. It is
started from plain values (the `DecodingSettings`, which name the model and the index folder, and the
warm-up prompts), so a restarted actor loads and warms itself again. Events stream back through a Ray
streaming generator; a caller that goes away cancels it, which takes the request out of the batch.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import ray

from rasd.decoding.runtime.compute import ComputeThread
from rasd.distributed.backend import DecodingBackend, DecodingSettings, IndexHolder, LocalBackend, Prepared, WarmUp
from rasd.errors import ApiError

NAMESPACE = "rasd"
NAME_PREFIX = "rasd-verifier-"


class TargetVerifier:
    """Ray actor body: the target model and a `LocalBackend` whose `events` stream out through a generator."""

    def __init__(self, settings: DecodingSettings, warm: WarmUp):
        from rasd.decoding.model.loading import load_model

        self.compute = ComputeThread(settings.threads)
        target = self.compute.run(load_model, settings.model, device=settings.device, dtype=settings.dtype,
                                  graphs=settings.graphs)
        # the actor reads token datastores from the index folder itself; vector search stays with the replica
        self.indexes = IndexHolder(settings.index, target, self.compute)
        self.backend = LocalBackend(settings, target, self.compute, self.indexes)
        self.backend.start(warm)

    def ready(self) -> bool:
        return True

    async def decode(self, prepared: Prepared, sourced: bool = False) -> AsyncIterator[tuple[str, Any]]:
        async for event in self.backend.events(prepared, sourced):
            yield event

    def load(self) -> tuple[int, int]:
        return self.backend.load()

    def refresh_index(self) -> None:
        """Documents were added by the replica: serve the datastores of the new committed index state."""
        self.indexes.reopen()

    def info(self) -> dict[str, Any]:
        return self.backend.stats()

    def close(self) -> None:
        self.backend.close()
        self.compute.close()


class RemoteBackend(DecodingBackend):
    """The replica's handle on a `TargetVerifier`: starts it, streams a request's events, turns its death
    into a 503 (or, where lossless, a re-sent request)."""

    def __init__(self, settings: DecodingSettings, options: dict[str, Any], timeout_s: float = 600.0,
                 retry_s: float = 120.0):
        self.settings, self.timeout_s = settings, timeout_s
        self._name = NAME_PREFIX + uuid.uuid4().hex[:8]
        self.retry_s = retry_s            # how long a request waits for a restarted verifier
        self.requests_resent = 0            # requests re-sent after the verifier died under them
        # like the draft workers and shards: no CPU reservation by default (torch threads are set explicitly,
        # `--threads`), so the actor also starts where a replica or a test already holds the CPUs; placement
        # comes from `verifier_options` (num_gpus, resources, or num_cpus when a person wants it)
        self.options = {"num_cpus": 0, **options}
        self.actor: Any = None

    @property
    def name(self) -> str | None:
        return self._name

    @property
    def threads(self) -> int | None:
        return None

    def start(self, warm: WarmUp) -> None:
        """Start the actor; it loads and warms itself (again on every restart) before we say "up"."""
        self.actor = ray.remote(TargetVerifier).options(
            name=self._name, namespace=NAMESPACE, max_restarts=-1, max_task_retries=0,
            max_concurrency=1000, **self.options).remote(self.settings, warm)
        ray.get(self.actor.ready.remote(), timeout=self.timeout_s)

    async def events(self, p: Prepared, sourced: bool = False) -> AsyncIterator[tuple[str, Any]]:
        """The verifier's events for one request, surviving a verifier restart where that is lossless.

        When the actor dies mid-request, the request is sent again once Ray has restarted it, and the tokens
        the caller already has are skipped: greedy and seeded requests decode the same tokens again, so the
        caller sees one uninterrupted answer. A request that had streamed tokens of an unseeded sampled
        answer cannot be resumed that way (a new draw would not continue the old text): it gets ApiError 503,
        as does any request once `retry_s` has passed. The verifier's own ApiErrors are re-raised.
        """
        import asyncio

        from ray.exceptions import RayActorError

        replayable = p.sampling.greedy or p.sampling.seed is not None
        deadline = asyncio.get_running_loop().time() + self.retry_s
        sent = 0                                      # tokens the caller already has
        while True:
            seen = 0
            try:
                async for kind, payload in self._stream(p, sourced):
                    if kind == "tokens":
                        block, seen = _skip(payload, sent - seen), seen + _count(payload)
                        if block is None:
                            continue
                        sent = seen
                        payload = block
                    yield kind, payload
                return
            except RayActorError as exc:    # includes ActorDiedError and ActorUnavailableError
                if (sent and not replayable) or asyncio.get_running_loop().time() > deadline:
                    raise ApiError(503, "the verifier process stopped while decoding this request (Ray "
                                        "restarts it); retry the request", "service_unavailable") from exc
                self.requests_resent += 1
                await asyncio.sleep(0.5)      # Ray is restarting the actor; calls made now queue behind it

    async def _stream(self, prepared: Prepared, sourced: bool) -> AsyncIterator[tuple[str, Any]]:
        """One attempt: the actor's streaming generator, cancelled if the caller goes away."""
        from ray.exceptions import RayTaskError

        gen = self.actor.decode.options(num_returns="streaming").remote(prepared, sourced)
        finished = False
        try:
            async for ref in gen:
                kind, payload = await ref
                finished = kind == "done"
                yield kind, payload
                if finished:
                    return
            finished = True
        except RayTaskError as exc:
            finished = True
            cause = exc.cause if isinstance(getattr(exc, "cause", None), ApiError) else None
            if cause is not None:
                raise cause from None
            raise ApiError(500, f"decoding failed in the verifier: {type(exc.cause).__name__}",
                           "server_error") from exc
        finally:
            if not finished:
                ray.cancel(gen)

    def check_capacity(self) -> None:
        """Nothing to check here: the verifier's scheduler answers a full batch with a 429 at submit."""

    def load(self) -> tuple[int, int]:
        """(running, waiting) in the verifier; (0, 0) while it restarts."""
        try:
            return tuple(ray.get(self.actor.load.remote(), timeout=2.0))   # type: ignore[return-value]
        except Exception:   # noqa: BLE001 - a restarting actor must not break /healthz or /metrics
            return 0, 0

    def health_problem(self) -> str | None:
        """None: a verifier that died is restarted by Ray itself, and the replica stays healthy meanwhile."""
        return None

    def add_segments(self) -> None:
        """Best effort: the documents are already durable, and a verifier that is restarting reopens the
        index (its latest committed state) when it comes back, so a failed refresh must not fail the ingest."""
        try:
            ray.get(self.actor.refresh_index.remote(), timeout=120.0)
        except Exception as exc:   # noqa: BLE001
            print(f"rasd: verifier index refresh failed ({type(exc).__name__}); it reopens on restart",
                  file=sys.stderr)

    def stats(self) -> dict[str, Any]:
        try:
            info = ray.get(self.actor.info.remote(), timeout=5.0)
        except Exception:   # noqa: BLE001
            info = {"draft_workers": None}
        return {"name": self._name, "requests_resent": self.requests_resent, **info}

    def close(self) -> None:
        """Let the verifier save its recycling matrix, then stop it."""
        try:
            ray.get(self.actor.close.remote(), timeout=30.0)
        except Exception:   # noqa: BLE001 - already gone
            pass
        ray.kill(self.actor, no_restart=True)


def _count(payload: Any) -> int:
    """Tokens in a "tokens" event: a list of ids, or a `TokenBlock` when the caller asked for sources."""
    return len(payload.tokens if hasattr(payload, "tokens") else payload)


def _skip(payload: Any, n: int) -> Any:
    """The block without its first `n` tokens (None when nothing is left): a replay's already-sent part."""
    if n <= 0:
        return payload
    if n >= _count(payload):
        return None
    if hasattr(payload, "tokens"):
        logprobs = None if payload.logprobs is None else payload.logprobs[n:]
        return replace(payload, tokens=payload.tokens[n:], sources=payload.sources[n:], logprobs=logprobs)
    return payload[n:]


def verifier_handle(name: str) -> Any:
    """The actor by name (for `rasd fault` and tests)."""
    return ray.get_actor(name, namespace=NAMESPACE)
