"""Crash safety: a real writer process killed at every dangerous point leaves the last committed index.

Two kinds of kill: the `RASD_INDEX_CRASH_AT=<stage>` hook (`os._exit` exactly between two durable steps)
and SIGKILL after a timed delay (wherever the writer happens to be). After each kill the index must open
and answer exactly as the committed state it claims (before or after the write), and the next writer must
succeed and clean up what the dead one left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rasd.fsio import CRASH_ENV, CRASH_EXIT_CODE
from rasd.index import Document, Index, IndexOpenError, add_documents, build_index, compact_index
from tests.helpers import make_tiny_tokenizer, topic_documents

pytestmark = pytest.mark.slow     # a writer process that embeds imports sentence-transformers (~8 s)

QUERIES = ["rocket thrust and orbit", "kneading dough", "cats purring", "magma and lava", "king checkmate"]
REPO = Path(__file__).resolve().parents[2]

# The child reads its operation and documents from argv, says "ready" once imports are done (so a timed
# kill lands in the write, not in `import torch`), then writes.
CHILD = """
import json, sys
from rasd.index import Document, add_documents, build_index, compact_index
op, root, docs_path, model = sys.argv[1:5]
docs = [Document(**d) for d in json.load(open(docs_path))]
if op != "compact":                     # compaction neither tokenizes nor embeds
    from rasd.index.chunking import load_tokenizer
    from rasd.index.embed import load_embedder
    load_tokenizer(model), load_embedder("default")
print("ready", flush=True)
if op == "build":
    build_index(docs, root, model=model, chunk_tokens=24, overlap=6)
elif op == "add":
    add_documents(root, docs)
else:
    compact_index(root)
print("done", flush=True)
"""


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tok")))


def _start(op: str, root: Path, docs: list[Document], model: str, crash_at: str | None = None) -> subprocess.Popen:
    docs_path = root.parent / f"docs-{op}-{time.monotonic_ns()}.json"
    docs_path.write_text(json.dumps([d.__dict__ for d in docs]))
    env = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    env.pop(CRASH_ENV, None)
    if crash_at:
        env[CRASH_ENV] = crash_at
    return subprocess.Popen([sys.executable, "-c", CHILD, op, str(root), str(docs_path), model], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


def _run(op: str, root: Path, docs: list[Document], model: str, crash_at: str | None = None) -> int:
    proc = _start(op, root, docs, model, crash_at)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode in (0, CRASH_EXIT_CODE), err
    return proc.returncode


def _answers(index: Index) -> list[list[tuple[int, int]]]:
    return [[(h.doc_id, h.chunk_id) for h in index.search(q, k=3)] for q in QUERIES]


@pytest.fixture(scope="module")
def states(tiny_tok: str, tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[list[tuple[int, int]]]]:
    """Reference answers of one-shot builds with the first 3 and with all 6 documents, by document count."""
    docs = topic_documents()
    out = {}
    for n in (3, 6):
        out[n] = _answers(build_index(docs[:n], tmp_path_factory.mktemp(f"ref{n}") / "i", model=tiny_tok,
                                      chunk_tokens=24, overlap=6))
    return out


def _assert_committed(root: Path, states: dict[int, list], allowed: tuple[int, ...]) -> int:
    index = Index.open(root, verify=True)
    assert index.num_documents in allowed
    assert _answers(index) == states[index.num_documents]
    return index.num_documents


def _assert_clean(root: Path) -> None:
    index = Index.open(root)
    listed = {s.name for s in index.segments}
    ours = {p.name for p in root.iterdir() if p.name.startswith(("seg-", ".tmp-", "manifest.json.tmp"))
            or ".json.tmp" in p.name}
    assert ours == listed


@pytest.mark.parametrize("stage", ["segment-files", "segment-renamed", "manifest-temp", "manifest-claimed",
                                   "manifest-temp-copy", "committed"])
def test_add_killed_at_stage(stage: str, tiny_tok: str, states: dict, tmp_path: Path) -> None:
    """`manifest-claimed` / `manifest-temp-copy`: the numbered manifest is committed, manifest.json not yet
    replaced: readers and the next writer take the numbered one."""
    docs = topic_documents()
    root = tmp_path / "i"
    build_index(docs[:3], root, model=tiny_tok, chunk_tokens=24, overlap=6)
    assert _run("add", root, docs[3:], tiny_tok, crash_at=stage) == CRASH_EXIT_CODE
    expect = 6 if stage in ("manifest-claimed", "manifest-temp-copy", "committed") else 3
    assert _assert_committed(root, states, (expect,)) == expect
    if expect == 3:                                                  # the next writer succeeds and cleans up
        add_documents(root, docs[3:])
    compact_index(root)
    _assert_committed(root, states, (6,))
    _assert_clean(root)


@pytest.mark.parametrize("stage", ["segment-files", "manifest-temp", "committed", "cleanup"])
def test_compact_killed_at_stage(stage: str, tiny_tok: str, states: dict, tmp_path: Path) -> None:
    docs = topic_documents()
    root = tmp_path / "i"
    build_index(docs[:3], root, model=tiny_tok, chunk_tokens=24, overlap=6)
    add_documents(root, docs[3:])
    assert _run("compact", root, [], tiny_tok, crash_at=stage) == CRASH_EXIT_CODE
    _assert_committed(root, states, (6,))
    segments = len(Index.open(root).segments)
    assert segments == (1 if stage in ("committed", "cleanup") else 2)
    compact_index(root)
    assert len(Index.open(root).segments) == 1
    _assert_clean(root)


def test_build_killed_before_commit_leaves_no_index(tiny_tok: str, states: dict, tmp_path: Path) -> None:
    root = tmp_path / "i"
    assert _run("build", root, topic_documents()[:3], tiny_tok, crash_at="manifest-temp") == CRASH_EXIT_CODE
    with pytest.raises(IndexOpenError, match="not a rasd index"):
        Index.open(root)
    build_index(topic_documents()[:3], root, model=tiny_tok, chunk_tokens=24, overlap=6)   # leftovers do not block
    _assert_committed(root, states, (3,))
    _assert_clean(root)


def _wait_for_write(root: Path, proc: subprocess.Popen, timeout: float = 120.0) -> bool:
    """Poll until the writer has created its temporary segment dir (True) or exited (False)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        if any(p.name.startswith(".tmp-") for p in root.iterdir()):
            return True
        time.sleep(0.0005)
    return False


@pytest.mark.parametrize("after", [("ready", 0.05), ("write", 0.0), ("write", 0.01), ("write", 0.03),
                                   ("write", 0.08)])
def test_timed_sigkill_during_add(after: tuple[str, float], tiny_tok: str, states: dict, tmp_path: Path) -> None:
    """SIGKILL a delay after the writer is ready (tokenizing/embedding) or after it began writing its segment.

    Whatever it was doing, a committed state remains, and the next commit cleans up.
    """
    event, delay = after
    docs = topic_documents()
    root = tmp_path / "i"
    build_index(docs[:3], root, model=tiny_tok, chunk_tokens=24, overlap=6)
    proc = _start("add", root, docs[3:], tiny_tok)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    if event == "write":
        assert _wait_for_write(root, proc), "the writer finished before its segment directory was seen"
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    committed = _assert_committed(root, states, (3, 6))
    leftovers = sorted(p.name for p in root.iterdir() if p.name.startswith((".tmp-", "seg-", "manifest.json.t")))
    print(f"SIGKILL {delay}s after {event}: {committed} documents committed; on disk {leftovers}")
    if event == "ready":
        assert committed == 3                     # still embedding: nothing written yet
    if committed == 3:
        # the next commit cleans up: until one moves the segment counter past the dead writer's, its
        # directory could as well be a live writer's on another node (whose lock did not exclude us)
        add_documents(root, docs[3:])
    compact_index(root)
    _assert_committed(root, states, (6,))
    _assert_clean(root)
