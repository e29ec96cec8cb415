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

- hangs: an actor that is alive but stuck (stopped, deadlocked) raises nothing, so the replica pings it every
  `PING_S` with a deadline (`VerifierWatch`). One that answers nothing for `verifier_timeout_s` while Ray says
  it is alive is hung: /healthz is 503, every request waiting on it and every new one gets 503, and once it
  answers again it serves again. Each wait for a request's next block has a deadline too
  (`verifier_step_timeout_s`); the replica's /healthz, /metrics and /v1/info read what the last ping brought and
  never wait on the actor.

The actor runs a `LocalBackend`, the in-replica code, so tokens are identical to the in-replica path. It is
started from plain values (the `DecodingSettings`, which name the model and the index folder, and the
warm-up prompts), so a restarted actor loads and warms itself again. Events stream back through a Ray
streaming generator; a caller that goes away cancels it, which takes the request out of the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
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
PING_S = 1.0     # how often the replica asks the verifier how it is (`VerifierWatch`)
POLL_S = 0.25    # how often a request waiting for its next block looks whether the verifier is hung
log = logging.getLogger(__name__)


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

    async def health(self) -> dict[str, Any]:
        """What the replica shows of the verifier (load, a stalled scheduler, counters); answering at all is the
        sign of life `VerifierWatch` waits for."""
        return {"load": self.backend.load(), "problem": self.backend.health_problem(), "info": self.backend.stats()}

    async def refresh_index(self) -> None:
        """Documents were added by the replica: serve the datastores of the new committed index state. Off the
        actor's event loop (a plain method of an async actor runs on it): opening a large index there paused
        every stream and every health ping."""
        await asyncio.to_thread(self.indexes.reopen)

    def close(self) -> None:
        self.backend.close()
        self.compute.close()


class RemoteBackend(DecodingBackend):
    """The replica's handle on a `TargetVerifier`: starts it, streams a request's events, turns its death
    into a 503 (or, where lossless, a re-sent request)."""

    def __init__(self, settings: DecodingSettings, options: dict[str, Any], timeout_s: float = 600.0,
                 retry_s: float = 120.0, call_timeout_s: float = 10.0, step_timeout_s: float = 300.0):
        self.settings, self.timeout_s = settings, timeout_s
        self._name = NAME_PREFIX + uuid.uuid4().hex[:8]
        self.retry_s = retry_s            # how long a request waits for a restarted verifier
        self.call_timeout_s = call_timeout_s    # `verifier_timeout_s`: no answer for this long is hung
        self.step_timeout_s = step_timeout_s    # `verifier_step_timeout_s`: the longest wait for a next block
        self.watch: VerifierWatch | None = None
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
        self.watch = VerifierWatch(self.actor, self.call_timeout_s)
        self.watch.start()

    async def events(self, p: Prepared, sourced: bool = False) -> AsyncIterator[tuple[str, Any]]:
        """The verifier's events for one request, surviving a verifier restart where that is lossless.

        When the actor dies mid-request, the request is sent again once Ray has restarted it, and the tokens
        the caller already has are compared and skipped: greedy and seeded requests decode the same tokens
        again, so the caller sees one uninterrupted answer. Where the new attempt differs inside that part
        (batched greedy decoding may break a near-tie the other way), joining the two would splice two answers:
        ApiError 503 instead. A request that had streamed tokens of an unseeded sampled answer cannot be
        resumed (a new draw would not continue the old text): 503, as is any request once `retry_s` has passed,
        and any request while the verifier is hung (`VerifierWatch`) or silent for `step_timeout_s`. The
        verifier's own ApiErrors are re-raised.
        """
        from ray.exceptions import RayActorError

        replayable = p.sampling.greedy or p.sampling.seed is not None
        deadline = asyncio.get_running_loop().time() + self.retry_s
        sent: list[int] = []                          # the tokens the caller already has
        while True:
            self._check_hung()
            seen = 0                                  # tokens of this attempt so far
            try:
                async with contextlib.aclosing(self._stream(p, sourced)) as attempt:
                    async for kind, payload in attempt:
                        if kind == "tokens":
                            block, seen = _unsent(payload, sent, seen), seen + _count(payload)
                            if block is None:
                                continue
                            sent += _tokens(block)
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
        """One attempt: the actor's streaming generator, cancelled if the caller goes away; every wait bounded."""
        from ray.exceptions import RayTaskError

        gen = self.actor.decode.options(num_returns="streaming").remote(prepared, sourced)
        finished = False
        try:
            while True:
                try:
                    ref = await self._bounded(gen.__anext__())
                except StopAsyncIteration:
                    finished = True
                    return
                kind, payload = await self._bounded(ref)
                finished = kind == "done"
                yield kind, payload
                if finished:
                    return
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

    async def _bounded(self, awaitable: Any) -> Any:
        """`awaitable`'s result, or ApiError 503 as soon as the verifier is hung or `step_timeout_s` passed."""
        task = asyncio.ensure_future(awaitable)
        deadline = time.monotonic() + self.step_timeout_s
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=POLL_S)
                if done:
                    return task.result()
                self._check_hung()
                if time.monotonic() > deadline:
                    raise ApiError(503, f"the verifier sent nothing for this request in {self.step_timeout_s:g} s "
                                        "(verifier_step_timeout_s); retry the request", "service_unavailable")
        finally:
            if not task.done():
                task.cancel()

    def _check_hung(self) -> None:
        problem = self.watch.hung() if self.watch is not None else None
        if problem is not None:
            raise ApiError(503, f"{problem}; retry the request", "service_unavailable")

    def check_capacity(self) -> None:
        """503 while the verifier is hung; a full batch is the verifier scheduler's 429 at submit."""
        self._check_hung()

    def load(self) -> tuple[int, int]:
        """(running, waiting) in the verifier at its last answer; (0, 0) while it restarts."""
        return self.watch.load if self.watch is not None else (0, 0)

    def health_problem(self) -> str | None:
        """None: restarting the replica is no cure for its verifier. One that died is restarted by Ray itself;
        one that hangs, or whose scheduler stalls, is `unavailable`."""
        return None

    def unavailable(self) -> str | None:
        """The verifier hangs, or says its scheduler is stalled (/healthz 503)."""
        if self.watch is None:
            return None
        hung = self.watch.hung()
        return hung or (None if self.watch.problem is None else f"the verifier: {self.watch.problem}")

    def add_segments(self) -> None:
        """Best effort: the documents are already durable, and a verifier that is restarting reopens the
        index (its latest committed state) when it comes back, so a failed refresh must not fail the ingest.
        A hung one is not waited for: its next request reopens the index, whose manifest changed."""
        if self.watch is not None and self.watch.hung() is not None:
            print("rasd: the verifier hangs; it reopens the index at its next request", file=sys.stderr)
            return
        try:
            ray.get(self.actor.refresh_index.remote(), timeout=120.0)
        except Exception as exc:   # noqa: BLE001
            print(f"rasd: verifier index refresh failed ({type(exc).__name__}); it reopens on restart",
                  file=sys.stderr)

    def stats(self) -> dict[str, Any]:
        """The verifier's counters at its last answer."""
        info = self.watch.info if self.watch is not None else {"draft_workers": None}
        return {"name": self._name, "requests_resent": self.requests_resent, **info}

    def close(self) -> None:
        """Let the verifier save its recycling matrix (unless it hangs), then stop it."""
        hung = self.watch is not None and self.watch.hung() is not None
        if self.watch is not None:
            self.watch.stop()
        if not hung:
            try:
                ray.get(self.actor.close.remote(), timeout=30.0)
            except Exception:   # noqa: BLE001 - already gone
                pass
        ray.kill(self.actor, no_restart=True)


class VerifierWatch(threading.Thread):
    """Pings the verifier every `PING_S`, each ping bounded by `timeout_s`, and keeps what it answered.

    Why a thread: a stopped or deadlocked actor raises nothing, it just never answers, so only a deadline sees it;
    and the replica's /healthz, /metrics and /v1/info then read these fields instead of waiting on the actor
    inside the replica's event loop, where a slow answer stalled every stream of the replica. A ping that times
    out while Ray restarts the actor is not a hang (requests wait for the restart and are re-sent).
    """

    def __init__(self, actor: Any, timeout_s: float):
        super().__init__(name="rasd-verifier-watch", daemon=True)
        self.actor, self.timeout_s = actor, timeout_s
        self.load: tuple[int, int] = (0, 0)
        self.problem: str | None = None       # what the verifier says of itself (its scheduler stalled)
        self.info: dict[str, Any] = {"draft_workers": None}
        self.hung_since: float | None = None  # monotonic time of the first ping it never answered
        self._stopped = threading.Event()

    def run(self) -> None:
        while not self._stopped.is_set():
            self.ping()
            self._stopped.wait(PING_S)

    def stop(self) -> None:
        self._stopped.set()

    def ping(self) -> None:
        from ray.exceptions import GetTimeoutError, RayActorError

        sent = time.monotonic()
        try:
            state = ray.get(self.actor.health.remote(), timeout=self.timeout_s)
        except GetTimeoutError:
            if actor_state(self.actor) in (None, "ALIVE"):
                self.hung_since = self.hung_since or sent
            return
        except RayActorError:      # died: Ray restarts it, and the requests in flight are re-sent
            self.hung_since, self.load = None, (0, 0)
            return
        except Exception as exc:   # noqa: BLE001 - the watch must outlive whatever one ping raises
            log.warning("verifier health ping failed: %s: %s", type(exc).__name__, exc)
            return
        self.hung_since = None
        self.load, self.problem, self.info = tuple(state["load"]), state["problem"], state["info"]

    def hung(self) -> str | None:
        """Why the verifier counts as hung, or None."""
        since = self.hung_since
        if since is None:
            return None
        return (f"the verifier actor has answered nothing for {time.monotonic() - since:.0f} s though Ray has it "
                f"alive (stopped or deadlocked; verifier_timeout_s {self.timeout_s:g})")


def actor_state(actor: Any) -> str | None:
    """Ray's state of the actor (ALIVE, RESTARTING, ...), from the GCS; None when it cannot be told."""
    try:
        from ray._private.state import actors

        return actors(actor_id=actor._actor_id.hex()).get("State")
    except Exception:   # noqa: BLE001 - a private API: unknown counts as alive, so a hang is still seen
        return None


def _tokens(payload: Any) -> list[int]:
    """The ids of a "tokens" event: a list of ids, or a `TokenBlock` when the caller asked for sources."""
    return list(payload.tokens if hasattr(payload, "tokens") else payload)


def _count(payload: Any) -> int:
    return len(_tokens(payload))


def _unsent(payload: Any, sent: list[int], seen: int) -> Any:
    """The part of a block (at token `seen` of this attempt) the caller does not have yet, None when it has all
    of it; ApiError 503 when the block differs from what the caller already has (a replay must not splice)."""
    overlap = max(0, min(len(sent) - seen, _count(payload)))
    if _tokens(payload)[:overlap] != sent[seen:seen + overlap]:
        raise ApiError(503, f"the verifier restarted and decoded this request differently within the {len(sent)} "
                            "tokens already sent (a near-tie broken the other way); retry the request",
                            "service_unavailable")
    return _skip(payload, overlap)


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
