"""Durable file-system steps: fsync, atomic JSON replace, checksums, a writer lock, crash hooks for tests.

Why each piece:
- A rename is atomic but not durable until the directory is fsynced, and the renamed files' data is only
  safe once the files themselves were fsynced; so write → fsync files → fsync dir → rename → fsync parent.
- A new directory's entry lives in its parent: `mkdir_durable` fsyncs the parent after each mkdir, so a file
  fsynced inside a new directory is not lost with the directory after a power cut.
- One writer at a time per index (an flock on DIR/.lock, released by the kernel if the writer dies). Where
  locks do not hold across nodes the index's commit is a compare-and-swap as well (`rasd.index.manifest`).
- `RASD_INDEX_CRASH_AT=<stage>` makes the process `os._exit` at that stage, so a test can kill a real
  process at exactly the points where a crash could corrupt the index.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CRASH_ENV = "RASD_INDEX_CRASH_AT"
CRASH_EXIT_CODE = 77
LOCK_NAME = ".lock"


def crash_point(stage: str) -> None:
    """Exit immediately (no cleanup, no flush) when the crash-test hook names this stage."""
    if os.environ.get(CRASH_ENV) == stage:
        os._exit(CRASH_EXIT_CODE)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (creations, renames, removals) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def mkdir_durable(path: Path) -> None:
    """Create `path` and any missing parents, fsyncing each new directory's parent (its entry lives there)."""
    path = Path(path)
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder)
        except FileExistsError:
            if not folder.is_dir():
                raise
            continue
        fsync_dir(folder.parent)


def write_file_durable(path: Path, data: bytes) -> None:
    """Write `data` to a new file and fsync it (its directory entry is the caller's to fsync)."""
    with open(path, "xb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def sha256_file(path: Path, block: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            digest.update(chunk)
    return digest.hexdigest()


SAMPLED_BLOCKS, SAMPLED_BLOCK_BYTES = 32, 64 << 10


def sampled_sha256(path: Path, size: int | None = None) -> str:
    """sha256 of the size and SAMPLED_BLOCKS evenly spaced blocks (first and last included): a check cheap
    enough for every open of a file too large to hash in full each time (a flipped byte between the blocks
    goes unseen: the full sha256 is for `verify`)."""
    size = path.stat().st_size if size is None else size
    digest = hashlib.sha256(str(size).encode())
    span = max(size - SAMPLED_BLOCK_BYTES, 0)
    with open(path, "rb") as fh:
        for i in range(SAMPLED_BLOCKS):
            fh.seek(span * i // (SAMPLED_BLOCKS - 1))
            digest.update(fh.read(SAMPLED_BLOCK_BYTES))
    return digest.hexdigest()


@contextlib.contextmanager
def atomic_file(path: Path | str, mode: str = "w", stage: str | None = None, tag: str = "") -> Iterator[Any]:
    """Open a temporary sibling of `path` for writing; on a clean exit fsync it, rename it over `path` and
    fsync the directory. Readers see the old file or the new one, never half of one; on an error the
    temporary is removed and `path` is untouched. `stage` names the crash hook before the rename; `tag` goes
    into the temporary's name (a leftover-cleaning writer reads it)."""
    path = Path(path)
    mkdir_durable(path.parent)
    # `<name>.tmp-<tag><pid>-<thread>`: unique per writer, and recognisable as a leftover after a crash
    tmp = path.with_name(f"{path.name}.tmp-{tag}{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        if stage:
            crash_point(stage)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def write_json_atomic(path: Path, obj: Any, stage: str | None = None, tag: str = "") -> None:
    """Write JSON to a temporary sibling, fsync, rename over `path`, fsync the directory.

    The rename is the commit point: readers see either the old file or the new one, never a mix.
    `stage` names the crash hook between the fsynced temporary and the rename.
    """
    with atomic_file(path, stage=stage, tag=tag) as fh:
        json.dump(obj, fh, indent=2, sort_keys=False)
        fh.write("\n")


class LockTimeout(TimeoutError):
    """Another writer held the index's lock for longer than the caller would wait."""


@contextlib.contextmanager
def writer_lock(root: Path, timeout_s: float | None = None) -> Iterator[None]:
    """Hold the index's exclusive writer lock: wait for another writer to finish, for ever (a CLI) or at most
    `timeout_s` (a service: a request must not hang on a writer that never ends), then `LockTimeout`."""
    fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _acquire(fd, root, timeout_s)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _acquire(fd: int, root: Path, timeout_s: float | None) -> None:
    if timeout_s is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise LockTimeout(f"{root}: another writer has held the index lock for over {timeout_s:g} s; "
                                  "retry when it is done") from None
            time.sleep(0.05)
