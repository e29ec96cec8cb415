"""Damaged files under $RASD_HOME are a warning and a cold start, never a crash or a failed request.

The recycling matrix (read at a replica's start, saved while it serves), cost curves and the self-generation
cache of training: truncated, garbage and foreign files. A damaged retrieval index is a one-line
`IndexOpenError` naming the file (never a raw Arrow/NumPy/FAISS error that crash-loops a replica), a corrupt
manifest.json falls back to the numbered copy, and `rasd index repair` rebuilds the manifest from the
intact segments.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rasd.cli import main
from rasd.decoding.proposers import RecyclingMatrix
from rasd.decoding.sizing.cost import CURVE_VERSION, load_or_measure
from rasd.distributed.backend import LocalBackend
from rasd.index import Document, Index, IndexOpenError, add_documents, build_index
from rasd.train.common import generation_key, greedy_continuations
from tests.helpers import make_tiny_tokenizer, tiny_llama, topic_documents

pytestmark = pytest.mark.usefixtures("one_thread")


def saved_matrix(path: Path, vocab: int = 10) -> None:
    matrix = RecyclingMatrix(vocab, k=3)
    logits = torch.full((1, vocab), -5.0)
    logits[0, 2:5] = torch.tensor([3.0, 2.0, 1.0])
    matrix.update([1], logits)
    matrix.save(path)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "not_a_matrix"])
def test_a_damaged_recycling_matrix_starts_cold_with_a_warning(tmp_path: Path, damage: str,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "m.npz"
    saved_matrix(path)
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"\x00\xff" * 100, "empty": b"",
                      "not_a_matrix": b"PK\x03\x04" + data[4:40]}[damage])
    with caplog.at_level(logging.WARNING):
        matrix = RecyclingMatrix.load_or_new(path, 10, k=3)
    assert matrix.updates == 0 and not matrix.known(1)
    assert "starting cold" in caplog.text


def test_an_intact_matrix_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "m.npz"
    saved_matrix(path)
    assert RecyclingMatrix.load_or_new(path, 10, k=3).known(1)


def test_a_failed_save_during_serving_is_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The home became read-only (here: the target path is a folder): the request that triggered the save
    must not fail, and the previous file is untouched."""
    blocked = tmp_path / "matrix.npz"
    blocked.mkdir()
    service = SimpleNamespace(recycling=RecyclingMatrix(10, k=3), recycling_path=blocked)
    service.save_recycling = lambda: LocalBackend.save_recycling(service)
    with caplog.at_level(logging.WARNING):
        LocalBackend.save_recycling_quietly(service)
    assert "could not save the recycling matrix" in caplog.text
    assert blocked.is_dir()


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"key": 3}', "\udcff"])
def test_a_damaged_cost_curve_is_measured_again(tmp_path: Path, content: str) -> None:
    model = tiny_llama(0)
    curve = load_or_measure(model, "tiny", "cpu", "float32", 100, cache_dir=tmp_path)
    path = next(tmp_path.glob(f"*-v{CURVE_VERSION}.json"))
    path.write_bytes(content.encode("utf-8", "surrogateescape"))
    from rasd.decoding.sizing import cost

    cost._TRUSTED.clear()
    again = load_or_measure(model, "tiny", "cpu", "float32", 100, cache_dir=tmp_path)
    assert again.sizes == curve.sizes and all(t > 0 for t in again.latency_s)
    assert json.loads(path.read_text())["key"] == again.key, "the damaged file was replaced"


def test_a_damaged_self_generation_cache_is_regenerated(tmp_path: Path) -> None:
    model = tiny_llama(0)
    prompts = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(0))
    first = greedy_continuations(model, prompts, 4, batch=2, eos=[], cache=tmp_path)
    file = tmp_path / f"{generation_key(model, prompts, 4, [])}.pt"
    assert file.exists()
    file.write_bytes(file.read_bytes()[:20])
    assert torch.equal(greedy_continuations(model, prompts, 4, batch=2, eos=[], cache=tmp_path), first)
    assert torch.equal(torch.load(file), first), "the cache was written again"


# --------------------------------------------------------------------------------------------- the index


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tok")))


def _two_segments(root: Path, tok: str) -> list[str]:
    """An index of 2 + 2 documents in two segments; their names, oldest first."""
    docs = topic_documents(1)
    build_index(docs[:2], root, model=tok, chunk_tokens=24, overlap=6)
    add_documents(root, docs[2:4])
    return [s.name for s in Index.open(root).segments]


def _flip(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int((len(data) - 1) * at)] ^= 0x5A
    path.write_bytes(bytes(data))


def _cli(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("fname", ["documents.parquet", "chunks.parquet", "tokens.npy", "sa.npy", "doc_offsets.npy",
                                   "vectors.faiss", "embeddings.npy"])
def test_a_flipped_byte_in_a_segment_is_one_line_naming_the_file(tiny_tok: str, tmp_path: Path, fname: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Checked at open (every file of a small index is checksummed once per process), so a replica refuses to
    start with the file's name instead of failing later, or serving wrong text."""
    root = tmp_path / "i"
    names = _two_segments(root, tiny_tok)
    _flip(root / names[1] / fname)
    with pytest.raises(IndexOpenError, match=rf"{names[1]}/{fname}: sha256 checksum differs.*rasd index repair") as e:
        Index.open(root)
    assert "\n" not in str(e.value)
    code, out, err = _cli(capsys, "index", "info", root)
    assert code == 2 and out == "" and err.count("\n") == 1 and fname in err


def test_a_large_file_is_checked_by_its_sampled_digest(tiny_tok: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Files over FULL_CHECK_BYTES are not hashed in full at every open: a digest of 32 spread blocks is."""
    import rasd.index.manifest as manifest_mod
    import rasd.index.segment as segment_mod

    monkeypatch.setattr(segment_mod, "FULL_CHECK_BYTES", 0)
    monkeypatch.setattr(manifest_mod, "FULL_CHECK_BYTES", 0)
    root = tmp_path / "i"
    build_index(topic_documents(1)[:2], root, model=tiny_tok, chunk_tokens=24, overlap=6)
    seg = Index.open(root).segments[0]
    assert "sampled_sha256" in seg.entry["files"]["sa.npy"]
    _flip(seg.folder / "sa.npy", at=0.0)                          # the header: in the first block
    with pytest.raises(IndexOpenError, match="sa.npy: sampled checksum differs"):
        Index.open(root)


def test_a_file_that_does_not_parse_is_one_line_even_with_a_matching_record(tiny_tok: str, tmp_path: Path) -> None:
    """Damage the recorded checksum cannot see (an old index's large file, damage before the record was taken):
    the parser's error becomes IndexOpenError naming the file."""
    root = tmp_path / "i"
    build_index(topic_documents(1)[:2], root, model=tiny_tok, chunk_tokens=24, overlap=6)
    seg = Index.open(root).segments[0]
    (seg.folder / "documents.parquet").write_bytes(b"PAR1" + b"\x00" * 60)
    manifest = json.loads((root / "manifest.json").read_text())
    from rasd.index.segment import file_record

    manifest["segments"][0]["files"]["documents.parquet"] = file_record(seg.folder / "documents.parquet")
    for numbered in root.glob("manifest-*.json"):
        numbered.unlink()
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(IndexOpenError, match=r"documents.parquet: unreadable \(.*\); `rasd index repair") as e:
        Index.open(root)
    assert "\n" not in str(e.value)


def test_a_corrupt_manifest_json_falls_back_to_the_numbered_copy(tiny_tok: str, tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "i"
    _two_segments(root, tiny_tok)
    before = Index.open(root)
    (root / "manifest.json").write_text('{"format": "rasd-index", ')
    with caplog.at_level(logging.WARNING, logger="rasd.index"):
        after = Index.open(root)
    assert after.manifest == before.manifest and after.num_documents == 4
    assert "corrupt manifest" in caplog.text and "manifest-00000002.json" in caplog.text
    add_documents(root, [Document("and the index still grows")])   # the next commit writes manifest.json again
    assert json.loads((root / "manifest.json").read_text())["generation"] == 3


def test_repair_rebuilds_an_old_index_whose_only_manifest_is_corrupt(tiny_tok: str, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """An index written before numbered manifests existed has one manifest.json: damaged, every segment is
    still intact; repair describes them from their files, checks the tokenizer against the stored tokens."""
    root = tmp_path / "i"
    names = _two_segments(root, tiny_tok)
    expected = [h.doc_id for h in Index.open(root).search("rocket orbit", k=4)]
    for numbered in root.glob("manifest-*.json"):
        numbered.unlink()
    (root / "manifest.json").write_bytes(b"\x00" * 100)
    code, _, err = _cli(capsys, "index", "info", root)
    assert code == 2 and "corrupt manifest" in err and "rasd index repair" in err and err.count("\n") == 1
    code, out, _ = _cli(capsys, "index", "repair", root, "--model", tiny_tok, "--quiet")
    assert code == 0, out
    assert all(f"kept     {n}" in out for n in names) and "skipped" not in out
    assert "committed generation 1: 4 documents in 2 segment(s)" in out
    index = Index.open(root, verify=True)
    assert [h.doc_id for h in index.search("rocket orbit", k=4)] == expected
    assert index.manifest["chunking"] == {"chunk_tokens": 24, "overlap": 6}
    code, out, err = _cli(capsys, "index", "repair", root, "--model", str(tmp_path / "nope"), "--quiet")
    assert code == 0 and "intact; nothing committed" in out


def test_repair_skips_a_damaged_segment_and_keeps_the_rest(tiny_tok: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "i"
    names = _two_segments(root, tiny_tok)
    _flip(root / names[1] / "tokens.npy")
    code, out, _ = _cli(capsys, "index", "repair", root, "--quiet")
    assert code == 0
    assert f"kept     {names[0]}" in out and f"skipped  {names[1]}: " in out and "tokens.npy" in out
    assert f"moved to damaged-{names[1]}" in out and (root / f"damaged-{names[1]}").is_dir()
    index = Index.open(root, verify=True)
    assert index.num_documents == 2 and [s.name for s in index.segments] == names[:1]
    add_documents(root, topic_documents(1)[2:4])                   # the lost batch sent again
    assert Index.open(root).num_documents == 4 and (root / f"damaged-{names[1]}").is_dir()


def test_repair_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _cli(capsys, "index", "repair", tmp_path / "nope")
    assert code == 2 and out == "" and "no such index directory" in err and err.count("\n") == 1
    (tmp_path / "empty").mkdir()
    code, out, err = _cli(capsys, "index", "repair", tmp_path / "empty")
    assert code == 2 and "no intact segment" in err and err.count("\n") == 1
