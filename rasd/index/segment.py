"""One segment of an index: its documents, chunks, embeddings, FAISS vectors and token suffix array.

A segment is immutable once written. `rasd index add` writes a new one instead of touching old files, and
compaction writes one merged segment, so a crash can only ever leave an unreferenced directory behind.
Files of a segment (all in one directory):
    documents.parquet  doc_id, external_id, source, title, text
    chunks.parquet     chunk_id, doc_id, text, token_start, token_end (in the document), char_start, char_end
    embeddings.npy     float32 [chunks, dim]   (compaction rebuilds FAISS from these instead of re-embedding)
    vectors.faiss      FAISS index, id = chunk row in this segment
    tokens.npy         int32, the documents' tokens with SEP (-1) after each
    doc_offsets.npy    int64 [docs + 1], where each document starts in tokens.npy
    sa.npy             int64 suffix array of tokens.npy
Doc ids and chunk ids are contiguous ranges per segment, so an id maps to a segment and a row by subtraction.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rasd.fsio import crash_point, fsync_dir, fsync_file, sampled_sha256, sha256_file
from rasd.index.chunking import Chunk, TokenizedDocument, chunk_document
from rasd.index.documents import Document
from rasd.index.suffix_array import build_suffix_array, join_documents
from rasd.index.vectors import build_vector_index, write_vector_index

SEGMENT_FILES = ("documents.parquet", "chunks.parquet", "embeddings.npy", "vectors.faiss", "tokens.npy",
                 "doc_offsets.npy", "sa.npy")
FULL_CHECK_BYTES = 64 << 20   # files up to this size are checksummed in full at open; larger ones sampled
SEGMENT_PREFIX = "seg-"
TMP_PREFIX = ".tmp-"

DOC_SCHEMA = pa.schema([("doc_id", pa.int64()), ("external_id", pa.string()), ("source", pa.string()),
                        ("title", pa.string()), ("text", pa.large_string())])
CHUNK_SCHEMA = pa.schema([("chunk_id", pa.int64()), ("doc_id", pa.int64()), ("text", pa.large_string()),
                          ("token_start", pa.int64()), ("token_end", pa.int64()), ("char_start", pa.int64()),
                          ("char_end", pa.int64())])


@dataclass
class SegmentData:
    """Everything a segment holds, in memory, before it is written."""

    doc_id_start: int
    chunk_id_start: int
    documents: pa.Table
    chunks: pa.Table
    embeddings: np.ndarray   # [chunks, dim] float32
    tokens: np.ndarray       # [n] int32 with SEP after each document
    doc_offsets: np.ndarray  # [docs + 1] int64

    @property
    def num_documents(self) -> int:
        return self.documents.num_rows

    @property
    def num_chunks(self) -> int:
        return self.chunks.num_rows

    @property
    def num_tokens(self) -> int:
        """Document tokens, SEPs not counted."""
        return len(self.tokens) - self.num_documents


def documents_table(docs: Sequence[Document], doc_id_start: int) -> pa.Table:
    return pa.table({"doc_id": np.arange(doc_id_start, doc_id_start + len(docs), dtype=np.int64),
                     "external_id": [d.external_id for d in docs], "source": [d.source for d in docs],
                     "title": [d.title for d in docs], "text": [d.text for d in docs]}, schema=DOC_SCHEMA)


def chunks_table(chunks: Sequence[Chunk], doc_id_start: int, chunk_id_start: int) -> pa.Table:
    return pa.table({
        "chunk_id": np.arange(chunk_id_start, chunk_id_start + len(chunks), dtype=np.int64),
        "doc_id": np.array([doc_id_start + c.doc_index for c in chunks], dtype=np.int64),
        "text": [c.text for c in chunks],
        "token_start": np.array([c.token_start for c in chunks], dtype=np.int64),
        "token_end": np.array([c.token_end for c in chunks], dtype=np.int64),
        "char_start": np.array([c.char_start for c in chunks], dtype=np.int64),
        "char_end": np.array([c.char_end for c in chunks], dtype=np.int64)}, schema=CHUNK_SCHEMA)


def make_segment_data(docs: Sequence[Document], tokenized: Sequence[TokenizedDocument], embed: Any,
                      doc_id_start: int, chunk_id_start: int, chunk_tokens: int, overlap: int) -> SegmentData:
    """Chunk tokenized documents, embed the chunks (`embed(texts) -> [n, dim]`) and join the token arrays."""
    chunks: list[Chunk] = []
    for i, (doc, toks) in enumerate(zip(docs, tokenized, strict=True)):
        chunks.extend(chunk_document(i, doc.text, toks, chunk_tokens, overlap))
    embeddings = embed([c.text for c in chunks])
    tokens, offsets = join_documents([t.ids for t in tokenized])
    return SegmentData(doc_id_start, chunk_id_start, documents_table(docs, doc_id_start),
                       chunks_table(chunks, doc_id_start, chunk_id_start), embeddings, tokens, offsets)


def concat_segment_data(parts: Sequence[SegmentData]) -> SegmentData:
    """One segment's data from several consecutive ones (ids already contiguous): no re-tokenizing or embedding.

    Concatenating token arrays equals joining all documents at once, because each document already ends
    with its SEP.
    """
    offsets = [np.asarray(parts[0].doc_offsets[:1], dtype=np.int64)]
    base = 0
    for p in parts:
        offsets.append(np.asarray(p.doc_offsets[1:], dtype=np.int64) + base)
        base += len(p.tokens)
    return SegmentData(parts[0].doc_id_start, parts[0].chunk_id_start,
                       pa.concat_tables([p.documents for p in parts]).combine_chunks(),
                       pa.concat_tables([p.chunks for p in parts]).combine_chunks(),
                       np.concatenate([p.embeddings for p in parts]).astype(np.float32, copy=False),
                       np.concatenate([p.tokens for p in parts]).astype(np.int32, copy=False),
                       np.concatenate(offsets))


def with_id_starts(data: SegmentData, doc_id_start: int, chunk_id_start: int) -> SegmentData:
    """The same segment with its doc and chunk ids shifted to start at the given values.

    Why: `add` tokenizes and embeds before taking the writer lock (the slow part), and only learns the next
    free ids once it holds the lock.
    """
    if (doc_id_start, chunk_id_start) == (data.doc_id_start, data.chunk_id_start):
        return data
    dshift, cshift = doc_id_start - data.doc_id_start, chunk_id_start - data.chunk_id_start
    docs = data.documents.set_column(0, "doc_id", pa.array(data.documents["doc_id"].to_numpy() + dshift))
    chunks = data.chunks.set_column(0, "chunk_id", pa.array(data.chunks["chunk_id"].to_numpy() + cshift))
    chunks = chunks.set_column(1, "doc_id", pa.array(chunks["doc_id"].to_numpy() + dshift))
    return SegmentData(doc_id_start, chunk_id_start, docs, chunks, data.embeddings, data.tokens, data.doc_offsets)


def _save_npy(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as fh:
        np.save(fh, array, allow_pickle=False)


def _write_files(folder: Path, data: SegmentData, faiss_kind: str) -> str:
    """All segment files into `folder`; returns the FAISS kind actually built (IVF may fall back to flat)."""
    pq.write_table(data.documents, folder / "documents.parquet")
    pq.write_table(data.chunks, folder / "chunks.parquet")
    _save_npy(folder / "embeddings.npy", data.embeddings)
    index, kind = build_vector_index(data.embeddings, faiss_kind)
    write_vector_index(index, folder / "vectors.faiss")
    crash_point("segment-files")
    _save_npy(folder / "tokens.npy", data.tokens)
    _save_npy(folder / "doc_offsets.npy", data.doc_offsets)
    _save_npy(folder / "sa.npy", build_suffix_array(data.tokens))
    return kind


def file_record(path: Path) -> dict[str, Any]:
    """What the manifest records of a segment file: its size, sha256, and for a large file a sampled digest."""
    size = path.stat().st_size
    record: dict[str, Any] = {"bytes": size, "sha256": sha256_file(path)}
    if size > FULL_CHECK_BYTES:
        record["sampled_sha256"] = sampled_sha256(path, size)
    return record


def write_segment(root: Path, name: str, data: SegmentData, faiss_kind: str) -> dict[str, Any]:
    """Write a segment atomically (temporary dir, fsync, rename) and return its manifest entry.

    Until the manifest lists it, the new directory is invisible to readers; a crash before that leaves an
    unlisted directory that the next writer removes.
    """
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{name}-", dir=root))
    try:
        fsync_dir(root)                  # the new directory's entry, before anything is written into it
        kind = _write_files(tmp, data, faiss_kind)
        files = {}
        for fname in SEGMENT_FILES:
            fsync_file(tmp / fname)
            files[fname] = file_record(tmp / fname)
        tmp.chmod(0o755)
        fsync_dir(tmp)
        os.rename(tmp, root / name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(root)
    crash_point("segment-renamed")
    return {"name": name, "doc_id_start": data.doc_id_start, "num_documents": data.num_documents,
            "chunk_id_start": data.chunk_id_start, "num_chunks": data.num_chunks, "num_tokens": data.num_tokens,
            "faiss": kind, "files": files}


def read_segment_data(folder: Path, entry: dict[str, Any]) -> SegmentData:
    """A written segment's data back in memory (for compaction)."""
    return SegmentData(int(entry["doc_id_start"]), int(entry["chunk_id_start"]),
                       pq.read_table(folder / "documents.parquet", schema=DOC_SCHEMA),
                       pq.read_table(folder / "chunks.parquet", schema=CHUNK_SCHEMA),
                       np.load(folder / "embeddings.npy", allow_pickle=False),
                       np.load(folder / "tokens.npy", allow_pickle=False),
                       np.load(folder / "doc_offsets.npy", allow_pickle=False))
