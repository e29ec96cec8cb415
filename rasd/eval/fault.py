"""`rasd fault`: kill parts of a running service under document-QA load; nothing may hang or lie.

The service promises three things when a part of it dies: a request either completes with exactly the
tokens it would have produced without the fault (lossless), or fails with a clear HTTP error (status and
message); no request hangs; and a document whose ingest was acknowledged is never lost. This script checks
those promises on a real service, one phase per target:

- `shard`: a `RetrievalShard` actor (the service runs with `--retrieval-shards N`). Shard actors are
  unnamed and owned by the replica, so no other process can get a handle for `ray.kill`; the script kills
  the actor's worker process (SIGKILL: what a crash looks like) and Ray restarts it (`max_restarts=-1`).
- `verifier`: what owns the target model and the batching scheduler, killed with `ray.kill(handle,
  no_restart=False)`: the `TargetVerifier` actor when the service runs with `--verifier-actor` (Ray restarts
  it; requests in flight get a 503 from the replica, which lives on), else the Serve replica of `RasdServer`
  (Serve starts a new replica; requests in flight get Serve's bare 500).
- `hung`: the `TargetVerifier` actor (`--verifier-actor`) is not killed but stopped (SIGSTOP: alive to Ray,
  answering nothing, as a deadlock looks) for `--hang-s`, then continued (SIGCONT, always). The service must
  see it (`/healthz` 503 within the phase), end the requests waiting on it with a clear 503 (an error event for
  a stream) and serve again once it is continued. A streamed question runs through this phase: its longest wait
  for an event is the table's "max stream gap".
- `draft`: a `DraftWorker` actor (`rasd-draft-<i>`, when the service has draft workers), `ray.kill` too;
  "skipped" when there is none.
- `ingest`: no kill; documents are added while requests run.

Every phase sends the same questions from a thread pool (`load.run_level`), kills its target once the
first request is running, then ingests a few documents (so that documents acknowledged in one phase live
through the kills of the next ones), lets the requests finish, and waits, bounded, until the killed actor is
back, `/healthz` answers and one probe request completes. The reference answers come from one fault-free
pass of the same questions through the same service before the faults: cheaper than loading the model
in-process, and the service's own answers are what a fault must not change (`rasd load` checks separately
that they equal the in-process engine). At the end every acknowledged document is looked up in the index
on disk (`Index.open` + a search on its text) and through the service (it must come back as a docqa source).

Bounded everywhere: each request by `--request-timeout`, each phase starts no request after
`--phase-timeout`, every wait has a deadline. Loopback URLs only: the script kills actors of the Ray cluster
on this machine.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from rasd.eval.load import SAMPLE_QUESTIONS, ask_fresh, run_level

PHASES = ("shard", "verifier", "hung", "draft", "ingest")
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
SERVE_NAMESPACE = "serve"
POLL_S = 0.25


def register(subparsers: Any) -> Any:
    p = subparsers.add_parser("fault", help="kill retrieval shards, the verifier, draft workers under load; "
                                            "check that no request hangs or returns wrong tokens")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the service (loopback only)")
    p.add_argument("--api-key", default=os.environ.get("RASD_API_KEY"))
    p.add_argument("--index", default=None,
                   help="the service's index folder (or `sample`): acknowledged documents are checked on disk")
    p.add_argument("--address", default="auto", help="the service's Ray cluster")
    p.add_argument("--app", default="rasd", help="the Serve application's name (`rasd serve` uses rasd)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, from {','.join(PHASES)}")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests-per-phase", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--method", default="rasd")
    p.add_argument("--top-k-sources", type=int, default=4)
    p.add_argument("--docs-per-phase", type=int, default=1, help="documents ingested after each kill")
    p.add_argument("--ingest-docs", type=int, default=3, help="documents ingested in the `ingest` phase")
    p.add_argument("--hang-s", type=float, default=20.0,
                   help="seconds the `hung` phase keeps the verifier stopped (above the service's verifier_timeout_s)")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds before a request counts as hung")
    p.add_argument("--phase-timeout", type=float, default=600.0,
                   help="seconds after which a phase starts no request and stops waiting for recovery")
    p.add_argument("--out", default=None, help="results JSON")
    p.set_defaults(func=run_fault_cli)
    return p


# ---------------------------------------------------------------------------------------------- settings


@dataclass
class FaultConfig:
    """One run's settings; the CLI and the test build the same object."""

    url: str
    api_key: str | None = None
    index: str | None = None              # index folder for the on-disk durability check (None: skip it)
    app: str = "rasd"
    phases: list[str] = field(default_factory=lambda: list(PHASES))
    questions: list[str] = field(default_factory=lambda: list(SAMPLE_QUESTIONS[:8]))
    concurrency: int = 4
    params: dict[str, Any] = field(default_factory=lambda: {"max_tokens": 64, "method": "rasd",
                                                            "top_k_sources": 4, "temperature": 0})
    docs_per_phase: int = 1
    ingest_docs: int = 3
    request_timeout_s: float = 120.0
    phase_timeout_s: float = 600.0
    accept_wait_s: float = 15.0           # how long to wait for the first request to run before killing anyway
    hang_s: float = 20.0                  # how long the `hung` phase keeps the verifier stopped
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])


def check_loopback(url: str) -> None:
    """Why: the script kills actors of the Ray cluster it runs beside; a remote URL would test another one."""
    host = urlparse(url).hostname or ""
    if host not in LOOPBACK:
        from rasd.errors import CliError

        raise CliError(f"--url must be a loopback address (127.0.0.1, localhost), not {host!r}: fault "
                       f"injection kills actors of the local Ray cluster")


# ---------------------------------------------------------------------------------------------- Ray actors


@dataclass(frozen=True)
class ActorInfo:
    """What the script needs to know of a live actor to pick it, kill it and see it come back."""

    actor_id: str
    class_name: str
    name: str
    namespace: str
    pid: int
    node_id: str


def connect_ray(address: str = "auto") -> None:
    """Join the service's cluster as a driver (as `rasd serve --stop` does); a no-op inside a test's Ray."""
    import ray

    if ray.is_initialized():
        return
    try:
        ray.init(address=address, log_to_driver=False)
    except (ConnectionError, RuntimeError) as exc:
        from rasd.errors import CliError

        raise CliError(f"could not join the service's Ray cluster at {address!r} ({exc}); with token auth the "
                       f"token must be in ~/.ray/auth_token (or RAY_AUTH_TOKEN_PATH)") from exc


_STATE_API_WORKS: list[bool] = []


def alive_actors() -> list[ActorInfo]:
    """Live actors of the cluster: Ray's state API, or the GCS actor table when the cluster runs without a
    dashboard (`rasd serve --detach` starts it with `--include-dashboard=false`, and the state API is served
    by the dashboard)."""
    if _STATE_API_WORKS != [False]:
        try:
            actors = _state_api_actors()
            _STATE_API_WORKS[:] = [True]
            return actors
        except Exception:   # no dashboard: RayStateApiException, ConnectionError, ... depending on the version
            if _STATE_API_WORKS == [True]:
                raise
            _STATE_API_WORKS[:] = [False]
    return _gcs_actors()


def _state_api_actors() -> list[ActorInfo]:
    from ray.util.state import list_actors

    rows = list_actors(filters=[("state", "=", "ALIVE")], limit=10_000, timeout=10, raise_on_missing_output=False)
    return [ActorInfo(r.actor_id, r.class_name or "", r.name or "", r.ray_namespace or "", int(r.pid or 0),
                      r.node_id or "") for r in rows]


def _gcs_actors() -> list[ActorInfo]:
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    accessor = state._connect_and_get_accessor()
    out = []
    for raw in accessor.get_actor_table(None, "ALIVE"):
        d = gcs_pb2.ActorTableData.FromString(raw)
        out.append(ActorInfo(d.actor_id.hex(), d.class_name, d.name, d.ray_namespace, int(d.pid),
                             d.address.node_id.hex()))
    return out


def target_selector(phase: str, app: str) -> Callable[[ActorInfo], bool]:
    """Which live actors a phase may kill."""
    if phase == "shard":
        return lambda a: a.class_name.split(".")[-1] == "RetrievalShard"
    if phase == "verifier":   # the TargetVerifier actor when the service has one, else the replica owns the target
        if any(is_verifier_actor(a) for a in alive_actors()):
            return is_verifier_actor
        return lambda a: a.class_name.startswith(f"ServeReplica:{app}:") and "RasdServer" in a.class_name
    if phase == "draft":
        return lambda a: a.class_name.split(".")[-1] == "DraftWorker"
    if phase == "hung":
        return is_verifier_actor
    raise ValueError(f"phase {phase!r} kills nothing")


def is_verifier_actor(actor: ActorInfo) -> bool:
    """A `TargetVerifier` (`rasd serve --verifier-actor`): named rasd-verifier-<id> in namespace rasd."""
    return actor.class_name.split(".")[-1] == "TargetVerifier"


SKIP_NOTES = {"shard": "skipped: the service has no retrieval shards (start it with --retrieval-shards N)",
              "verifier": "skipped: no RasdServer replica of this app is alive",
              "hung": "skipped: the service has no verifier actor (start it with --verifier-actor)",
              "draft": "skipped: the service has no draft workers"}


def kill_actor(actor: ActorInfo) -> str:
    """Kill one actor so that it comes back; returns how.

    A named actor (the Serve replica, draft workers) gets `ray.kill(handle, no_restart=False)`. An unnamed
    one (a retrieval shard, owned by the replica) cannot be looked up from here, so its worker process is
    killed with SIGKILL; Ray treats that as a crash and restarts the actor the same way.
    """
    import ray

    if actor.name:
        handle = ray.get_actor(actor.name, namespace=actor.namespace or None)
        ray.kill(handle, no_restart=False)
        return f"ray.kill({actor.name})"
    if actor.node_id and actor.node_id != ray.get_runtime_context().get_node_id():
        raise RuntimeError(f"{actor.class_name} {actor.actor_id[:8]} runs on another node; this script only "
                           f"kills processes on this machine")
    os.kill(actor.pid, signal.SIGKILL)
    return f"SIGKILL pid {actor.pid}"


def local_pid(actor: ActorInfo) -> int:
    """The actor's process, refused when it runs on another node (signals reach only this machine's)."""
    import ray

    if actor.node_id and actor.node_id != ray.get_runtime_context().get_node_id():
        raise RuntimeError(f"{actor.class_name} {actor.actor_id[:8]} runs on another node; this script only "
                           f"signals processes on this machine")
    return actor.pid


def wait_until(condition: Callable[[], bool], timeout_s: float, interval_s: float = POLL_S) -> float | None:
    """Seconds until `condition()` held, or None at the deadline (a raising condition counts as false)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            if condition():
                return time.monotonic() - start
        except Exception:
            pass
        time.sleep(interval_s)
    return None


def replaced(selector: Callable[[ActorInfo], bool], before: list[ActorInfo], killed: ActorInfo) -> bool:
    """As many matching actors alive as before the kill, and the killed process not among them."""
    now = [a for a in alive_actors() if selector(a)]
    alive = {(a.actor_id, a.pid) for a in now}
    return len(now) >= len(before) and (killed.actor_id, killed.pid) not in alive


# ---------------------------------------------------------------------------------------------- HTTP helpers


def healthz(url: str) -> dict[str, Any] | None:
    """The service's `/healthz` body, or None when it does not answer 200 (down, restarting)."""
    import httpx

    try:
        response = httpx.get(f"{url.rstrip('/')}/healthz", timeout=5.0)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def healthy(url: str) -> bool:
    return healthz(url) is not None


def in_flight(url: str) -> int:
    """Requests the replica is running or queueing (0 when it does not answer)."""
    body = healthz(url) or {}
    return int(body.get("running", 0)) + int(body.get("waiting", 0))


def drill_document(cfg: FaultConfig, phase: str, i: int) -> dict[str, str]:
    """A document no sample question is about (it must not change any answer's sources), with a unique
    marker to find it by afterwards."""
    marker = f"rasd-fault-{cfg.run_id}-{phase}-{i}"
    text = (f"Fault drill record {marker}. The lighthouse keeper of Skerry {i} logged {17 + i} herring boats, "
            f"a westerly gale and a lamp that stayed lit through the {phase} drill.")
    return {"id": marker, "title": f"Fault drill {marker}", "source": "rasd-fault", "text": text}


def ingest(cfg: FaultConfig, phase: str, count: int) -> list[dict[str, Any]]:
    """Add documents one at a time (no retries: an unacknowledged document is simply not promised)."""
    from rasd.client import ApiError, Client

    rows = []
    for i in range(count):
        doc = drill_document(cfg, phase, i)
        row: dict[str, Any] = {"phase": phase, "id": doc["id"], "title": doc["title"], "text": doc["text"],
                               "acknowledged": False}
        start = time.perf_counter()
        try:
            with Client(cfg.url, api_key=cfg.api_key, retries=0, timeout=cfg.request_timeout_s) as client:
                ack = client.add_documents([doc])
            row["acknowledged"] = int(ack.get("added", 0)) >= 1
        except ApiError as exc:
            row.update(status=exc.status, message=exc.message)
        except Exception as exc:   # httpx transport errors and timeouts: recorded, never raised
            row.update(message=f"{type(exc).__name__}: {exc}")
        row["latency_s"] = time.perf_counter() - start
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------- judging


def sources_key(row: dict[str, Any]) -> list[list[int]] | None:
    return row.get("sources")


def _short(message: Any, limit: int = 80) -> str:
    """One line, no table separators: error messages go into a Markdown cell."""
    text = " ".join(str(message).split()).replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def judge(rows: list[dict[str, Any]], reference: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Count a phase's outcomes; an answer is wrong when it differs from the fault-free one for the same
    question and the same retrieved sources (other sources mean another prompt, so no verdict)."""
    counts = Counter()
    errors = Counter()
    for row in rows:
        outcome = row["outcome"]
        if outcome == "ok":
            counts["completed"] += 1
            ref = reference.get(row["question"])
            if ref is None:
                counts["unchecked"] += 1
            elif sources_key(row) != sources_key(ref):
                counts["other_sources"] += 1
            elif row["answer"] != ref["answer"]:
                counts["wrong"] += 1
                row["reference_answer"] = ref["answer"]
        elif outcome in ("rejected", "error") and row.get("status") and str(row.get("message", "")).strip():
            counts["clear_errors"] += 1
            errors[f"{row['status']} {_short(row['message'])}"] += 1
        elif outcome == "timeout":
            counts["hung"] += 1
        elif outcome == "not_sent":
            counts["not_sent"] += 1
        else:
            counts["unclear_errors"] += 1
            errors[_short(row.get("message", "no status"))] += 1
    keys = ("completed", "clear_errors", "hung", "wrong", "unclear_errors", "unchecked", "other_sources", "not_sent")
    return {**{k: counts[k] for k in keys}, "requests": len(rows) - counts["not_sent"],
            "error_messages": dict(errors)}


# ---------------------------------------------------------------------------------------------- phases


def reference_pass(cfg: FaultConfig) -> dict[str, dict[str, Any]]:
    """The fault-free answers (and their sources) of every question, through the service itself."""
    level = run_level(cfg.url, cfg.api_key, cfg.questions, cfg.concurrency, cfg.params, cfg.request_timeout_s,
                      cfg.phase_timeout_s)
    ref = {r["question"]: r for r in level["rows"] if r["outcome"] == "ok"}
    for question in cfg.questions:       # one sequential retry for what the load itself turned away
        if question not in ref:
            row = ask_fresh(cfg.url, cfg.api_key, question, cfg.params, cfg.request_timeout_s)
            if row["outcome"] == "ok":
                ref[question] = row
    return ref


class RecoveryMonitor(threading.Thread):
    """From the kill on: when the killed actor is replaced and when `/healthz` answers again (seconds)."""

    def __init__(self, url: str, selector: Callable[[ActorInfo], bool] | None, before: list[ActorInfo],
                 killed: ActorInfo | None, timeout_s: float):
        super().__init__(daemon=True)
        self.url, self.selector, self.before, self.killed = url, selector, before, killed
        self.timeout_s = timeout_s
        self.start_time = time.monotonic()
        self.actor_back_s: float | None = None
        self.healthz_back_s: float | None = None

    def run(self) -> None:
        if self.killed is not None and self.selector is not None:
            waited = wait_until(lambda: replaced(self.selector, self.before, self.killed), self.timeout_s, 0.5)
            self.actor_back_s = None if waited is None else time.monotonic() - self.start_time
        left = self.timeout_s - (time.monotonic() - self.start_time)
        if wait_until(lambda: healthy(self.url), max(left, 0.0), 0.5) is not None:
            self.healthz_back_s = time.monotonic() - self.start_time


class HangMonitor(threading.Thread):
    """The `hung` phase's fault: SIGSTOP the verifier, watch `/healthz` turn 503, SIGCONT after `hang_s` (always,
    even if watching fails), then time `/healthz` back to 200 from the SIGCONT."""

    def __init__(self, url: str, pid: int, hang_s: float, timeout_s: float):
        super().__init__(daemon=True)
        self.url, self.pid, self.hang_s, self.timeout_s = url, pid, hang_s, timeout_s
        self.actor_back_s: float | None = None     # the process runs again: 0 s after the SIGCONT
        self.healthz_back_s: float | None = None   # from the SIGCONT
        self.detected_s: float | None = None       # from the SIGSTOP until /healthz said 503
        os.kill(pid, signal.SIGSTOP)
        self.stopped_at = time.monotonic()

    def run(self) -> None:
        try:
            self.detected_s = wait_until(lambda: _status(self.url) == 503, self.hang_s, 0.5)
            time.sleep(max(0.0, self.stopped_at + self.hang_s - time.monotonic()))
        finally:
            self.resume()
        if wait_until(lambda: healthy(self.url), self.timeout_s, 0.5) is not None:
            self.healthz_back_s = time.monotonic() - self.continued_at

    def resume(self) -> None:
        """SIGCONT (twice is harmless; a process already gone is no error)."""
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        if self.actor_back_s is None:
            self.continued_at, self.actor_back_s = time.monotonic(), 0.0


def _status(url: str) -> int | None:
    """`/healthz`'s HTTP status, None when it does not answer."""
    import httpx

    try:
        return httpx.get(f"{url.rstrip('/')}/healthz", timeout=5.0).status_code
    except httpx.HTTPError:
        return None


class StreamProbe(threading.Thread):
    """One streamed question through a phase: how it ended and its longest wait for an event (the first
    included), so a stream that stalls shows even when it ends well."""

    def __init__(self, cfg: FaultConfig):
        super().__init__(daemon=True)
        self.cfg = cfg
        self.row: dict[str, Any] = {"question": cfg.questions[0], "outcome": "timeout", "max_gap_s": None}

    def run(self) -> None:
        import httpx

        from rasd.client import ApiError, Client, IncompleteStream

        cfg, row = self.cfg, self.row
        last = start = time.monotonic()
        gap, answer, sources = 0.0, None, []
        try:
            with Client(cfg.url, api_key=cfg.api_key, retries=0, timeout=cfg.request_timeout_s) as client:
                for event in client.ask_stream(row["question"], **cfg.params):
                    now = time.monotonic()
                    gap, last = max(gap, now - last), now
                    answer = event.get("answer", answer)
                    sources = event.get("sources", sources)
            row.update(outcome="ok", answer=answer,
                       sources=[[s.get("doc_id"), s.get("chunk_id")] for s in sources])
        except IncompleteStream as exc:
            row.update(outcome="incomplete", message=exc.message)
        except ApiError as exc:
            row.update(outcome="error", status=exc.status, message=exc.message)
        except httpx.TimeoutException:
            row.update(outcome="timeout", message=f"no event in {cfg.request_timeout_s:.0f} s")
        except Exception as exc:   # noqa: BLE001 - recorded, never raised
            row.update(outcome="failed", message=f"{type(exc).__name__}: {exc}")
        row["max_gap_s"] = max(gap, time.monotonic() - last)
        row["latency_s"] = time.monotonic() - start


def probe(cfg: FaultConfig, reference: dict[str, dict[str, Any]], deadline: float) -> dict[str, Any]:
    """One request after the phase, retried until it completes or the deadline: the service answers again."""
    question = cfg.questions[0]
    row: dict[str, Any] = {"outcome": "not_sent"}
    while time.monotonic() < deadline:
        timeout = min(cfg.request_timeout_s, max(deadline - time.monotonic(), 1.0))
        row = ask_fresh(cfg.url, cfg.api_key, question, cfg.params, timeout)
        if row["outcome"] == "ok":
            ref = reference.get(question)
            row["same_as_reference"] = None if ref is None else (row["answer"] == ref["answer"]
                                                                 and sources_key(row) == sources_key(ref))
            return row
        time.sleep(2.0)
    return row


def pick_target(cfg: FaultConfig, phase: str) -> tuple[Callable[[ActorInfo], bool] | None, list[ActorInfo]]:
    if phase == "ingest":
        return None, []
    selector = target_selector(phase, cfg.app)
    return selector, sorted((a for a in alive_actors() if selector(a)), key=lambda a: a.actor_id)


def run_phase(cfg: FaultConfig, phase: str, reference: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Load, kill, ingest, wait for the requests, wait for recovery, probe: one row of the table."""
    selector, candidates = pick_target(cfg, phase)
    if selector is not None and not candidates:
        return {"phase": phase, "skipped": True, "notes": SKIP_NOTES[phase], "documents": []}
    deadline = time.monotonic() + cfg.phase_timeout_s
    result: dict[str, Any] = {"phase": phase, "skipped": False}
    stream = StreamProbe(cfg) if phase == "hung" else None
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(run_level, cfg.url, cfg.api_key, cfg.questions, cfg.concurrency, cfg.params,
                             cfg.request_timeout_s, cfg.phase_timeout_s)
        if stream is not None:
            stream.start()
        waited = wait_until(lambda: in_flight(cfg.url) > 0, cfg.accept_wait_s, 0.1)
        result["in_flight_at_kill"] = in_flight(cfg.url) if waited is not None else 0
        monitor = _kill(cfg, phase, selector, candidates, result)
        try:
            docs = ingest(cfg, phase, cfg.ingest_docs if phase == "ingest" else cfg.docs_per_phase)
            level = _finish(future, cfg)
        finally:
            if isinstance(monitor, HangMonitor):   # never leave the verifier stopped, whatever failed here
                monitor.join(timeout=cfg.hang_s + 10.0)
                monitor.resume()
    monitor.join(timeout=max(deadline - time.monotonic(), 1.0))
    if stream is not None:
        stream.join(timeout=cfg.request_timeout_s)
        result["stream"] = _judge_stream(stream.row, reference)
    result.update(actor_back_s=monitor.actor_back_s, healthz_back_s=monitor.healthz_back_s,
                  detected_s=getattr(monitor, "detected_s", None),
                  probe=probe(cfg, reference, deadline + cfg.request_timeout_s), documents=docs,
                  wall_s=level.get("wall_s"), rows=level["rows"], **judge(level["rows"], reference))
    result["recovery_s"] = _recovery(result)
    result["notes"] = phase_notes(result)
    return result


def _judge_stream(row: dict[str, Any], reference: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The streamed question's row, with `wrong` when it completed with another answer than the fault-free one
    over the same sources."""
    ref = reference.get(row["question"])
    row["wrong"] = bool(row["outcome"] == "ok" and ref is not None and sources_key(row) == sources_key(ref)
                        and row.get("answer") != ref["answer"])
    return row


def _kill(cfg: FaultConfig, phase: str, selector: Callable[[ActorInfo], bool] | None,
          candidates: list[ActorInfo], result: dict[str, Any]) -> RecoveryMonitor | HangMonitor:
    """Kill (or, `hung`, stop) the phase's target now (re-listed: an ingest may have replaced the shards) and
    watch it return."""
    if selector is None:
        monitor = RecoveryMonitor(cfg.url, None, [], None, cfg.phase_timeout_s)
        monitor.start()
        return monitor
    before = sorted((a for a in alive_actors() if selector(a)), key=lambda a: a.actor_id) or candidates
    victim = busiest(cfg.url, before) if phase == "hung" else before[0]
    result["killed"] = {"class_name": victim.class_name, "actor_id": victim.actor_id, "pid": victim.pid,
                        "name": victim.name}
    if phase == "hung":
        try:
            hang = HangMonitor(cfg.url, local_pid(victim), cfg.hang_s, cfg.phase_timeout_s)
        except (RuntimeError, OSError) as exc:
            result["kill"] = f"failed: {type(exc).__name__}: {exc}"
            return _kill(cfg, "ingest", None, [], {})   # nothing stopped: only wait for /healthz
        hang.start()
        result["kill"] = f"SIGSTOP pid {victim.pid} for {cfg.hang_s:g} s, then SIGCONT"
        return hang
    try:
        result["kill"] = kill_actor(victim)
    except Exception as exc:
        result["kill"] = f"failed: {type(exc).__name__}: {exc}"
    monitor = RecoveryMonitor(cfg.url, selector, before, victim, cfg.phase_timeout_s)
    monitor.start()
    return monitor


def busiest(url: str, verifiers: list[ActorInfo]) -> ActorInfo:
    """The verifier whose replica runs the most requests (`/healthz` names each replica's verifier), so that
    stopping it has requests to fail; the first one when none is named."""
    running = {r.get("verifier"): r.get("running", 0) for r in (healthz(url) or {}).get("replicas", [])}
    return max(verifiers, key=lambda a: running.get(a.name, 0))


def _finish(future: Any, cfg: FaultConfig) -> dict[str, Any]:
    """The load's rows; bounded (a level starts nothing after the phase timeout and waits per request)."""
    try:
        return future.result(timeout=cfg.phase_timeout_s + 2 * cfg.request_timeout_s)
    except FutureTimeout:
        return {"rows": [{"question": q, "outcome": "timeout", "message": "the phase never finished"}
                         for q in cfg.questions], "wall_s": None}


def _recovery(result: dict[str, Any]) -> float | None:
    """Seconds from the kill until the actor was replaced and `/healthz` answered (None: never, in time)."""
    times = [result.get("healthz_back_s")]
    if result.get("killed"):
        times.append(result.get("actor_back_s"))
    return None if any(t is None for t in times) else max(times)


def phase_notes(result: dict[str, Any]) -> str:
    notes = []
    if result.get("kill"):
        notes.append(f"killed {result['killed']['class_name']} ({result['kill']}) with "
                     f"{result['in_flight_at_kill']} requests in flight")
    docs = result.get("documents", [])
    if docs:
        notes.append(f"{sum(d['acknowledged'] for d in docs)}/{len(docs)} documents acknowledged")
    for key, label in (("unclear_errors", "failed without an HTTP status"), ("not_sent", "not sent"),
                       ("other_sources", "retrieved other sources"), ("unchecked", "had no reference")):
        if result.get(key):
            notes.append(f"{result[key]} {label}")
    for message, n in result.get("error_messages", {}).items():
        notes.append(f"{n}x {message}")
    if result["phase"] == "hung":
        detected = result.get("detected_s")
        notes.append("/healthz never said 503 while the verifier was stopped" if detected is None else
                     f"/healthz 503 after {detected:.1f} s")
    stream = result.get("stream")
    if stream is not None:
        notes.append(f"stream: {stream['outcome']}" + (f" {stream['status']}" if stream.get("status") else "")
                     + (" WRONG" if stream["wrong"] else ""))
    probe_row = result.get("probe", {})
    notes.append("probe answered" + ("" if probe_row.get("same_as_reference") in (True, None) else
                                     " DIFFERENTLY") if probe_row.get("outcome") == "ok" else
                 f"probe failed ({probe_row.get('outcome')})")
    return "; ".join(notes)


# ---------------------------------------------------------------------------------------------- durability


def resolve_index(spec: str | None) -> str | None:
    if spec == "sample":
        from rasd.apps.sample_corpus import sample_index_path

        return str(sample_index_path())
    return spec


def check_on_disk(index_path: str, docs: list[dict[str, Any]]) -> None:
    """Acknowledged = committed: a fresh `Index.open` must hold each document, and a search on its text must
    find it (sets `on_disk` and `searchable` per document)."""
    from rasd.index.store import Index

    index = Index.open(index_path)
    stored = {d.external_id for d in index.documents(range(index.num_documents))}
    hits = index.search_batch([d["text"] for d in docs], k=3) if docs else []
    for doc, found in zip(docs, hits, strict=True):
        doc["on_disk"] = doc["id"] in stored
        doc["searchable"] = any(h.external_id == doc["id"] or doc["id"] in h.text for h in found)


def check_served(cfg: FaultConfig, docs: list[dict[str, Any]]) -> None:
    """The service (restarted replica and shards included) retrieves each document as a docqa source."""
    from rasd.client import Client

    with Client(cfg.url, api_key=cfg.api_key, retries=2, timeout=cfg.request_timeout_s) as client:
        for doc in docs:
            try:
                answer = client.ask(doc["text"], max_tokens=1, top_k_sources=3, method="ar")
                doc["served"] = any(doc["id"] in (s.get("text", "") + s.get("title", "")) for s in answer.sources)
            except Exception as exc:
                doc["served"], doc["served_error"] = False, f"{type(exc).__name__}: {exc}"


def check_documents(cfg: FaultConfig, docs: list[dict[str, Any]]) -> dict[str, Any]:
    acked = [d for d in docs if d["acknowledged"]]
    if cfg.index:
        check_on_disk(cfg.index, acked)
    check_served(cfg, acked)
    lost = [d["id"] for d in acked if not d["served"] or (cfg.index and not (d["on_disk"] and d["searchable"]))]
    return {"sent": len(docs), "acknowledged": len(acked),
            "on_disk": sum(bool(d.get("on_disk")) for d in acked) if cfg.index else None,
            "searchable": sum(bool(d.get("searchable")) for d in acked) if cfg.index else None,
            "served": sum(bool(d.get("served")) for d in acked), "lost": lost}


# ---------------------------------------------------------------------------------------------- the run


def run_fault(cfg: FaultConfig) -> dict[str, Any]:
    """Reference pass, then every phase, then the durability check; the summary the table is printed from."""
    from tqdm import tqdm

    unknown = [p for p in cfg.phases if p not in PHASES]
    if unknown:
        raise ValueError(f"unknown phases {unknown}; choose from {', '.join(PHASES)}")
    start = time.monotonic()
    print(f"fault-free reference: {len(cfg.questions)} questions ...", file=sys.stderr, flush=True)
    reference = reference_pass(cfg)
    phases = []
    for phase in tqdm(cfg.phases, desc="fault phases", file=sys.stderr):
        phases.append(run_phase(cfg, phase, reference))
    documents = [d for p in phases for d in p.get("documents", [])]
    durability = check_documents(cfg, documents)
    summary = {"url": cfg.url, "app": cfg.app, "run_id": cfg.run_id, "questions": cfg.questions,
               "concurrency": cfg.concurrency, "params": cfg.params, "request_timeout_s": cfg.request_timeout_s,
               "reference_answers": len(reference), "phases": phases, "documents": documents,
               "durability": durability, "wall_s": time.monotonic() - start}
    summary["violations"] = violations(summary)
    return summary


def violations(summary: dict[str, Any]) -> list[str]:
    """What broke a promise (empty: none did)."""
    out = []
    for p in summary["phases"]:
        if p.get("skipped"):
            continue
        for key, what in (("hung", "hung"), ("wrong", "returned wrong tokens"),
                          ("unclear_errors", "failed without a clear HTTP error")):
            if p.get(key):
                out.append(f"{p['phase']}: {p[key]} requests {what}")
        if p["probe"].get("outcome") != "ok" or p["probe"].get("same_as_reference") is False:
            out.append(f"{p['phase']}: the service did not answer correctly after recovery")
        if str(p.get("kill", "")).startswith("failed"):
            out.append(f"{p['phase']}: the kill {p['kill']}")
        if p["phase"] == "hung" and p.get("detected_s") is None:
            out.append("hung: /healthz never reported the stopped verifier")
        stream = p.get("stream")
        if stream is not None and (stream["wrong"] or stream["outcome"] not in ("ok", "error")):
            out.append(f"{p['phase']}: the streamed question ended {stream['outcome']}"
                       + (" with a wrong answer" if stream["wrong"] else ""))
    if summary["durability"]["lost"]:
        out.append(f"acknowledged documents not found: {', '.join(summary['durability']['lost'])}")
    return out


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_fault_table(summary: dict[str, Any]) -> str:
    """Markdown: one row per phase, then the durability line and any broken promise."""
    lines = ["| phase | requests | completed | clear errors | hung | wrong tokens | recovery s | max stream gap s "
             "| notes |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for p in summary["phases"]:
        if p.get("skipped"):
            lines.append(f"| {p['phase']} | - | - | - | - | - | - | - | {p['notes']} |")
            continue
        gap = _cell((p.get("stream") or {}).get("max_gap_s"))
        lines.append(f"| {p['phase']} | {p['requests']} | {p['completed']} | {p['clear_errors']} | {p['hung']} | "
                     f"{p['wrong']} | {_cell(p['recovery_s'])} | {gap} | {p['notes']} |")
    d = summary["durability"]
    disk = "" if d["on_disk"] is None else f", {d['on_disk']} on disk, {d['searchable']} found by search"
    lines.append(f"\ndocuments: {d['acknowledged']}/{d['sent']} acknowledged{disk}, {d['served']} retrieved by "
                 f"the service; lost: {len(d['lost'])}")
    lines.append("promises kept" if not summary["violations"] else
                 "BROKEN: " + "; ".join(summary["violations"]))
    return "\n".join(lines)


def run_fault_cli(args: Any) -> int:
    from rasd.client import Client
    from rasd.errors import CliError

    check_loopback(args.url)
    try:
        Client(args.url, api_key=args.api_key, retries=0).health()
    except Exception as exc:
        raise CliError(f"no service at {args.url} ({exc}); start one with `rasd serve --index ... --detach "
                       f"--retrieval-shards 2`") from exc
    if args.concurrency < 1 or args.requests_per_phase < 1:
        raise CliError("--concurrency and --requests-per-phase must be at least 1")
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if not phases or any(p not in PHASES for p in phases):
        raise CliError(f"--phases takes a comma-separated list from {','.join(PHASES)}")
    index = resolve_index(args.index)
    if index and not (Path(index) / "manifest.json").exists():
        raise CliError(f"no index at {index}")
    questions = [SAMPLE_QUESTIONS[i % len(SAMPLE_QUESTIONS)] for i in range(args.requests_per_phase)]
    cfg = FaultConfig(url=args.url, api_key=args.api_key, index=index, app=args.app, phases=phases,
                      questions=questions, concurrency=args.concurrency,
                      params={"max_tokens": args.max_tokens, "method": args.method,
                              "top_k_sources": args.top_k_sources, "temperature": 0},
                      docs_per_phase=args.docs_per_phase, ingest_docs=args.ingest_docs, hang_s=args.hang_s,
                      request_timeout_s=args.request_timeout, phase_timeout_s=args.phase_timeout)
    connect_ray(args.address)
    summary = run_fault(cfg)
    print(format_fault_table(summary))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1, default=_jsonable))
    return 1 if summary["violations"] else 0


def _jsonable(value: Any) -> Any:
    return asdict(value) if hasattr(value, "__dataclass_fields__") else str(value)
