"""`TargetVerifier`: the target model and its continuous batch in a Ray actor, apart from the HTTP replica.

By default the Serve replica owns the target and its batch (like Ray Serve LLM's engine-in-replica). With
`rasd serve --verifier-actor` the decoding half of `Service` (target, scheduler, recycling matrix, draft
workers, the index's token datastores) moves into this actor, and the replica keeps HTTP, validation,
vector search and ingest. Why:

- placement: the actor takes `--verifier-gpus` / `--verifier-resources`, so on a cluster the target sits
  on GPU nodes while the HTTP replica and retrieval stay on CPU nodes (`cluster.yaml`);
- failure: when the verifier process dies, the replica is still there. Ray restarts the actor
  (`max_restarts=-1`) and the replica sends the requests it had in flight again, skipping the tokens already
  streamed: greedy and seeded requests come out whole and identical. Only an unseeded sampled request that
  had already streamed tokens gets HTTP 503 with a message saying so (the Python client retries 503), never
  Serve's bare 500 for a dead replica.

The actor runs the same `Service` code in local mode, so tokens are identical to the in-replica path.
Events stream back through a Ray streaming generator; a caller that goes away cancels it, which takes the
request out of the batch.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import ray

from rasd.errors import ApiError

NAMESPACE = "rasd"
NAME_PREFIX = "rasd-verifier-"


class TargetVerifier:
    """Ray actor body: a local-mode service whose `events` stream out through a generator.

    `make_service(config, decode_only=True)` builds it: the serve layer passes its `Service` class in, so
    this layer never imports the one above it."""

    def __init__(self, config: Any, make_service: Callable[..., Any]):
        # the actor reads token datastores from the index folder itself; vector search stays with the replica
        local = replace(config, verifier_actor=False, verifier_options={}, retrieval_shards=0)
        self.service = make_service(local, decode_only=True)

    def ready(self) -> bool:
        return True

    async def decode(self, prepared: Any, sourced: bool = False) -> AsyncIterator[tuple[str, Any]]:
        async for event in self.service.events(prepared, sourced):
            yield event

    def load(self) -> tuple[int, int]:
        return self.service.load()

    def refresh_index(self) -> None:
        """Documents were added by the replica: serve the datastores of the new committed index state."""
        self.service.reopen_index()

    def info(self) -> dict[str, Any]:
        return {"draft_workers": self.service.draft_stats()}

    def close(self) -> None:
        self.service.close()


class RemoteVerifier:
    """The replica's handle: starts the actor, streams a request's events, turns its death into a 503."""

    def __init__(self, config: Any, make_service: Callable[..., Any], timeout_s: float = 600.0,
                 retry_s: float = 120.0):
        self.name = NAME_PREFIX + uuid.uuid4().hex[:8]
        self.retry_s = retry_s            # how long a request waits for a restarted verifier
        self.requests_resent = 0            # requests re-sent after the verifier died under them
        # like the draft workers and shards: no CPU reservation by default (torch threads are set explicitly,
        # `--threads`), so the actor also starts where a replica or a test already holds the CPUs; placement
        # comes from `verifier_options` (num_gpus, resources, or num_cpus when a person wants it)
        options = {"num_cpus": 0, **config.verifier_options}
        self.actor = ray.remote(TargetVerifier).options(
            name=self.name, namespace=NAMESPACE, max_restarts=-1, max_task_retries=0,
            max_concurrency=1000, **options).remote(config, make_service)
        ray.get(self.actor.ready.remote(), timeout=timeout_s)   # the model is loaded before we say "up"

    async def events(self, prepared: Any, sourced: bool = False) -> AsyncIterator[tuple[str, Any]]:
        """The verifier's events for one request, surviving a verifier restart where that is lossless.

        When the actor dies mid-request, the request is sent again once Ray has restarted it, and the tokens
        the caller already has are skipped: greedy and seeded requests decode the same tokens again, so the
        caller sees one uninterrupted answer. A request that had streamed tokens of an unseeded sampled
        answer cannot be resumed that way (a new draw would not continue the old text): it gets ApiError 503,
        as does any request once `retry_s` has passed. The verifier's own ApiErrors are re-raised.
        """
        import asyncio

        from ray.exceptions import RayActorError

        replayable = prepared.sampling.greedy or prepared.sampling.seed is not None
        deadline = asyncio.get_running_loop().time() + self.retry_s
        sent = 0                                      # tokens the caller already has
        while True:
            seen = 0
            try:
                async for kind, payload in self._stream(prepared, sourced):
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

    async def _stream(self, prepared: Any, sourced: bool) -> AsyncIterator[tuple[str, Any]]:
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

    def load(self) -> tuple[int, int]:
        """(running, waiting) in the verifier; (0, 0) while it restarts."""
        try:
            return tuple(ray.get(self.actor.load.remote(), timeout=2.0))   # type: ignore[return-value]
        except Exception:   # noqa: BLE001 - a restarting actor must not break /healthz or /metrics
            return 0, 0

    def refresh_index(self) -> None:
        """Best effort: the documents are already durable, and a verifier that is restarting reopens the
        index (its latest committed state) when it comes back, so a failed refresh must not fail the ingest."""
        try:
            ray.get(self.actor.refresh_index.remote(), timeout=120.0)
        except Exception as exc:   # noqa: BLE001
            print(f"rasd: verifier index refresh failed ({type(exc).__name__}); it reopens on restart",
                  file=sys.stderr)

    def info(self) -> dict[str, Any]:
        try:
            info = ray.get(self.actor.info.remote(), timeout=5.0)
        except Exception:   # noqa: BLE001
            info = {"draft_workers": None}
        return {"name": self.name, "requests_resent": self.requests_resent, **info}

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
