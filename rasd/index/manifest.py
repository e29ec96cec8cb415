"""manifest.json: the one file that says what an index is. Renaming a new manifest into place is the commit.

Readers trust only segments listed here, with the byte sizes listed here; checksums are checked on demand
(`verify=True`, and always before compaction, so corruption is never copied into a new segment).
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

from rasd.fsio import sha256_file, write_json_atomic
from rasd.index.errors import IndexOpenError
from rasd.index.segment import SEGMENT_FILES

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "rasd-index"
FORMAT_VERSION = 1
_REQUIRED = ("format", "format_version", "tokenizer", "embedder", "chunking", "faiss", "segments", "next_segment")
_SEGMENT_REQUIRED = ("name", "doc_id_start", "num_documents", "chunk_id_start", "num_chunks", "num_tokens",
                     "faiss", "files")


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def new_manifest(tokenizer: dict[str, Any], embedder: dict[str, Any], chunk_tokens: int, overlap: int,
                 faiss_kind: str) -> dict[str, Any]:
    """A manifest without segments; `faiss` is the kind requested for every segment built later."""
    created = now_iso()
    return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "created": created, "updated": created,
            "tokenizer": tokenizer, "embedder": embedder,
            "chunking": {"chunk_tokens": chunk_tokens, "overlap": overlap}, "faiss": faiss_kind,
            "next_segment": 1, "segments": []}


def totals(manifest: dict[str, Any]) -> dict[str, int]:
    """Documents, chunks and tokens summed over segments."""
    segs = manifest["segments"]
    return {key: sum(int(s[f"num_{key}"]) for s in segs) for key in ("documents", "chunks", "tokens")}


def commit_manifest(root: Path, manifest: dict[str, Any]) -> None:
    """Atomically replace manifest.json (the commit point of build, add and compact)."""
    manifest = dict(manifest, updated=now_iso(), totals=totals(manifest))
    write_json_atomic(root / MANIFEST_NAME, manifest, stage="manifest-temp")


def read_manifest(root: Path) -> dict[str, Any]:
    """The parsed and structurally checked manifest, or IndexOpenError with a one-line reason."""
    root = Path(root)
    if not root.exists():
        raise IndexOpenError(f"{root}: no such index directory")
    if not root.is_dir():
        raise IndexOpenError(f"{root}: not a directory")
    path = root / MANIFEST_NAME
    if not path.exists():
        raise IndexOpenError(f"{root}: not a rasd index (no {MANIFEST_NAME}); build one with `rasd index build`")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise IndexOpenError(f"{path}: corrupt manifest ({exc})") from exc
    validate_manifest(manifest, path)
    return manifest


def validate_manifest(manifest: Any, where: Path) -> None:
    """Format, version and the fields readers rely on."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise IndexOpenError(f"{where}: corrupt manifest (not a {FORMAT_NAME} manifest)")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise IndexOpenError(f"{where}: index format version {version} is not supported (this rasd reads "
                             f"version {FORMAT_VERSION}); rebuild the index")
    missing = [k for k in _REQUIRED if k not in manifest]
    if missing:
        raise IndexOpenError(f"{where}: corrupt manifest (missing {', '.join(missing)})")
    if not isinstance(manifest["segments"], list):
        raise IndexOpenError(f"{where}: corrupt manifest (segments is not a list)")
    for seg in manifest["segments"]:
        if not isinstance(seg, dict) or any(k not in seg for k in _SEGMENT_REQUIRED) or \
                any(f not in seg["files"] for f in SEGMENT_FILES):
            raise IndexOpenError(f"{where}: corrupt manifest (bad segment entry {str(seg)[:80]})")


def check_segment_files(root: Path, entry: dict[str, Any], verify: bool) -> None:
    """Every file of a listed segment exists with its recorded size (and checksum when `verify`)."""
    folder = root / entry["name"]
    for fname, meta in entry["files"].items():
        path = folder / fname
        if not path.is_file():
            raise IndexOpenError(f"{path}: missing file of segment {entry['name']}")
        size = path.stat().st_size
        if size != int(meta["bytes"]):
            raise IndexOpenError(f"{path}: size {size} bytes differs from the manifest's {meta['bytes']}")
        if verify and sha256_file(path) != meta["sha256"]:
            raise IndexOpenError(f"{path}: sha256 checksum differs from the manifest's (file corrupted)")
