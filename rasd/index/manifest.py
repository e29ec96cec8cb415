"""The manifest: the one file that says what an index is. Committing a new manifest is the commit.

Why the commit is a compare-and-swap, not only a rename under a lock: on a network filesystem whose locks do
not hold across nodes two writers can both read generation N and both write N+1; with a plain rename the
last one wins and the other's acknowledged segment is later cleaned up as a leftover. So each commit is a
numbered file, `manifest-<N+1>.json`, hard-linked into place from a fsynced temporary: `link` fails when
the name exists (atomic also over NFS), so exactly one writer gets N+1 and the other learns it lost
(`CommitConflict`) before anything of its write is visible. `manifest.json` is then replaced by a copy, for
readers of the old format and as a second copy; a reader takes whichever of it and the newest numbered
manifest is the later generation (equal: `manifest.json`), so a crash between the two steps loses nothing,
and a corrupt `manifest.json` falls back to the numbered one. Indexes written before generations existed
(no numbered files, no "generation" field) open as generation 0 and commit generation 1 next.

Readers trust only segments listed here, with the byte sizes listed here. Checksums (sha256 per file,
recorded at write) are checked at open for files up to FULL_CHECK_BYTES, once per process and file; larger
files are checked by a sampled digest (`rasd.fsio.sampled_sha256`, recorded at write by this version on), and in
full with `verify=True` (`rasd index info --verify`, and always before compaction, so corruption is never
copied into a new segment).
"""

from __future__ import annotations

import datetime as dt
import errno
import json
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rasd.fsio import crash_point, fsync_dir, sampled_sha256, sha256_file, write_file_durable, write_json_atomic
from rasd.index.errors import CommitConflict, IndexOpenError, IndexStoreError
from rasd.index.segment import FULL_CHECK_BYTES, SEGMENT_FILES

log = logging.getLogger("rasd.index")

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "rasd-index"
FORMAT_VERSION = 1
KEEP_GENERATIONS = 8          # numbered manifests kept behind the newest (older ones are removed)
_GENERATION_RE = re.compile(r"^manifest-(\d{8,})\.json$")
_REQUIRED = ("format", "format_version", "tokenizer", "embedder", "chunking", "faiss", "segments", "next_segment")
_SEGMENT_REQUIRED = ("name", "doc_id_start", "num_documents", "chunk_id_start", "num_chunks", "num_tokens",
                     "faiss", "files")


class _CorruptManifest(IndexOpenError):
    """Unreadable or structurally broken (a fallback may apply), as opposed to a version this rasd cannot read."""


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def new_manifest(tokenizer: dict[str, Any], embedder: dict[str, Any], chunk_tokens: int, overlap: int,
                 faiss_kind: str) -> dict[str, Any]:
    """A manifest without segments; `faiss` is the kind requested for every segment built later."""
    created = now_iso()
    return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "created": created, "updated": created,
            "tokenizer": tokenizer, "embedder": embedder,
            "chunking": {"chunk_tokens": chunk_tokens, "overlap": overlap}, "faiss": faiss_kind,
            "next_segment": 1, "generation": 0, "segments": []}


def totals(manifest: dict[str, Any]) -> dict[str, int]:
    """Documents, chunks and tokens summed over segments."""
    segs = manifest["segments"]
    return {key: sum(int(s[f"num_{key}"]) for s in segs) for key in ("documents", "chunks", "tokens")}


# --------------------------------------------------------------------------------------------- generations


def generation(manifest: dict[str, Any]) -> int:
    """The manifest's commit number (0: written before generations existed, or not committed yet)."""
    return int(manifest.get("generation", 0))


def generation_path(root: Path, gen: int) -> Path:
    return Path(root) / f"manifest-{gen:08d}.json"


def numbered_generations(root: Path) -> list[int]:
    """Generations of the numbered manifests in `root`, newest first."""
    found = (_GENERATION_RE.match(name) for name in os.listdir(root))
    return sorted((int(m.group(1)) for m in found if m), reverse=True)


def has_manifest(root: Path) -> bool:
    """Whether `root` holds an index (a manifest.json or a numbered manifest), readable or not."""
    return (root / MANIFEST_NAME).exists() or bool(numbered_generations(root))


@dataclass(frozen=True)
class Stamp:
    """What a reader saw: manifest.json's inode, size and mtime, and the generation it resolved to."""

    ino: int
    size: int
    mtime_ns: int
    generation: int


def _stat_triple(root: Path) -> tuple[int, int, int]:
    try:
        st = os.stat(Path(root) / MANIFEST_NAME)
    except OSError:
        return -1, -1, -1
    return st.st_ino, st.st_size, st.st_mtime_ns


def stamp_changed(root: str | Path, stamp: Stamp | None) -> bool:
    """Whether any writer committed since `stamp` was taken (two stats: cheap enough for every request)."""
    if stamp is None:
        return True
    return _stat_triple(Path(root)) != (stamp.ino, stamp.size, stamp.mtime_ns) or \
        generation_path(Path(root), stamp.generation + 1).exists()


# --------------------------------------------------------------------------------------------- commit


def commit_manifest(root: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Commit `manifest` as the generation after the one it was read at; returns what was committed.

    CommitConflict when another writer committed that generation first (nothing of this one is visible).
    """
    root = Path(root)
    gen = generation(manifest) + 1
    manifest = dict(manifest, generation=gen, updated=now_iso(), totals=totals(manifest))
    newer = [g for g in numbered_generations(root) if g >= gen]
    if newer:
        raise _conflict(root, gen)
    _claim(root, gen, (json.dumps(manifest, indent=2) + "\n").encode("utf-8"))
    crash_point("manifest-claimed")
    _publish(root, manifest)
    return manifest


def _conflict(root: Path, gen: int) -> CommitConflict:
    return CommitConflict(f"{root}: another writer committed index generation {gen} first (its lock did not "
                          "exclude this one); nothing of this write was committed; retry it")


def _claim(root: Path, gen: int, data: bytes) -> None:
    """Make `manifest-<gen>.json` exist with `data`, or CommitConflict: the compare-and-swap."""
    target = generation_path(root, gen)
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        write_file_durable(tmp, data)
        crash_point("manifest-temp")
        os.link(tmp, target)            # fails if the name exists: never replaces another writer's commit
    except FileExistsError:
        raise _conflict(root, gen) from None
    except FileNotFoundError:           # our temporary was cleaned by a writer that committed past `gen`
        raise _conflict(root, gen) from None
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
            raise IndexStoreError(f"{root}: this filesystem has no hard links ({exc.strerror}); rasd commits an "
                                  "index with one, so that two writers can never both commit") from exc
        raise
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(root)


def _publish(root: Path, manifest: dict[str, Any]) -> None:
    """Replace manifest.json by a copy of the committed generation (best effort: the commit is done)."""
    gen = generation(manifest)
    if generation_path(root, gen + 1).exists():
        return                          # someone committed past us already; their copy is the newer one
    try:
        write_json_atomic(root / MANIFEST_NAME, manifest, stage="manifest-temp-copy", tag=f"g{gen:08d}-")
    except OSError as exc:
        log.warning("%s: committed generation %d, but could not copy it to %s (%s); readers use %s",
                    root, gen, MANIFEST_NAME, exc, generation_path(root, gen).name)


# --------------------------------------------------------------------------------------------- read


def read_manifest(root: Path) -> dict[str, Any]:
    """The committed manifest, parsed and structurally checked, or IndexOpenError with a one-line reason."""
    return read_manifest_stamped(root)[0]


def read_manifest_stamped(root: Path) -> tuple[dict[str, Any], Stamp]:
    """The committed manifest and the stamp of what was read (taken before reading: a commit after it is
    seen as a change, never missed)."""
    root = Path(root)
    if not root.exists():
        raise IndexOpenError(f"{root}: no such index directory")
    if not root.is_dir():
        raise IndexOpenError(f"{root}: not a directory")
    triple = _stat_triple(root)
    primary, problem = _read_primary(root)
    manifest = _newest(root, primary, problem)
    return manifest, Stamp(*triple, generation(manifest))


def _read_primary(root: Path) -> tuple[dict[str, Any] | None, IndexOpenError | None]:
    """manifest.json, or None and why not (corrupt or missing: a numbered manifest may stand in)."""
    path = root / MANIFEST_NAME
    try:
        return _load(path), None
    except FileNotFoundError:
        return None, IndexOpenError(f"{root}: not a rasd index (no {MANIFEST_NAME}); "
                                    "build one with `rasd index build`")
    except _CorruptManifest as exc:
        return None, IndexOpenError(f"{exc}; `rasd index repair {root}` rebuilds it from the segments")


def _newest(root: Path, primary: dict[str, Any] | None, problem: IndexOpenError | None) -> dict[str, Any]:
    """The later of manifest.json and the newest numbered manifest (equal generations: manifest.json)."""
    floor = generation(primary) if primary is not None else -1
    for gen in numbered_generations(root):
        if gen <= floor:
            break
        path = generation_path(root, gen)
        try:
            manifest = _load(path)
        except FileNotFoundError:       # removed as old by a writer meanwhile: an older one may still stand
            continue
        except _CorruptManifest as exc:
            raise IndexOpenError(f"{exc}; `rasd index repair {root}` rebuilds the manifest from the "
                                 "segments") from exc
        if primary is None and problem is not None and (root / MANIFEST_NAME).exists():
            log.warning("%s; using %s (generation %d)", problem, path.name, gen)
        return manifest
    if primary is None:
        assert problem is not None
        raise problem
    return primary


def _load(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _CorruptManifest(f"{path}: corrupt manifest ({_one_line(exc)})") from exc
    validate_manifest(manifest, path)
    return manifest


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200] or type(exc).__name__


def validate_manifest(manifest: Any, where: Path) -> None:
    """Format, version and the fields readers rely on."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise _CorruptManifest(f"{where}: corrupt manifest (not a {FORMAT_NAME} manifest)")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise IndexOpenError(f"{where}: index format version {version} is not supported (this rasd reads "
                             f"version {FORMAT_VERSION}); rebuild the index")
    missing = [k for k in _REQUIRED if k not in manifest]
    if missing:
        raise _CorruptManifest(f"{where}: corrupt manifest (missing {', '.join(missing)})")
    if not isinstance(manifest["segments"], list) or not isinstance(manifest.get("generation", 0), int):
        raise _CorruptManifest(f"{where}: corrupt manifest (segments is not a list, or a bad generation)")
    for seg in manifest["segments"]:
        if not isinstance(seg, dict) or any(k not in seg for k in _SEGMENT_REQUIRED) or \
                not isinstance(seg["files"], dict) or any(f not in seg["files"] for f in SEGMENT_FILES):
            raise _CorruptManifest(f"{where}: corrupt manifest (bad segment entry {str(seg)[:80]})")


# --------------------------------------------------------------------------------------------- checksums


_CHECKED: set[tuple[str, int, int, int, str]] = set()    # (path, inode, size, mtime, sha256) found intact
_CHECKED_LOCK = threading.Lock()


def check_segment_files(root: Path, entry: dict[str, Any], verify: bool) -> None:
    """Every file of a listed segment exists with its recorded size and checksum: in full when `verify` or
    the file is small (each file once per process), else by its sampled digest where one was recorded."""
    folder = root / entry["name"]
    for fname, meta in entry["files"].items():
        path = folder / fname
        try:
            st = path.stat()
        except FileNotFoundError:
            raise IndexOpenError(f"{path}: missing file of segment {entry['name']}") from None
        if st.st_size != int(meta["bytes"]):
            raise IndexOpenError(f"{path}: size {st.st_size} bytes differs from the manifest's {meta['bytes']}")
        _check_digest(path, st, meta, verify)


def _check_digest(path: Path, st: os.stat_result, meta: dict[str, Any], verify: bool) -> None:
    key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns, str(meta["sha256"]))
    with _CHECKED_LOCK:
        if key in _CHECKED:
            return
    if verify or st.st_size <= FULL_CHECK_BYTES:
        if sha256_file(path) != meta["sha256"]:
            raise IndexOpenError(f"{path}: sha256 checksum differs from the manifest's (file corrupted); "
                                 f"`rasd index repair {path.parent.parent}` rebuilds the index without it")
        with _CHECKED_LOCK:
            if len(_CHECKED) > 100_000:
                _CHECKED.clear()
            _CHECKED.add(key)
    elif "sampled_sha256" in meta and sampled_sha256(path, st.st_size) != meta["sampled_sha256"]:
        raise IndexOpenError(f"{path}: sampled checksum differs from the manifest's (file corrupted); "
                             f"`rasd index repair {path.parent.parent}` rebuilds the index without it")
