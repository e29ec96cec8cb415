"""The replica's ingest queue: one worker thread, a bounded wait list, and a record (a job) per ingest.

Why its own thread: ingest used to run in asyncio's default executor, which also tokenizes every prompt, and
waited there on the in-process ingest lock without a timeout; a handful of concurrent ingests held every
worker of that executor and new requests stalled behind them. Here one thread ingests, `max_waiting` more may
wait, and one more is a 429 at once with `Retry-After`, so the default executor stays free for prompts.

Every ingest is a job (`IngestJob`). The HTTP answer to a small one waits for it; a large one, or one sent
with `"async": true`, is answered 202 at once and polled (`GET /v1/documents/jobs/ID`). A job's record is kept
in memory for the replica's lifetime (the documents themselves only until it ends) and written under the
index (`<index>/ingest-jobs/ID.json`) at each change, so that another replica, or the one that replaced a
dead one, can say what became of it: a record left queued or running by a replica that no longer runs is
reported failed (`settled`), never running forever. With an Idempotency-Key the job's id is derived from the
key, so a re-post finds its job wherever it is answered.
"""

from __future__ import annotations

import json
import logging
import math
import re
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from rasd.errors import ApiError
from rasd.fsio import write_json_atomic

log = logging.getLogger(__name__)

JOBS_DIR = "ingest-jobs"                     # under the index folder
JOB_ID = re.compile(r"^ingest-[0-9a-f]{16,64}$")
ACTIVE = ("queued", "running")
SAVE_EVERY_S = 1.0                           # progress is written at most this often
KEEP_JOBS = 10_000                           # finished records kept in memory (the oldest dropped first)
KEEP_RECORDS_S = 7 * 86_400                  # stored records older than this are removed when a replica starts
DEFAULT_RETRY_AFTER_S = 10
# share of a job's progress per stage: embedding is nearly all of an ingest's time (99% in a 1 MB profile)
STAGES = {"tokenizing": (0.0, 0.02), "embedding": (0.02, 0.97), "writing": (0.97, 0.99)}

Progress = Callable[[str, int, int], None]   # (stage, done, total): `rasd.index.writer.OnProgress`


def status_url(job_id: str) -> str:
    return f"/v1/documents/jobs/{job_id}"


def job_id_for(key_hash: str | None) -> str:
    """A key's job id is its hash's (so every replica finds the job of a re-post); a new random id without one."""
    return f"ingest-{key_hash[:32]}" if key_hash else f"ingest-{secrets.token_hex(16)}"


@dataclass
class IngestJob:
    """One ingest: what was sent (sizes and hashes, not the text), where it runs, how far it is, how it ended."""

    id: str
    replica: str                            # the replica that runs it
    documents: int
    text_bytes: int
    key: str | None = None                  # sha256 of the Idempotency-Key
    body: str | None = None                 # sha256 of the documents
    status: str = "queued"                  # queued | running | done | failed
    stage: str = "queued"
    progress: float = 0.0
    added: int | None = None
    result: dict[str, Any] | None = None    # the synchronous answer: added, num_documents, num_chunks
    error: dict[str, Any] | None = None     # OpenAI's error object: message, type, param, code
    attempts: int = 1
    created: float = field(default_factory=time.time)
    started: float | None = None
    updated: float = field(default_factory=time.time)
    future: Future[dict[str, Any]] | None = field(default=None, repr=False, compare=False)

    def record(self) -> dict[str, Any]:
        """What is stored under the index: the status answer and the hashes a re-post is checked against."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("id", "future")}
        return {"job": self.id, "status_url": status_url(self.id), **values, "progress": round(self.progress, 4)}

    def view(self) -> dict[str, Any]:
        """The status answer."""
        return public(self.record())

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> IngestJob:
        names = {f.name for f in fields(cls)} - {"id", "future"}
        return cls(id=record["job"], **{k: v for k, v in record.items() if k in names})


def public(record: dict[str, Any]) -> dict[str, Any]:
    """A record without the hashes of the key and the documents."""
    return {k: v for k, v in record.items() if k not in ("key", "body")}


def settled(record: dict[str, Any], running_replicas: set[str]) -> dict[str, Any]:
    """A stored record as it stands: one left queued or running by a replica that is no longer running (it died,
    or the service restarted) failed, with that reason. `running_replicas`: every replica that answered."""
    if record["status"] not in ACTIVE or record["replica"] in running_replicas:
        return record
    message = (f"the replica that ran this ingest ({record['replica']}) stopped before it was committed (it died or "
               "the service restarted); post it again with the same Idempotency-Key to run it again")
    return {**record, "status": "failed", "stage": "failed",
            "error": {"message": message, "type": "service_unavailable", "param": None, "code": 503}}


class IngestQueue:
    """One ingest at a time on its own thread, up to `max_waiting` more queued; every job's record."""

    def __init__(self, root: Path | None, owner: str, max_waiting: int):
        """`root`: the index folder (records are written under it; None: kept in memory only)."""
        self.folder = None if root is None else Path(root) / JOBS_DIR
        self.owner, self.max_waiting = owner, max_waiting
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rasd-ingest")
        self._lock = threading.Lock()
        self._jobs: dict[str, IngestJob] = {}
        self._pending = 0                    # queued + running: the places taken
        self._saved: dict[str, float] = {}
        self._prune()

    # ------------------------------------------------------------------ records
    def get(self, job_id: str) -> IngestJob | None:
        """The job as this replica knows it: in memory, else its stored record (None: unknown here)."""
        with self._lock:
            job = self._jobs.get(job_id)
        if job is not None:
            return job
        record = self.stored(job_id)
        return None if record is None else IngestJob.from_record(record)

    def stored(self, job_id: str) -> dict[str, Any] | None:
        """The record under the index (None: none, or unreadable: a torn or foreign file is logged)."""
        if self.folder is None or not JOB_ID.match(job_id):
            return None
        path = self.folder / f"{job_id}.json"
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("%s: unreadable ingest job record (%s)", path, exc)
            return None

    def _prune(self) -> None:
        """Remove stored records (and a crashed writer's temporaries) older than KEEP_RECORDS_S."""
        if self.folder is None or not self.folder.is_dir():
            return
        old = time.time() - KEEP_RECORDS_S
        for path in self.folder.glob("ingest-*.json*"):
            try:
                if path.stat().st_mtime < old:
                    path.unlink()
            except OSError:
                continue

    def _save(self, job: IngestJob, force: bool = True) -> None:
        """Write the record (at most every SAVE_EVERY_S unless `force`); a failed write is logged, never fatal."""
        now = time.monotonic()
        if self.folder is None or (not force and now - self._saved.get(job.id, 0.0) < SAVE_EVERY_S):
            return
        self._saved[job.id] = now
        try:
            write_json_atomic(self.folder / f"{job.id}.json", job.record())
        except OSError as exc:
            log.warning("cannot write the ingest job record %s: %s", job.id, exc)

    # ------------------------------------------------------------------ the queue
    def submit(self, job: IngestJob, work: Callable[[Progress], dict[str, Any]]) -> IngestJob:
        """Queue `work(progress)` as `job`; a 429 with Retry-After at once when every place is taken."""
        with self._lock:
            if self._pending > self.max_waiting:
                raise ApiError(429, f"the ingest queue is full ({self._pending} ingests running or waiting); "
                                    "retry later", "rate_limit_error",
                               headers={"Retry-After": str(self._retry_after_s())})
            self._pending += 1
            self._jobs.pop(job.id, None)
            self._jobs[job.id] = job
            self._trim()
        job.replica = self.owner
        self._save(job)
        job.future = self._executor.submit(self._run, job, work)
        return job

    def load(self) -> int:
        """Ingests running or waiting here."""
        with self._lock:
            return self._pending

    def close(self) -> None:
        """Replica shutdown: queued ingests are dropped (their records stay queued, read as failed later)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _run(self, job: IngestJob, work: Callable[[Progress], dict[str, Any]]) -> dict[str, Any]:
        job.status, job.stage, job.started = "running", "starting", time.time()
        self._touch(job)
        try:
            result = work(lambda stage, done, total: self._progress(job, stage, done, total))
        except ApiError as exc:
            self._end(job, "failed", error=exc.body()["error"])
            raise
        except Exception as exc:
            log.exception("ingest %s failed", job.id)
            failure = ApiError(500, f"the ingest failed: {type(exc).__name__}: {exc}", "server_error")
            self._end(job, "failed", error=failure.body()["error"])
            raise failure from exc
        self._end(job, "done", result=result)
        return result

    def _progress(self, job: IngestJob, stage: str, done: int, total: int) -> None:
        low, high = STAGES.get(stage, (job.progress, job.progress))
        job.stage = stage
        job.progress = max(job.progress, low + (high - low) * (done / total if total else 1.0))
        self._touch(job, force=False)

    def _touch(self, job: IngestJob, force: bool = True) -> None:
        job.updated = time.time()
        self._save(job, force)

    def _end(self, job: IngestJob, status: str, result: dict[str, Any] | None = None,
             error: dict[str, Any] | None = None) -> None:
        with self._lock:
            self._pending -= 1
        job.status, job.stage, job.result, job.error = status, status, result, error
        if result is not None:
            job.added, job.progress = result.get("added"), 1.0
        self._touch(job)
        self._saved.pop(job.id, None)

    def _trim(self) -> None:
        """Forget the oldest finished jobs beyond KEEP_JOBS (their records stay on disk). Lock held."""
        finished = [i for i, j in self._jobs.items() if j.status not in ACTIVE]
        for job_id in finished[:max(0, len(self._jobs) - KEEP_JOBS)]:
            del self._jobs[job_id]

    def _retry_after_s(self) -> int:
        """When a place should free: the running job's remaining time at its pace so far. Lock held."""
        running = next((j for j in self._jobs.values() if j.status == "running"), None)
        if running is None or running.started is None or running.progress < 0.05:
            return DEFAULT_RETRY_AFTER_S
        elapsed = time.time() - running.started
        return int(min(max(math.ceil(elapsed * (1 - running.progress) / running.progress), 1), 3600))
