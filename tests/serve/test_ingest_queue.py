"""The replica's ingest queue (`rasd.serve.ingest`) without Ray or a model: one ingest at a time on its own
thread, a bounded wait list (then 429 at once with Retry-After), and job records that tell progress and
outcome, stored under the index so that a stopped replica's job reads failed, never running forever."""

from __future__ import annotations

import json
import pickle
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from rasd.errors import ApiError
from rasd.serve.ingest import JOBS_DIR, IngestJob, IngestQueue, job_id_for, settled


def blocked_work(release: threading.Event, running: list[int], seen: list[int]) -> Any:
    """Work that waits for `release` and records how many ran at once."""
    def work(progress: Any) -> dict[str, Any]:
        running.append(1)
        seen.append(len(running))
        try:
            assert release.wait(10)
            return {"added": 1, "num_documents": 1, "num_chunks": 1}
        finally:
            running.pop()
    return work


def new_job(queue: IngestQueue, key: str | None = None) -> IngestJob:
    return IngestJob(job_id_for(key), queue.owner, documents=1, text_bytes=10)


def test_a_full_queue_refuses_at_once_with_retry_after_and_runs_one_at_a_time(tmp_path: Path) -> None:
    queue = IngestQueue(tmp_path, "replica-a", max_waiting=2)
    release, running, seen = threading.Event(), [], []
    try:
        jobs = [queue.submit(new_job(queue), blocked_work(release, running, seen)) for _ in range(3)]
        start = time.monotonic()
        with pytest.raises(ApiError) as refused:
            queue.submit(new_job(queue), blocked_work(release, running, seen))
        assert time.monotonic() - start < 0.5
        assert refused.value.status == 429 and refused.value.type == "rate_limit_error"
        assert int(refused.value.headers["Retry-After"]) >= 1
        assert refused.value.body()["error"]["code"] == 429
        assert [j.status for j in jobs[1:]] == ["queued", "queued"] and queue.load() == 3
    finally:
        release.set()
    assert [j.future.result(10)["added"] for j in jobs] == [1, 1, 1]
    assert max(seen) == 1, "ingests ran side by side"
    assert queue.load() == 0 and all(j.status == "done" and j.progress == 1.0 for j in jobs)
    queue.submit(new_job(queue), blocked_work(release, running, seen)).future.result(10)   # room again


def test_a_retry_after_follows_the_running_jobs_pace(tmp_path: Path) -> None:
    queue = IngestQueue(tmp_path, "replica-a", max_waiting=0)
    reported, release = threading.Event(), threading.Event()

    def half_way(progress: Any) -> dict[str, Any]:
        progress("embedding", 50, 100)
        reported.set()
        assert release.wait(10)
        return {"added": 1}

    job = queue.submit(new_job(queue), half_way)
    try:
        assert reported.wait(10)
        job.started = time.time() - 100          # half of the embedding took about 100 s
        with pytest.raises(ApiError) as refused:
            queue.submit(new_job(queue), half_way)
        assert 60 <= int(refused.value.headers["Retry-After"]) <= 140
    finally:
        release.set()
    job.future.result(10)


def test_records_show_real_progress_and_are_stored_under_the_index(tmp_path: Path) -> None:
    queue = IngestQueue(tmp_path, "replica-a", max_waiting=2)
    steps: list[float] = []

    def work(progress: Any) -> dict[str, Any]:
        progress("tokenizing", 0, 3)
        for done in range(0, 100, 25):
            progress("embedding", done, 100)
            steps.append(queue.get(job.id).progress)
        progress("writing", 0, 1)
        stored = queue.stored(job.id)
        assert stored is not None and stored["status"] == "running" and stored["replica"] == "replica-a"
        return {"added": 3, "num_documents": 7, "num_chunks": 9}

    job = queue.submit(new_job(queue, "ab" * 32), work)
    assert job.future.result(10)["added"] == 3
    assert steps == sorted(steps) and 0.0 < steps[0] < steps[-1] < 0.97, steps
    record = json.loads((tmp_path / JOBS_DIR / f"{job.id}.json").read_text())
    assert record["status"] == "done" and record["progress"] == 1.0 and record["added"] == 3
    assert record["result"]["num_chunks"] == 9 and record["key"] is None
    assert "key" not in job.view() and job.view()["status_url"] == f"/v1/documents/jobs/{job.id}"
    assert IngestQueue(tmp_path, "replica-b", 2).get(job.id).status == "done"   # another replica reads it


def test_a_failed_ingest_keeps_its_error_and_raises_it_to_whoever_waits(tmp_path: Path) -> None:
    queue = IngestQueue(tmp_path, "replica-a", max_waiting=2)

    def refused(progress: Any) -> dict[str, Any]:
        raise ApiError(503, "another writer holds the index", "service_unavailable")

    def broken(progress: Any) -> dict[str, Any]:
        raise RuntimeError("disk on fire")

    first = queue.submit(new_job(queue), refused)
    with pytest.raises(ApiError) as info:
        first.future.result(10)
    assert info.value.status == 503 and first.status == "failed" and first.error["code"] == 503
    second = queue.submit(new_job(queue), broken)
    with pytest.raises(ApiError) as info:
        second.future.result(10)
    assert info.value.status == 500 and "disk on fire" in second.error["message"]
    assert queue.stored(second.id)["status"] == "failed" and queue.load() == 0


def test_a_record_left_running_by_a_replica_that_stopped_reads_failed() -> None:
    record = IngestJob("ingest-" + "0" * 32, "replica-gone", 1, 10, status="running").record()
    failed = settled(record, {"replica-new"})
    assert failed["status"] == "failed" and failed["error"]["code"] == 503
    assert "replica-gone" in failed["error"]["message"] and "Idempotency-Key" in failed["error"]["message"]
    assert settled(record, {"replica-gone", "replica-new"})["status"] == "running"   # its replica still runs
    done = {**record, "status": "done"}
    assert settled(done, set()) == done


def test_job_ids_are_safe_file_names_and_a_keys_id_is_stable(tmp_path: Path) -> None:
    queue = IngestQueue(tmp_path, "replica-a", 0)
    assert job_id_for("ab" * 32) == job_id_for("ab" * 32) != job_id_for(None)
    assert queue.stored("../../etc/passwd") is None and queue.stored("ingest-zz") is None


def test_an_api_error_keeps_its_headers_across_processes() -> None:
    error = pickle.loads(pickle.dumps(ApiError(429, "full", "rate_limit_error", headers={"Retry-After": "7"})))
    assert (error.status, error.headers) == (429, {"Retry-After": "7"})


def test_old_records_are_removed_when_a_replica_starts(tmp_path: Path) -> None:
    import os

    from rasd.serve.ingest import KEEP_RECORDS_S

    folder = tmp_path / JOBS_DIR
    folder.mkdir()
    old, recent = folder / f"{job_id_for(None)}.json", folder / f"{job_id_for(None)}.json"
    for path in (old, recent):
        path.write_text("{}")
    stale = time.time() - KEEP_RECORDS_S - 60
    os.utime(old, (stale, stale))
    IngestQueue(tmp_path, "replica-a", 0)
    assert not old.exists() and recent.exists()
