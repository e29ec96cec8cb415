"""Writing an index: build, add (a new segment) and compact (merge segments), each one atomic commit.

Every writer takes the index's lock, removes what an earlier crashed writer left (temporary dirs, segment
dirs the manifest does not list, temporary manifests), writes its new segment completely, and only then
commits a new manifest (`rasd.index.manifest`: a compare-and-swap on the generation). Old segment
directories are removed after that commit, so a crash anywhere leaves the last committed index readable, and
at worst some garbage for the next writer.

Why leftovers are told apart by number: where the lock does not exclude another node's writer, a segment
dir the manifest does not list may be another writer's, renamed and about to be committed. A segment is
named after the `next_segment` counter of the manifest its writer started from, and a writer can commit only
the generation after that manifest's; so an unlisted segment whose counter is below the current manifest's
`next_segment` comes from an older generation, can never be committed, and is safe to remove. Anything else
is left for a later writer. A writer that loses the compare-and-swap (`CommitConflict`) writes its segment
again on top of the new state (COMMIT_ATTEMPTS in all).
"""

from __future__ import annotations

import logging
import re
import secrets
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from rasd.fsio import LOCK_NAME, crash_point, fsync_dir, mkdir_durable, writer_lock
from rasd.index.chunking import load_tokenizer, tokenize_documents, tokenizer_fingerprint
from rasd.index.documents import Document, load_documents
from rasd.index.embed import embed_texts, embedding_dim, load_embedder
from rasd.index.errors import CommitConflict, IndexInputError, TokenizerMismatchError
from rasd.index.manifest import (
    KEEP_GENERATIONS,
    MANIFEST_NAME,
    check_segment_files,
    commit_manifest,
    generation,
    has_manifest,
    new_manifest,
    read_manifest,
)
from rasd.index.segment import (
    SEGMENT_PREFIX,
    TMP_PREFIX,
    SegmentData,
    concat_segment_data,
    make_segment_data,
    read_segment_data,
    with_id_starts,
    write_segment,
)
from rasd.index.store import Index
from rasd.index.vectors import FAISS_KINDS

log = logging.getLogger("rasd.index")

DEFAULT_CHUNK_TOKENS = 192
DEFAULT_OVERLAP = 32
Sources = Sequence[str | Path | Document] | str | Path | Document


# --------------------------------------------------------------------------------------------- helpers


COMMIT_ATTEMPTS = 5
_COUNTER_RE = re.compile(r"^(?:\.tmp-)?seg-(\d+)-")
_NUMBERED_RE = re.compile(r"^manifest-(\d+)\.json(\.tmp-.*)?$")
_COPY_TMP_RE = re.compile(r"^manifest\.json\.tmp-(?:g(\d+)-)?")


def _is_ours(name: str) -> bool:
    """Directory entries a writer owns (everything else in DIR is left alone)."""
    return name.startswith((SEGMENT_PREFIX, TMP_PREFIX, f"{MANIFEST_NAME}.tmp")) or bool(_NUMBERED_RE.match(name))


def _is_dead(name: str, manifest: dict[str, Any]) -> bool:
    """Whether an unlisted entry of ours can never become part of a committed index (see the module doc)."""
    gen = generation(manifest)
    if m := _COUNTER_RE.match(name):
        return int(m.group(1)) < int(manifest["next_segment"])
    if m := _NUMBERED_RE.match(name):
        if m.group(2):                               # a claim's temporary: dead once its generation is taken
            return int(m.group(1)) <= gen
        return int(m.group(1)) <= gen - KEEP_GENERATIONS
    if m := _COPY_TMP_RE.match(name):               # manifest.json's temporary copy (untagged: older rasd)
        return m.group(1) is None or int(m.group(1)) < gen
    return True


def cleanup_leftovers(root: Path, manifest: dict[str, Any] | None) -> list[str]:
    """Remove temporary files/dirs, unlisted segment dirs and old numbered manifests that no writer can still
    commit (`manifest`: a committed one; safe whether or not the writer lock excludes other writers)."""
    current = manifest or {"segments": [], "next_segment": 1, "generation": 0}
    listed = {s["name"] for s in current["segments"]}
    removed = []
    for entry in sorted(root.iterdir()):
        if entry.name in listed or not _is_ours(entry.name) or not _is_dead(entry.name, current):
            continue
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry.name)
        crash_point("cleanup")
    if removed:
        fsync_dir(root)
        log.info("%s: removed leftovers of an earlier writer or old segments: %s", root, ", ".join(removed))
    return removed


def _next_segment_name(manifest: dict[str, Any]) -> str:
    """seg-<counter>-<random>: ordered for people, unique even if a crashed writer used the same counter."""
    name = f"{SEGMENT_PREFIX}{manifest['next_segment']:06d}-{secrets.token_hex(3)}"
    manifest["next_segment"] += 1
    return name


# Seconds of embedding per slice when the torch work is handed to another thread (`run_torch`): a service's
# compute thread runs decoding steps between slices, so a running stream waits at most about one slice for a
# token. The slice's size in chunks follows the measured time per chunk (chunks differ in length, machines
# in speed); 16 chunks took 1.2 s on a 2-core CPU, and streams then waited 1-4 s per token during an ingest.
# A slice that found the thread idle (it waited less than IDLE_WAIT of its own time: no decoding step ran before
# it) makes the next one EMBED_IDLE_SLICE_S long: tiny batches embed slowly (1-2 chunks a batch took 1.5-3x the
# time per chunk of 16 on a busy 2-core CPU, where slices shrank to 1-2 chunks; 0.4 MB through an idle compute
# thread: 7-18% faster than with 0.2 s slices), while a new request waits for at most about one slice before its
# search and one before its prefill.
EMBED_SLICE_S = 0.2
EMBED_IDLE_SLICE_S = 0.5
EMBED_SLICE_MAX = 64
IDLE_WAIT = 0.25

# Where torch work runs: `run_torch(fn, *args)` returns fn(*args) (a service passes its compute thread's
# `run_background`).
RunTorch = Callable[..., Any]
# How far an add is: `on_progress(stage, done, total)`, stage "tokenizing" (documents), "embedding" (chunks) or
# "writing" (the segment, under the writer lock); what a service's ingest job reports.
OnProgress = Callable[[str, int, int], None]


def _timed_embed(embedder: Any, texts: Sequence[str]) -> tuple[np.ndarray, float]:
    """Embed and say how long it took where it ran (not counting the wait for the thread)."""
    start = time.perf_counter()
    vectors = embed_texts(embedder, texts)
    return vectors, time.perf_counter() - start


def _embed_fn(embedder: Any, progress: bool, run_torch: RunTorch | None = None,
              on_progress: OnProgress | None = None) -> Any:
    """`embed(texts) -> [n, dim]`: directly, or through `run_torch` in slices of about EMBED_SLICE_S (each
    slice reported to `on_progress`)."""
    if run_torch is None:
        return lambda texts: embed_texts(embedder, texts, progress=progress)

    def sliced(texts: Sequence[str]) -> np.ndarray:
        parts, i, size = [], 0, 2
        with tqdm(total=len(texts), desc="embedding", unit="chunk", disable=not progress) as bar:
            while i < len(texts):
                if on_progress is not None:
                    on_progress("embedding", i, len(texts))
                sent = time.perf_counter()
                vectors, seconds = run_torch(_timed_embed, embedder, texts[i:i + size])
                idle = time.perf_counter() - sent - seconds < IDLE_WAIT * seconds
                parts.append(vectors)
                i += len(vectors)
                bar.update(len(vectors))
                per_chunk = seconds / max(len(vectors), 1)
                target = EMBED_IDLE_SLICE_S if idle else EMBED_SLICE_S
                size = int(min(max(target / max(per_chunk, 1e-6), 1), EMBED_SLICE_MAX))
        return np.concatenate(parts) if parts else run_torch(embed_texts, embedder, [])
    return sliced


def _segment_data(docs: list[Document], tokenizer: Any, embedder: Any, doc_id_start: int, chunk_id_start: int,
                  chunking: dict[str, int], progress: bool, run_torch: RunTorch | None = None,
                  on_progress: OnProgress | None = None) -> SegmentData:
    if on_progress is not None:
        on_progress("tokenizing", 0, len(docs))
    tokenized = tokenize_documents(tokenizer, [d.text for d in docs], progress=progress, run_python=run_torch)
    return make_segment_data(docs, tokenized, _embed_fn(embedder, progress, run_torch, on_progress), doc_id_start,
                             chunk_id_start, chunking["chunk_tokens"], chunking["overlap"])


def _check_out_dir(root: Path, overwrite: bool) -> dict[str, Any] | None:
    """The existing manifest when overwriting; errors for an index or a folder of someone else's files."""
    if root.exists() and not root.is_dir():
        raise IndexInputError(f"{root}: exists and is not a directory")
    if not root.exists():
        return None
    if has_manifest(root):
        if not overwrite:
            raise IndexInputError(f"{root}: already holds an index; use `rasd index add` to append documents, "
                                  "or --overwrite to replace it")
        return read_manifest(root)
    foreign = [p.name for p in root.iterdir() if p.name != LOCK_NAME and not _is_ours(p.name)]
    if foreign:
        raise IndexInputError(f"{root}: exists and is not empty (and not a rasd index); choose a new folder")
    return None


def _validate_options(chunk_tokens: int, overlap: int, faiss: str) -> None:
    if faiss not in FAISS_KINDS:
        raise IndexInputError(f"unknown FAISS index kind {faiss!r}; choose one of {', '.join(FAISS_KINDS)}")
    if chunk_tokens < 1 or not 0 <= overlap < chunk_tokens:
        raise IndexInputError(f"need --chunk-tokens >= 1 and 0 <= --overlap < --chunk-tokens "
                              f"(got {chunk_tokens} and {overlap})")


# --------------------------------------------------------------------------------------------- build / add


def build_index(paths: Sources, out: str | Path, model: str = "default", embedder: str = "default",
                chunk_tokens: int = DEFAULT_CHUNK_TOKENS, overlap: int = DEFAULT_OVERLAP, faiss: str = "flat",
                overwrite: bool = False, progress: bool = False) -> Index:
    """Build a new index at `out` from files, folders and/or in-memory `Document`s; returns it opened.

    `model` names the target model whose tokenizer cuts chunks and fills the token datastore.
    """
    _validate_options(chunk_tokens, overlap, faiss)
    root = Path(out)
    _check_out_dir(root, overwrite)
    docs = load_documents(paths)
    tokenizer, emb = load_tokenizer(model), load_embedder(embedder)
    manifest = new_manifest({"name": model, "fingerprint": tokenizer_fingerprint(tokenizer),
                             "vocab_size": len(tokenizer)}, {"name": embedder, "dim": embedding_dim(emb)},
                            chunk_tokens, overlap, faiss)
    data = _segment_data(docs, tokenizer, emb, 0, 0, manifest["chunking"], progress)
    mkdir_durable(root)
    with writer_lock(root):
        old = _check_out_dir(root, overwrite)    # again under the lock: another writer may have been first
        if old is not None:
            manifest["next_segment"], manifest["generation"] = old["next_segment"], generation(old)
            manifest["created"] = old.get("created", manifest["created"])
        cleanup_leftovers(root, old)
        manifest["segments"] = [write_segment(root, _next_segment_name(manifest), data, faiss)]
        committed = commit_manifest(root, manifest)   # a conflict: another build or add came first; say so
        crash_point("committed")
        cleanup_leftovers(root, committed)
    return Index.open(root)


def _resolve_tokenizer(manifest: dict[str, Any], model: str | None) -> Any:
    """The manifest's tokenizer (or `model`'s, which must tokenize identically)."""
    expected = manifest["tokenizer"]
    tokenizer = load_tokenizer(model or expected["name"])
    if tokenizer_fingerprint(tokenizer) != expected["fingerprint"]:
        who = f"--model {model!r}" if model else f"the tokenizer now loaded for {expected['name']!r}"
        raise TokenizerMismatchError(f"{who} does not match the index's tokenizer (built with "
                                     f"{expected['name']!r}); documents must be tokenized the same way")
    return tokenizer


def _resolve_embedder(manifest: dict[str, Any], embedder: str | None) -> Any:
    expected = manifest["embedder"]["name"]
    if embedder is not None and embedder != expected:
        raise IndexInputError(f"the index embeds with {expected!r}, not {embedder!r}; vectors of different "
                              "embedders cannot be searched together")
    return load_embedder(expected)


IDEMPOTENCY_KEEP = 10_000   # idempotency records kept in the manifest (oldest dropped first)


def idempotency_record(path: str | Path, key: str) -> dict[str, Any] | None:
    """What the batch sent with idempotency `key` (a hash) added, if one was committed: {"body", "added",
    "nonce", "segment"}."""
    return read_manifest(Path(path)).get("idempotency", {}).get(key)


def add_documents(path: str | Path, paths: Sources, model: str | None = None, embedder: str | None = None,
                  progress: bool = False, run_torch: RunTorch | None = None,
                  lock_timeout_s: float | None = None, idempotency: dict[str, str] | None = None,
                  on_progress: OnProgress | None = None) -> Index:
    """Append documents as a new segment (no rebuild); ids continue after the existing ones.

    `run_torch`: where embedding runs, in slices (a service's compute thread); `lock_timeout_s`: how long to
    wait for another writer before `LockTimeout` (None: as long as it takes). `idempotency` ({"key", "body",
    "nonce"}): recorded in the same manifest commit as the segment, and when the key is already recorded
    nothing is written: a batch is added once however often it is sent, and a crash before the commit
    records nothing (the retry adds it). `on_progress`: see `OnProgress` (embedding reported per slice, so
    only with `run_torch`)."""
    root = Path(path)
    manifest = read_manifest(root)
    docs = load_documents(paths)
    tokenizer = _resolve_tokenizer(manifest, model)
    emb = _resolve_embedder(manifest, embedder)
    data_chunking, data_tokenizer = manifest["chunking"], manifest["tokenizer"]
    data = _segment_data(docs, tokenizer, emb, 0, 0, manifest["chunking"], progress, run_torch, on_progress)
    if on_progress is not None:
        on_progress("writing", 0, 1)
    def commit() -> None:
        if _commit_added(root, data, data_chunking, data_tokenizer, len(docs), idempotency):
            crash_point("committed")

    return _commit_retrying(root, commit, "writing the new segment again on top of it", lock_timeout_s)


def _commit_retrying(root: Path, commit: Callable[[], None], again: str, lock_timeout_s: float | None = None
                     ) -> Index:
    """`commit()` under the writer lock, run again on the newer state while another writer commits first (its
    `CommitConflict`), at most `COMMIT_ATTEMPTS` times; then the index as committed."""
    for attempt in range(COMMIT_ATTEMPTS):
        try:
            with writer_lock(root, lock_timeout_s):
                commit()
            return Index.open(root)
        except CommitConflict:
            if attempt + 1 == COMMIT_ATTEMPTS:
                raise
            log.info("%s: another writer committed first; %s", root, again)
    raise AssertionError("unreachable")


def _commit_added(root: Path, data: SegmentData, data_chunking: dict[str, Any], data_tokenizer: dict[str, Any],
                  num_docs: int, idempotency: dict[str, str] | None) -> bool:
    """Write `data` as a new segment on top of the committed state and commit it (False: the idempotency key
    was committed already, nothing written). CommitConflict when another writer committed meanwhile."""
    manifest = read_manifest(root)           # the committed state under the lock
    if manifest["chunking"] != data_chunking or manifest["tokenizer"] != data_tokenizer:
        raise IndexInputError(f"{root}: the index was rebuilt while documents were being added; add again")
    if idempotency is not None and idempotency["key"] in manifest.get("idempotency", {}):
        return False                         # another attempt with this key committed first
    cleanup_leftovers(root, manifest)
    last = manifest["segments"][-1] if manifest["segments"] else None
    doc_start = last["doc_id_start"] + last["num_documents"] if last else 0
    chunk_start = last["chunk_id_start"] + last["num_chunks"] if last else 0
    data = with_id_starts(data, doc_start, chunk_start)
    entry = write_segment(root, _next_segment_name(manifest), data, manifest["faiss"])
    manifest["segments"] = manifest["segments"] + [entry]
    if idempotency is not None:
        records = dict(manifest.get("idempotency", {}))
        records[idempotency["key"]] = {"body": idempotency["body"], "nonce": idempotency["nonce"],
                                       "added": num_docs, "segment": entry["name"]}
        manifest["idempotency"] = dict(list(records.items())[-IDEMPOTENCY_KEEP:])
    committed = commit_manifest(root, manifest)
    cleanup_leftovers(root, committed)
    return True


def compact_index(path: str | Path, faiss: str | None = None) -> Index:
    """Merge all segments into one, reusing stored embeddings (nothing is re-embedded or re-tokenized).

    The merged segment equals a one-shot build of the same documents. Old segment directories are removed
    only after the new manifest is committed; every source file's checksum is verified first so that a
    corrupted file is never merged into the new segment.
    """
    root = Path(path)
    return _commit_retrying(root, lambda: _compact_once(root, faiss), "compacting its new state")


def _compact_once(root: Path, faiss: str | None) -> None:
    manifest = read_manifest(root)
    cleanup_leftovers(root, manifest)
    kind = faiss or manifest["faiss"]
    if kind not in FAISS_KINDS:
        raise IndexInputError(f"unknown FAISS index kind {kind!r}; choose one of {', '.join(FAISS_KINDS)}")
    if len(manifest["segments"]) <= 1 and kind == manifest["faiss"]:
        log.info("%s: already one segment; nothing to compact", root)
        return
    for entry in manifest["segments"]:       # sizes and checksums of everything about to be merged
        check_segment_files(root, entry, verify=True)
    parts = [read_segment_data(root / e["name"], e) for e in manifest["segments"]]
    entry = write_segment(root, _next_segment_name(manifest), concat_segment_data(parts), kind)
    manifest["segments"], manifest["faiss"] = [entry], kind
    committed = commit_manifest(root, manifest)
    crash_point("committed")
    cleanup_leftovers(root, committed)
