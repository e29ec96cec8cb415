"""The index on shared storage: two writers whose locks do not exclude each other, a replica's view of another
writer's commit, and the order of the durable steps (fsync before rename, manifest last).

Why the syscall order is tested by recording it: crash tests kill the process with `os._exit`, which keeps
the page cache, so they stay green with every fsync removed; only the order of the calls shows whether a
power cut could lose an acknowledged write.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rasd.distributed.backend import IndexHolder
from rasd.index import CommitConflict, Document, Index, add_documents, build_index
from rasd.index.manifest import commit_manifest, read_manifest
from rasd.index.writer import cleanup_leftovers
from tests.helpers import make_tiny_tokenizer, topic_documents

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tok")))


@pytest.fixture
def small(tiny_tok: str, tmp_path: Path) -> Path:
    root = tmp_path / "i"
    build_index(topic_documents(1)[:2], root, model=tiny_tok, chunk_tokens=24, overlap=6)
    return root


def _sources(root: Path) -> list[str]:
    index = Index.open(root, verify=True)
    return [d.source for d in index.documents(range(index.num_documents))]


# --------------------------------------------------------------------------------------------- two writers

# A writer on a filesystem whose flock does not exclude the other node's writer: flock is a no-op. Both
# writers meet after writing their segments (each renamed into place, neither committed), so both read the
# same generation and race for the same commit. The embedder is a stand-in (random unit vectors of the
# index's dimension): the race is about commits, and loading MiniLM twice on a busy CI machine costs ~20 s.
WRITER = """
import fcntl, json, sys, time
from pathlib import Path
import numpy as np
fcntl.flock = lambda fd, op: None
import rasd.index.writer as writer
class Embedder:
    def get_sentence_embedding_dimension(self):
        return 384
    def encode(self, texts, **kwargs):
        v = np.random.default_rng(len(texts)).standard_normal((len(texts), 384)).astype(np.float32)
        return v / np.linalg.norm(v, axis=1, keepdims=True)
writer.load_embedder = lambda name: Embedder()
from rasd.index import Document, add_documents
from rasd.index.errors import CommitConflict
root, doc, me, other = sys.argv[1:5]
real = writer.write_segment
def write_then_meet(*args, **kwargs):
    entry = real(*args, **kwargs)
    Path(me).touch()
    deadline = time.monotonic() + 120
    while not Path(other).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return entry
writer.write_segment = write_then_meet
try:
    add_documents(root, [Document(**json.loads(doc))])
except CommitConflict as exc:
    print("conflict:", exc, flush=True)
    sys.exit(3)
print("added", flush=True)
"""


def test_two_writers_without_working_locks_lose_nothing(small: Path, tmp_path: Path) -> None:
    """Both commit generation 2 at once: exactly one link wins, the other writes its segment again on top
    (or says it conflicted): both documents are in the index afterwards, and nothing it lists was cleaned."""
    docs = [Document(text=d.text, source=f"writer-{i}", title=d.title) for i, d in enumerate(topic_documents(1)[2:4])]
    env = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    marks = [tmp_path / "a.ready", tmp_path / "b.ready"]
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(small), json.dumps(d.__dict__),
                               str(marks[i]), str(marks[1 - i])], env=env, cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i, d in enumerate(docs)]
    outs = [p.communicate(timeout=300) for p in procs]
    for proc, (out, err) in zip(procs, outs, strict=True):
        assert proc.returncode in (0, 3), err[-2000:]
        if proc.returncode == 3:                                   # a clear conflict, never a silent loss
            assert "another writer committed index generation" in out
    sources = _sources(small)
    for i, proc in enumerate(procs):
        if proc.returncode == 0:
            assert f"writer-{i}" in sources, f"writer {i} was acknowledged, but its document is gone: {sources}"
    assert all(p.returncode == 0 for p in procs), "the loser retries on top of the winner's commit"
    assert sorted(sources[2:]) == ["writer-0", "writer-1"]
    manifest = read_manifest(small)
    assert manifest["generation"] == 3 and len(manifest["segments"]) == 3


def test_a_commit_from_a_stale_generation_is_a_conflict(small: Path) -> None:
    base = read_manifest(small)
    first = commit_manifest(small, dict(base, note="first"))
    with pytest.raises(CommitConflict, match="another writer committed index generation 2 first"):
        commit_manifest(small, dict(base, note="second"))
    assert read_manifest(small) == first


def test_cleanup_keeps_a_segment_a_writer_may_still_commit(small: Path) -> None:
    """A segment named after the current counter may be another node's writer's, renamed and about to be
    committed: cleaning from the current manifest keeps it; once a commit has moved the counter past it, its
    writer can never commit it (its generation is taken), and it goes."""
    manifest = read_manifest(small)
    pending = small / f"seg-{manifest['next_segment']:06d}-other0"
    shutil.copytree(small / manifest["segments"][0]["name"], pending)
    assert pending.name not in cleanup_leftovers(small, manifest) and pending.exists()
    add_documents(small, [Document("the other writer lost the race; this one committed")])
    assert not pending.exists()


# --------------------------------------------------------------------------------------------- replica view


def test_a_commit_right_after_an_ingest_is_served_next(small: Path, tiny_tok: str) -> None:
    """The replica's own ingest returns an index opened at generation N; another writer commits N+1 before
    the holder takes it. The holder must not stamp N+1 as seen: the next request serves N+1."""
    holder = IndexHolder(str(small), tiny_tok, SimpleNamespace(run=lambda fn, *a: fn(*a)))
    ours = add_documents(small, [Document("ingested through this replica", source="ours")])
    add_documents(small, [Document("committed by another writer at that moment", source="theirs")])
    holder.replace(ours)
    served = holder.fresh()
    assert served.num_documents == 4
    assert [d.source for d in served.documents([2, 3])] == ["ours", "theirs"]


# --------------------------------------------------------------------------------------------- syscall order


class Recorder:
    """os.fsync / rename / replace / link / mkdir / rmdir, recorded (fsync by the path of its descriptor)
    and then done for real."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, base: Path):
        self.base, self.calls = base.resolve(), []
        for name in ("fsync", "rename", "replace", "link", "mkdir", "rmdir"):
            monkeypatch.setattr(os, name, self._wrap(name, getattr(os, name)))

    def _wrap(self, name: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if name == "fsync":
                self.calls.append(("fsync", self._rel(os.readlink(f"/proc/self/fd/{args[0]}"))))
            elif name in ("rename", "replace", "link"):
                self.calls.append((name, self._rel(args[0]), self._rel(args[1])))
            else:
                self.calls.append((name, self._rel(args[0])))
            return real(*args, **kwargs)
        return call

    def _rel(self, path: Any) -> str:
        p = Path(os.fsdecode(path)).resolve()
        return "/".join(p.relative_to(self.base).parts) if p.is_relative_to(self.base) else str(p)

    def index(self, event: tuple[str, ...]) -> int:
        return self.calls.index(event)


def _check_durable_order(rec: Recorder, root: str) -> None:
    """fsync files -> fsync dir -> rename -> fsync parent, for every segment; mkdir then fsync parent (before
    the next rename);
    the manifest claimed (link) only after all that, and old segments removed only after the commit."""
    calls = rec.calls
    for i, call in enumerate(calls):
        if call[0] == "mkdir" and not call[1].startswith("/"):
            parent = call[1].rpartition("/")[0]
            upto = next((j for j in range(i + 1, len(calls)) if calls[j][0] in ("rename", "replace", "link")),
                        len(calls))
            assert ("fsync", parent) in calls[i + 1:upto], f"no fsync of {parent} after mkdir {call[1]}"
    seg_renames = [c for c in calls if c[0] == "rename" and "/seg-" in c[2]]
    claims = [c for c in calls if c[0] == "link" and "/manifest-" in c[2]]
    assert seg_renames and len(claims) == 1, calls
    claim = rec.index(claims[0])
    for _, tmp, seg in seg_renames:
        at = rec.index(("rename", tmp, seg))
        before, after = calls[:at], calls[at + 1:claim]
        for fname in ("documents.parquet", "chunks.parquet", "embeddings.npy", "vectors.faiss", "tokens.npy",
                      "doc_offsets.npy", "sa.npy"):
            assert ("fsync", f"{tmp}/{fname}") in before, f"{fname} not fsynced before its segment's rename"
        assert ("fsync", tmp) in before, "the segment directory not fsynced before its rename"
        assert ("fsync", root) in after, "the index directory not fsynced between the rename and the commit"
    _, tmp_manifest, numbered = claims[0]
    assert ("fsync", tmp_manifest) in calls[:claim], "the manifest not fsynced before it was linked"
    assert ("fsync", root) in calls[claim + 1:], "the index directory not fsynced after the commit"
    copy = next(i for i, c in enumerate(calls) if c[0] == "replace" and c[2] == f"{root}/manifest.json")
    assert copy > claim and ("fsync", calls[copy][1]) in calls[claim:copy]
    assert ("fsync", root) in calls[copy + 1:], "manifest.json's rename not fsynced"
    removed = [i for i, c in enumerate(calls) if c[0] == "rmdir" and "/seg-" in c[1]]
    assert all(i > claim for i in removed), "an old segment was removed before the commit"


def test_build_and_add_fsync_in_order(tiny_tok: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = topic_documents(1)
    rec = Recorder(monkeypatch, tmp_path)
    build_index(docs[:2], tmp_path / "new" / "i", model=tiny_tok, chunk_tokens=24, overlap=6)
    assert ("mkdir", "new") in rec.calls and ("mkdir", "new/i") in rec.calls
    _check_durable_order(rec, "new/i")
    rec.calls.clear()
    add_documents(tmp_path / "new" / "i", docs[2:4])
    _check_durable_order(rec, "new/i")
    rec.calls.clear()
    build_index(docs[:3], tmp_path / "new" / "i", model=tiny_tok, chunk_tokens=24, overlap=6, overwrite=True)
    _check_durable_order(rec, "new/i")
    assert any(c[0] == "rmdir" and "/seg-" in c[1] for c in rec.calls), "the replaced segments were removed"
