"""Reading an index: `Index.open(DIR)`, semantic search over chunks, token datastores for speculation.

Why segments stay separate at query time: `rasd index add` appends a segment without rebuilding, so a
query fans out over segments (FAISS per segment, hits merged by score) and speculation gets one suffix
array per segment. Ties in score are broken by chunk id, so the hits do not depend on how documents were
split into segments: an index grown by `add` answers exactly like one built in one go.

Opening is cheap: token arrays are memory-mapped, FAISS indexes and the embedder load on first search.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from rasd.index.documents import Document
from rasd.index.errors import IndexOpenError, TokenizerMismatchError
from rasd.index.manifest import Stamp, check_segment_files, read_manifest, read_manifest_stamped
from rasd.index.segment import CHUNK_SCHEMA, DOC_SCHEMA
from rasd.index.suffix_array import SuffixArray
from rasd.index.vectors import read_vector_index, search_vectors

log = logging.getLogger("rasd.index")
_OPEN_ATTEMPTS = 3


@dataclass
class Hit:
    """One retrieved chunk; `score` is the cosine similarity to the query (higher is closer)."""

    doc_id: int
    chunk_id: int
    score: float
    text: str
    source: str
    title: str
    external_id: str | None = None


class Segment:
    """One immutable segment: its tables in memory, token arrays memory-mapped, FAISS loaded on demand."""

    def __init__(self, folder: Path, entry: dict[str, Any], use_gpu: bool | None = None):
        self.folder, self.entry, self.name = folder, entry, entry["name"]
        self.doc_id_start = int(entry["doc_id_start"])
        self.chunk_id_start = int(entry["chunk_id_start"])
        self.num_documents = int(entry["num_documents"])
        self.num_chunks = int(entry["num_chunks"])
        self._use_gpu = use_gpu
        self.documents = _readable(folder / "documents.parquet",
                                   lambda p: pq.read_table(p, schema=DOC_SCHEMA, memory_map=True))
        self.chunks = _readable(folder / "chunks.parquet",
                                lambda p: pq.read_table(p, schema=CHUNK_SCHEMA, memory_map=True))
        tokens, sa = _readable(folder / "tokens.npy", _load_npy), _readable(folder / "sa.npy", _load_npy)
        self.doc_offsets = _readable(folder / "doc_offsets.npy", _load_npy)
        if self.documents.num_rows != self.num_documents or self.chunks.num_rows != self.num_chunks or \
                len(self.doc_offsets) != self.num_documents + 1 or len(sa) != len(tokens):
            raise IndexOpenError(f"{folder}: segment contents do not match the manifest's counts")
        self.datastore = SuffixArray(tokens, sa)

    @cached_property
    def vectors(self) -> Any:
        """The FAISS index (GPU when FAISS has one); loaded on the first search."""
        return _readable(self.folder / "vectors.faiss", lambda p: read_vector_index(p, self._use_gpu))

    def search(self, query_vectors: np.ndarray, k: int) -> list[list[tuple[float, int]]]:
        """Per query: (score, chunk row in this segment), best first."""
        scores, rows = search_vectors(self.vectors, query_vectors, k)
        return [[(float(s), int(r)) for s, r in zip(srow, rrow, strict=True) if r >= 0]
                for srow, rrow in zip(scores, rows, strict=True)]

    def hit(self, row: int, score: float) -> Hit:
        """A Hit for a chunk row of this segment."""
        doc_row = int(self.chunks["doc_id"][row].as_py()) - self.doc_id_start
        return Hit(doc_id=self.doc_id_start + doc_row, chunk_id=self.chunk_id_start + row, score=score,
                   text=self.chunks["text"][row].as_py(), source=self.documents["source"][doc_row].as_py(),
                   title=self.documents["title"][doc_row].as_py(),
                   external_id=self.documents["external_id"][doc_row].as_py())

    def document_tokens(self, doc_id: int) -> list[int]:
        """Token ids of one document of this segment (its SEP excluded)."""
        row = doc_id - self.doc_id_start
        start, end = int(self.doc_offsets[row]), int(self.doc_offsets[row + 1]) - 1
        return np.asarray(self.datastore.tokens[start:end]).tolist()

    def document(self, doc_id: int) -> Document:
        row = doc_id - self.doc_id_start
        rec = self.documents.slice(row, 1).to_pylist()[0]
        return Document(text=rec["text"], source=rec["source"], title=rec["title"], external_id=rec["external_id"])


def _load_npy(path: Path) -> np.ndarray:
    return np.load(path, mmap_mode="r", allow_pickle=False)


def _readable(path: Path, load: Any) -> Any:
    """`load(path)`, with any failure to parse the file as IndexOpenError naming it (one line), so a damaged
    file never reaches a person, or a replica's log, as a raw Arrow, NumPy or FAISS error."""
    try:
        return load(path)
    except FileNotFoundError:
        raise
    except Exception as exc:  # noqa: BLE001 - parsers raise many types; one line for the person
        detail = " ".join(str(exc).split())[:160] or type(exc).__name__
        raise IndexOpenError(f"{path}: unreadable ({detail}); `rasd index repair {path.parent.parent}` "
                             "rebuilds the index without its segment") from exc


class IndexReader:
    """What every index view shares, given `manifest` and `search_vectors`: names and text search.

    `Index` (segments in this process) and `ShardedIndex` (segments in Ray actors) differ only in where
    `search_vectors` runs; the query is embedded once, by the caller, either way.
    """

    manifest: dict[str, Any]

    @property
    def tokenizer_name(self) -> str:
        return str(self.manifest["tokenizer"]["name"])

    @property
    def embedder_name(self) -> str:
        return str(self.manifest["embedder"]["name"])

    def search_vectors(self, query_vectors: np.ndarray, k: int) -> list[list[Hit]]:
        raise NotImplementedError

    def document_tokens(self, doc_ids: Sequence[int]) -> list[list[int]]:
        raise NotImplementedError

    def source_tokens(self, sources: Sequence[Any]) -> list[list[int]] | None:
        """Token ids of the documents retrieved sources (anything with a `doc_id`) come from, each once; None
        without sources. What a retrieval proposer is scoped to per request (`ProposerBase.scope`)."""
        doc_ids = list(dict.fromkeys(int(s.doc_id) for s in sources))
        return self.document_tokens(doc_ids) if doc_ids else None

    def embed_queries(self, queries: Sequence[str]) -> np.ndarray:
        """[q, dim] normalised query embeddings with the index's own embedder."""
        from rasd.index.embed import embed_texts, load_embedder

        return embed_texts(load_embedder(self.embedder_name), list(queries))

    def search(self, query: str, k: int = 5) -> list[Hit]:
        """The k chunks closest to `query` over all segments, best first (ties: lower chunk id first)."""
        return self.search_batch([query], k)[0]

    def search_batch(self, queries: Sequence[str], k: int = 5) -> list[list[Hit]]:
        """`search` for several queries with one embedding call."""
        if k <= 0 or not queries:
            return [[] for _ in queries]
        return self.search_vectors(self.embed_queries(queries), k)


class Index(IndexReader):
    """A committed index, opened at the state its manifest.json described when it was read."""

    def __init__(self, root: Path, manifest: dict[str, Any], segments: list[Segment], stamp: Stamp | None = None):
        self.root, self.manifest, self.segments = root, manifest, segments
        self.stamp = stamp        # of the manifest read: a commit after that read shows as a change
        self._doc_starts = [s.doc_id_start for s in segments]

    @classmethod
    def open(cls, path: str | Path, verify: bool = False, use_gpu: bool | None = None,
             segments: Sequence[str] | None = None) -> Index:
        """Open the index at `path`; IndexOpenError (one line) when it is missing, corrupt or incomplete.

        `verify=True` also checks every file's sha256. `segments` opens only the named segments (a shard, e.g.
        for one retrieval actor); search and datastores then cover those only. If a segment vanishes between
        reading the manifest and opening it (a concurrent compaction removed it after committing), the new
        manifest is read and opening is retried.
        """
        root = Path(path)
        for attempt in range(_OPEN_ATTEMPTS):
            manifest, stamp = read_manifest_stamped(root)
            try:
                entries = _select_segments(manifest, segments, root)
                for entry in entries:
                    check_segment_files(root, entry, verify)
                segs = [Segment(root / e["name"], e, use_gpu) for e in entries]
                return cls(root, manifest, segs, stamp)
            except (IndexOpenError, FileNotFoundError):
                if attempt + 1 == _OPEN_ATTEMPTS or read_manifest(root) == manifest:
                    raise
                log.info("%s: the index changed while opening; reading the new manifest", root)
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ description

    @property
    def num_documents(self) -> int:
        return sum(s.num_documents for s in self.segments)

    @property
    def num_chunks(self) -> int:
        return sum(s.num_chunks for s in self.segments)

    @property
    def num_tokens(self) -> int:
        """Document tokens in the datastores (SEPs not counted)."""
        return sum(int(s.entry["num_tokens"]) for s in self.segments)

    def __repr__(self) -> str:
        return (f"Index({str(self.root)!r}, segments={len(self.segments)}, documents={self.num_documents}, "
                f"chunks={self.num_chunks}, tokens={self.num_tokens})")

    # ------------------------------------------------------------------ search

    def search_vectors(self, query_vectors: np.ndarray, k: int) -> list[list[Hit]]:
        """Search with precomputed query embeddings [q, dim] (e.g. one embedding shared by many shards)."""
        per_segment = [seg.search(query_vectors, k) for seg in self.segments]
        out = []
        for qi in range(len(query_vectors)):
            cands = [(-score, seg.chunk_id_start + row, seg, row)
                     for seg, results in zip(self.segments, per_segment, strict=True) for score, row in results[qi]]
            cands.sort(key=lambda c: (c[0], c[1]))
            out.append([seg.hit(row, -neg) for neg, _, seg, row in cands[:k]])
        return out

    # ------------------------------------------------------------------ token datastores

    def datastores(self) -> list[SuffixArray]:
        """One memory-mapped suffix array per segment (documents never span segments)."""
        return [s.datastore for s in self.segments]

    def _segment_of(self, doc_id: int) -> Segment:
        i = bisect.bisect_right(self._doc_starts, doc_id) - 1
        if i < 0 or doc_id >= self.segments[i].doc_id_start + self.segments[i].num_documents:
            raise KeyError(f"no document with id {doc_id} in {self.root} (ids 0..{self.num_documents - 1})")
        return self.segments[i]

    def document_tokens(self, doc_ids: Sequence[int]) -> list[list[int]]:
        """Token ids of whole documents (for per-request datastores scoped to the retrieved documents)."""
        return [self._segment_of(int(d)).document_tokens(int(d)) for d in doc_ids]

    def documents(self, doc_ids: Sequence[int]) -> list[Document]:
        """The stored documents (text, source, title, external id)."""
        return [self._segment_of(int(d)).document(int(d)) for d in doc_ids]

    # ------------------------------------------------------------------ tokenizer agreement

    def check_tokenizer(self, tokenizer: Any) -> None:
        """Raise TokenizerMismatchError unless `tokenizer` (a model name, HF tokenizer or LoadedModel) matches."""
        check_tokenizer(self, tokenizer)


def _select_segments(manifest: dict[str, Any], names: Sequence[str] | None, root: Path) -> list[dict[str, Any]]:
    """The manifest's segment entries, or the named subset (unknown names are an error)."""
    entries = manifest["segments"]
    if names is None:
        return entries
    known = {e["name"] for e in entries}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise IndexOpenError(f"{root}: no segment {unknown[0]!r} in the manifest")
    return [e for e in entries if e["name"] in set(names)]


def check_tokenizer(index: Index | dict[str, Any], tokenizer: Any) -> None:
    """Raise TokenizerMismatchError when `tokenizer` tokenizes differently from the index's datastores.

    `tokenizer` may be a model name or path (as given to `--model`), an HF tokenizer, or a LoadedModel. The
    comparison is by fingerprint (vocabulary + a probe text's ids), so `default` and the converted model's
    folder are the same tokenizer, and a different checkpoint under a familiar name is caught.
    """
    from rasd.index.chunking import load_tokenizer, tokenizer_fingerprint

    manifest = index.manifest if isinstance(index, Index) else index
    expected = manifest["tokenizer"]
    if isinstance(tokenizer, str):
        if tokenizer == expected["name"]:
            return
        label, tok = tokenizer, load_tokenizer(tokenizer)
    else:
        loaded_model = hasattr(tokenizer, "tokenizer")       # a LoadedModel: compare its tokenizer
        tok = tokenizer.tokenizer if loaded_model else tokenizer
        label = tokenizer.name if loaded_model else (getattr(tok, "name_or_path", "") or type(tok).__name__)
    if tokenizer_fingerprint(tok) != expected["fingerprint"]:
        raise TokenizerMismatchError(
            f"the index was built with the tokenizer of {expected['name']!r}, but {label!r} tokenizes "
            f"differently; use that model or rebuild the index with --model {label}")
