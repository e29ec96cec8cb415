"""`rasd index repair DIR`: commit a manifest rebuilt from the segments that are intact.

Why: segments are immutable and self-contained, so a corrupt or lost manifest, or one damaged segment, need
not cost the rest of the index. What each segment is comes from the newest readable manifest that lists it
(manifest.json or a numbered one), checked against its recorded sizes and sha256; a segment no readable
manifest lists (an index of an older rasd whose only manifest is damaged, or a commit whose manifests were
all lost) is described from its own files. Segments are then chosen by document ids: from the lowest up, the
newest segment (highest counter: a compaction's merge over the segments it replaced) wins where ranges
overlap. A damaged segment is moved aside to `damaged-<name>` (never cleaned by a writer) and reported.

Settings come from the newest readable manifest; without one, the tokenizer is `model`'s (checked against a
segment's stored tokens), the embedder `embedder`'s (checked against the stored embeddings' dimension) and
the chunking is read off the chunks (reported, as it is inferred).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rasd.fsio import fsync_dir, writer_lock
from rasd.index.errors import IndexInputError, IndexOpenError
from rasd.index.manifest import (
    MANIFEST_NAME,
    check_segment_files,
    commit_manifest,
    generation,
    generation_path,
    new_manifest,
    numbered_generations,
    read_manifest,
    validate_manifest,
)
from rasd.index.segment import SEGMENT_FILES, file_record

log = logging.getLogger("rasd.index")
DAMAGED_PREFIX = "damaged-"
_SEGMENT_RE = re.compile(r"^seg-(\d+)-[0-9a-zA-Z]+$")


@dataclass
class RepairReport:
    """What `repair_index` kept, skipped (name -> why) and committed."""

    root: Path
    kept: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    settings_from: str = ""
    committed: int | None = None            # the generation committed; None: the index was intact
    documents: int = 0
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """The report a person reads, one line per segment."""
        out = [f"{self.root}: settings from {self.settings_from}"]
        out += [f"  kept     {name}" for name in self.kept]
        out += [f"  skipped  {name}: {why}" for name, why in self.skipped.items()]
        out += [f"  note     {note}" for note in self.notes]
        done = f"committed generation {self.committed}" if self.committed else "intact; nothing committed"
        out.append(f"{self.root}: {done}: {self.documents} documents in {len(self.kept)} segment(s)")
        return out


def repair_index(path: str | Path, model: str = "default", embedder: str = "default") -> RepairReport:
    """Rebuild and commit the manifest from the intact segments (see the module doc); `model` and `embedder`
    are used only when no manifest is readable at all."""
    root = Path(path)
    if not root.is_dir():
        raise IndexOpenError(f"{root}: no such index directory")
    report = RepairReport(root)
    with writer_lock(root):
        manifests = _readable_manifests(root, report)
        try:
            current = read_manifest(root)
            intact = all(_damage(root, e, verify=True) is None for e in current["segments"])
        except IndexOpenError:
            current, intact = None, False
        if current is not None and intact:
            report.settings_from, report.kept = "the current manifest", [e["name"] for e in current["segments"]]
            report.documents = sum(int(e["num_documents"]) for e in current["segments"])
            return report
        entries = _candidates(root, manifests, report)
        chosen = _choose(entries, report)
        manifest = _settings(root, manifests, chosen, model, embedder, report)
        manifest["segments"] = [entries[n] for n in chosen]
        manifest["next_segment"] = max([_counter(n) for n in _segment_dirs(root)] + [0]) + 1
        manifest["generation"] = max([generation(m) for m in manifests] + numbered_generations(root) + [0])
        _drop_lost_idempotency(manifest, report)
        _move_damaged(root, report)
        committed = commit_manifest(root, manifest)
    report.kept, report.committed = chosen, generation(committed)
    report.documents = sum(int(entries[n]["num_documents"]) for n in chosen)
    return report


def _readable_manifests(root: Path, report: RepairReport) -> list[dict[str, Any]]:
    """Every manifest file that parses and validates, newest generation first (manifest.json before its
    numbered twin)."""
    paths = [root / MANIFEST_NAME] + [generation_path(root, g) for g in numbered_generations(root)]
    found = []
    for path in paths:
        try:
            manifest = json.loads(path.read_bytes().decode("utf-8"))
            validate_manifest(manifest, path)
        except FileNotFoundError:
            continue
        except (OSError, ValueError, IndexOpenError) as exc:
            report.notes.append(f"{path.name} unreadable ({' '.join(str(exc).split())[:120]})")
            continue
        found.append(manifest)
    return sorted(found, key=generation, reverse=True)


def _segment_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if _SEGMENT_RE.match(p.name) and p.is_dir())


def _counter(name: str) -> int:
    m = _SEGMENT_RE.match(name) or re.match(r"^seg-(\d+)-", name)
    return int(m.group(1)) if m else 0


def _candidates(root: Path, manifests: list[dict[str, Any]], report: RepairReport) -> dict[str, dict[str, Any]]:
    """name -> manifest entry of every intact segment directory (recorded or described from its files)."""
    recorded: dict[str, dict[str, Any]] = {}
    for manifest in reversed(manifests):          # the newest record of a name wins
        recorded.update({e["name"]: e for e in manifest["segments"]})
    newest = manifests[0] if manifests else None
    listed = {e["name"] for e in newest["segments"]} if newest else set()
    floor = int(newest["next_segment"]) if newest else 0
    entries = {}
    for name in _segment_dirs(root):
        if name not in listed and _counter(name) < floor:
            continue                              # an uncommitted or replaced segment of an older generation
        entry = recorded.get(name) or _describe(root / name, report)
        why = _damage(root, entry, verify=True) if entry else "its files are unreadable"
        if why:
            report.skipped[name] = why
        else:
            entries[name] = entry
    for name in listed - set(_segment_dirs(root)):
        report.skipped[name] = "missing (listed in the newest readable manifest)"
    return entries


def _damage(root: Path, entry: dict[str, Any], verify: bool) -> str | None:
    """Why a segment cannot be served (None: intact): checksums, then whether every file parses."""
    from rasd.index.store import Segment

    try:
        check_segment_files(root, entry, verify)
        segment = Segment(root / entry["name"], entry, use_gpu=False)
        if segment.vectors.ntotal != segment.num_chunks:
            return "vectors.faiss does not hold one vector per chunk"
    except (IndexOpenError, FileNotFoundError) as exc:
        return " ".join(str(exc).split())[:200]
    return None


def _describe(folder: Path, report: RepairReport) -> dict[str, Any] | None:
    """A manifest entry read off a segment's own files (no manifest lists it); None when they do not parse."""
    import numpy as np
    import pyarrow.parquet as pq

    from rasd.index.vectors import read_vector_index

    try:
        docs = pq.read_table(folder / "documents.parquet", columns=["doc_id"])["doc_id"].to_numpy()
        chunks = pq.read_table(folder / "chunks.parquet", columns=["chunk_id"])["chunk_id"].to_numpy()
        tokens = np.load(folder / "tokens.npy", mmap_mode="r", allow_pickle=False)
        kind = type(read_vector_index(folder / "vectors.faiss", use_gpu=False)).__name__
        files = {f: file_record(folder / f) for f in SEGMENT_FILES}
    except Exception as exc:  # noqa: BLE001 - parsers raise many types; the segment is skipped, by name
        log.info("%s: cannot describe the segment (%s)", folder, exc)
        return None
    report.notes.append(f"{folder.name}: described from its files (no readable manifest lists it)")
    faiss = "hnsw" if "HNSW" in kind else "ivf" if "IVF" in kind else "flat"
    return {"name": folder.name, "doc_id_start": int(docs[0]) if len(docs) else 0, "num_documents": len(docs),
            "chunk_id_start": int(chunks[0]) if len(chunks) else 0, "num_chunks": len(chunks),
            "num_tokens": len(tokens) - len(docs), "faiss": faiss, "files": files}


def _choose(entries: dict[str, dict[str, Any]], report: RepairReport) -> list[str]:
    """Non-overlapping segments by document id, lowest first; where ranges overlap the newest one wins."""
    order = sorted(entries, key=lambda n: (int(entries[n]["doc_id_start"]), -_counter(n)))
    chosen: list[str] = []
    end = 0
    for name in order:
        start = int(entries[name]["doc_id_start"])
        if chosen and start < end:
            report.notes.append(f"{name}: left out, its documents are in {chosen[-1]} (a newer segment)")
            continue
        chosen.append(name)
        end = start + int(entries[name]["num_documents"])
    if not chosen:
        raise IndexOpenError(f"{report.root}: no intact segment to rebuild the index from")
    return chosen


def _settings(root: Path, manifests: list[dict[str, Any]], chosen: list[str], model: str, embedder: str,
              report: RepairReport) -> dict[str, Any]:
    """Everything but the segments: from the newest readable manifest, else inferred and checked."""
    if manifests:
        report.settings_from = f"the manifest of generation {generation(manifests[0])}"
        return dict(manifests[0])
    from rasd.index.chunking import load_tokenizer, tokenize_documents, tokenizer_fingerprint
    from rasd.index.embed import embedding_dim, load_embedder
    from rasd.index.store import Segment

    first = Segment(root / chosen[0], _describe(root / chosen[0], RepairReport(root)) or {}, use_gpu=False)
    tok = load_tokenizer(model)
    text = first.document(first.doc_id_start).text
    if list(tokenize_documents(tok, [text])[0].ids) != first.document_tokens(first.doc_id_start):
        raise IndexInputError(f"{root}: the segments were not tokenized by {model!r}; pass --model with the "
                              "model the index was built with")
    dim = int(first.vectors.d)
    emb = load_embedder(embedder)
    if embedding_dim(emb) != dim:
        raise IndexInputError(f"{root}: the stored embeddings have dimension {dim}, not {embedder!r}'s; pass "
                              "--embedder with the one the index was built with")
    lengths = first.chunks["token_end"].to_numpy() - first.chunks["token_start"].to_numpy()
    starts, ends = first.chunks["token_start"].to_numpy(), first.chunks["token_end"].to_numpy()
    doc_ids = first.chunks["doc_id"].to_numpy()
    overlap = int(max(ends[0] - starts[1], 0)) if len(starts) > 1 and doc_ids[0] == doc_ids[1] else 0
    chunk_tokens = int(lengths.max()) if len(lengths) else 1
    report.settings_from = (f"--model {model}, --embedder {embedder}; chunking read off the chunks: "
                            f"{chunk_tokens} tokens, overlap {overlap}")
    manifest = new_manifest({"name": model, "fingerprint": tokenizer_fingerprint(tok), "vocab_size": len(tok)},
                            {"name": embedder, "dim": dim}, chunk_tokens, overlap, first.entry["faiss"])
    return manifest


def _drop_lost_idempotency(manifest: dict[str, Any], report: RepairReport) -> None:
    """Idempotency records of batches whose segment was skipped: dropped, so that resending them adds them."""
    records = manifest.get("idempotency", {})
    lost = [k for k, r in records.items() if r.get("segment") in report.skipped]
    if lost:
        manifest["idempotency"] = {k: r for k, r in records.items() if k not in set(lost)}
        report.notes.append(f"{len(lost)} idempotency record(s) of skipped segments dropped (resend those batches)")


def _move_damaged(root: Path, report: RepairReport) -> None:
    """Damaged segment dirs out of the writers' way (they would clean them as unlisted): kept for a person."""
    for name, why in list(report.skipped.items()):
        if (root / name).is_dir():
            os.rename(root / name, root / f"{DAMAGED_PREFIX}{name}")
            report.skipped[name] = f"{why} (moved to {DAMAGED_PREFIX}{name})"
    fsync_dir(root)

