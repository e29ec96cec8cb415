"""The retrieval index: suffix array vs brute force, reading documents, build/add/compact round trips,
opening errors, tokenizer agreement, the `rasd index` CLI.

Round trips compare against a one-shot build of the same documents: an index grown by `add` (and then
compacted) must answer searches and datastore lookups exactly like it.
"""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rasd.cli import main
from rasd.index import (
    SEP,
    Document,
    Index,
    IndexInputError,
    IndexOpenError,
    SuffixArray,
    TokenizerMismatchError,
    add_documents,
    build_index,
    check_tokenizer,
    compact_index,
    load_documents,
)
from rasd.index.chunking import chunk_spans, load_tokenizer, tokenize_documents
from rasd.index.suffix_array import join_documents
from rasd.index.vectors import build_vector_index, search_vectors
from tests.helpers import TOPICS, make_tiny_tokenizer, topic_documents

QUERIES = ["how does a rocket reach orbit", "baking a loaf in the oven", "kittens hunting mice",
           "lava and ash", "checkmate the king", "floods in the river delta"]


# --------------------------------------------------------------------------------------------- suffix array


def _brute_positions(tokens: list[int], pattern: list[int]) -> list[int]:
    k = len(pattern)
    return [p for p in range(len(tokens) - k + 1) if tokens[p:p + k] == pattern]


def _random_corpus(seed: int) -> tuple[list[list[int]], np.ndarray, SuffixArray]:
    rng = random.Random(seed)
    docs = [[rng.randrange(3) for _ in range(rng.randrange(0, 40))] for _ in range(rng.randrange(1, 8))]
    tokens, _ = join_documents(docs)
    return docs, tokens, SuffixArray.build(tokens)


@pytest.mark.parametrize("seed", range(6))
def test_suffix_array_sorted_and_find_matches_brute_force(seed: int) -> None:
    _, tokens, sa = _random_corpus(seed)
    toks = tokens.tolist()
    suffixes = [toks[p:] for p in sa.sa.tolist()]
    assert sorted(sa.sa.tolist()) == list(range(len(toks)))
    assert suffixes == sorted(suffixes)                          # SEP (-1) sorts first, like Python lists
    rng = random.Random(100 + seed)
    for _ in range(60):
        pattern = [rng.randrange(3) for _ in range(rng.randrange(1, 6))]
        lo, hi = sa.find(pattern)
        assert sorted(sa.sa[lo:hi].tolist()) == _brute_positions(toks, pattern)
        assert sa.count(pattern) == len(_brute_positions(toks, pattern))


@pytest.mark.parametrize("seed", range(6))
def test_longest_suffix_match_and_continuations_match_brute_force(seed: int) -> None:
    _, tokens, sa = _random_corpus(seed)
    toks = tokens.tolist()
    rng = random.Random(200 + seed)
    for _ in range(40):
        context = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
        max_len, min_len = 6, 2
        expect = max((k for k in range(min_len, min(max_len, len(context)) + 1)
                      if _brute_positions(toks, context[-k:])), default=0)
        match = sa.longest_suffix_match(context, max_len=max_len, min_len=min_len)
        assert (match.length if match else 0) == expect
        length, conts = sa.lookup(context, max_continuations=10_000, length=4, max_len=max_len, min_len=min_len)
        assert length == expect
        if not expect:
            assert conts == []
            continue
        want = []
        for p in _brute_positions(toks, context[-expect:]):
            after = toks[p + expect:p + expect + 4]
            after = after[:after.index(SEP)] if SEP in after else after
            if after:
                want.append(tuple(after))
        assert Counter(map(tuple, conts)) == Counter(want)
        assert all(SEP not in c for c in conts)                 # a continuation never crosses a document end


def test_matches_never_span_documents() -> None:
    docs = [[1, 2, 3], [4, 5, 6]]
    sa = SuffixArray.from_documents(docs)
    assert sa.count([3, 4]) == 0 and sa.count([2, 3]) == 1
    assert sa.lookup([9, 2, 3], length=5) == (2, [])            # doc 0 ends after 3: nothing follows
    assert sa.lookup([4, 5]) == (2, [[6]])


def test_continuations_sample_evenly_when_many() -> None:
    sa = SuffixArray.from_documents([[7, 1]] * 30 + [[7, 2]] * 10)
    _, conts = sa.lookup([5, 7], max_continuations=8, length=1, min_len=1)
    counts = Counter(c[0] for c in conts)
    assert len(conts) == 8 and counts[1] == 6 and counts[2] == 2


# --------------------------------------------------------------------------------------------- documents


def test_chunk_spans_overlap_and_cover() -> None:
    assert chunk_spans(0, 4, 1) == []
    assert chunk_spans(3, 4, 1) == [(0, 3)]
    assert chunk_spans(10, 4, 1) == [(0, 4), (3, 7), (6, 10)]
    assert chunk_spans(8, 4, 0) == [(0, 4), (4, 8)]
    with pytest.raises(IndexInputError):
        chunk_spans(10, 4, 4)


def test_reads_every_format_and_folders(tmp_path: Path) -> None:
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("alpha text")
    (folder / "sub" / "b.md").write_text("# beta\nmarkdown")
    (folder / "image.png").write_bytes(b"\x89PNG\x00\x00")          # skipped inside folders
    (folder / ".hidden.txt").write_text("hidden")
    rows = [{"id": "r1", "title": "Row one", "text": "first row"}, {"text": "second row"}, {"text": "  "}]
    (folder / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    pq.write_table(pa.table({"text": ["parquet row"], "id": [7], "title": ["P"]}), folder / "t.parquet")
    docs = load_documents([folder])
    assert [d.text for d in docs] == ["alpha text", "first row", "second row", "# beta\nmarkdown", "parquet row"]
    assert docs[1].external_id == "r1" and docs[1].title == "Row one" and docs[4].external_id == "7"
    assert docs[0].title == "a" and docs[0].source.endswith("a.txt")


@pytest.mark.parametrize(("name", "content", "message"), [
    ("bin.txt", b"abc\x00def", "binary file"),
    ("latin1.md", "caf\xe9".encode("latin-1"), "not valid UTF-8"),
    ("notes.pdf", b"%PDF", "unsupported file type '.pdf'"),
    ("rows.jsonl", b'{"body": "x"}\n', "rows.jsonl:1: has no 'text' field"),
    ("bad.jsonl", b'{"text": "ok"}\n{oops\n', "bad.jsonl:2: invalid JSON"),
])
def test_bad_inputs_name_the_file(tmp_path: Path, name: str, content: bytes, message: str) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(IndexInputError, match=message) as info:
        load_documents([path])
    assert name in str(info.value) and "\n" not in str(info.value)


def test_empty_documents_skipped_with_warning_or_error_if_all(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "full.txt").write_text("some text")
    with caplog.at_level(logging.WARNING, logger="rasd.index"):
        docs = load_documents([tmp_path / "empty.txt", tmp_path / "full.txt"])
    assert [d.text for d in docs] == ["some text"]
    assert "skipped 1 empty document" in caplog.text and "empty.txt" in caplog.text
    with pytest.raises(IndexInputError, match="empty"):
        load_documents([tmp_path / "empty.txt"])
    with pytest.raises(IndexInputError, match="no such file"):
        load_documents([tmp_path / "missing.txt"])


# --------------------------------------------------------------------------------------------- build / add / compact


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tok")))


@pytest.fixture(scope="module")
def one_shot(tiny_tok: str, tmp_path_factory: pytest.TempPathFactory) -> Index:
    """Reference: all topic documents in one build."""
    return build_index(topic_documents(), tmp_path_factory.mktemp("one") / "idx", model=tiny_tok,
                       chunk_tokens=24, overlap=6)


def _hit_keys(index: Index) -> list[list[tuple[int, int, str]]]:
    return [[(h.doc_id, h.chunk_id, h.text) for h in index.search(q, k=4)] for q in QUERIES]


def _scores(index: Index) -> np.ndarray:
    return np.array([[h.score for h in index.search(q, k=4)] for q in QUERIES])


def test_build_stores_documents_chunks_and_tokens(one_shot: Index, tiny_tok: str) -> None:
    docs = topic_documents()
    tok = load_tokenizer(tiny_tok)
    assert one_shot.num_documents == len(docs) and len(one_shot.segments) == 1
    expect = [t.ids.tolist() for t in tokenize_documents(tok, [d.text for d in docs])]
    assert one_shot.document_tokens(list(range(len(docs)))) == expect
    assert one_shot.num_tokens == sum(map(len, expect))
    chunks = one_shot.segments[0].chunks.to_pylist()
    assert one_shot.num_chunks == len(chunks) > len(docs)
    for c in chunks:                       # chunk text is the exact slice, and its tokens are the doc's tokens
        text = docs[c["doc_id"]].text
        assert c["text"] == text[c["char_start"]:c["char_end"]]
        assert 0 < c["token_end"] - c["token_start"] <= 24
        ids = tok(c["text"], add_special_tokens=False)["input_ids"]
        assert ids == expect[c["doc_id"]][c["token_start"]:c["token_end"]]
    manifest = json.loads((one_shot.root / "manifest.json").read_text())
    seg = manifest["segments"][0]
    assert set(seg["files"]) >= {"documents.parquet", "chunks.parquet", "vectors.faiss", "tokens.npy", "sa.npy",
                                 "doc_offsets.npy", "embeddings.npy"}
    assert all(len(f["sha256"]) == 64 for f in seg["files"].values())
    assert manifest["embedder"] == {"name": "default", "dim": 384} and manifest["tokenizer"]["name"] == tiny_tok
    assert manifest["totals"] == {"documents": 6, "chunks": one_shot.num_chunks, "tokens": one_shot.num_tokens}


def test_search_finds_the_topic(one_shot: Index) -> None:
    hits = one_shot.search("how does a rocket reach orbit", k=3)
    assert hits[0].title == "Rockets" and hits[0].source == "mem://rockets"
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    assert one_shot.search("anything", k=0) == []
    assert len(one_shot.search("anything", k=1000)) == one_shot.num_chunks


def test_add_then_compact_equals_one_shot(one_shot: Index, tiny_tok: str, tmp_path: Path) -> None:
    docs = topic_documents()
    root = tmp_path / "grown"
    build_index(docs[:2], root, model=tiny_tok, chunk_tokens=24, overlap=6)
    add_documents(root, docs[2:3])
    grown = add_documents(root, docs[3:])
    assert len(grown.segments) == 3 and grown.num_documents == one_shot.num_documents
    assert _hit_keys(grown) == _hit_keys(one_shot)
    np.testing.assert_allclose(_scores(grown), _scores(one_shot), atol=1e-5)
    ids = list(range(len(docs)))
    assert grown.document_tokens(ids) == one_shot.document_tokens(ids)
    ref = one_shot.datastores()[0]
    rng = random.Random(0)
    for _ in range(50):                      # occurrences over all segments = occurrences in the one-shot store
        d = rng.randrange(len(docs))
        toks = one_shot.document_tokens([d])[0]
        s = rng.randrange(len(toks) - 4)
        pattern = toks[s:s + rng.randrange(1, 5)]
        assert sum(ds.count(pattern) for ds in grown.datastores()) == ref.count(pattern)
    old_dirs = {s.name for s in grown.segments}
    compact = compact_index(root)
    assert len(compact.segments) == 1 and not any((root / n).exists() for n in old_dirs)
    one, merged = one_shot.segments[0], compact.segments[0]
    np.testing.assert_array_equal(merged.datastore.tokens, one.datastore.tokens)
    np.testing.assert_array_equal(merged.datastore.sa, one.datastore.sa)
    np.testing.assert_array_equal(merged.doc_offsets, one.doc_offsets)
    assert merged.chunks.drop_columns(["text"]).equals(one.chunks.drop_columns(["text"]))
    assert merged.documents.to_pylist() == one.documents.to_pylist()
    assert _hit_keys(compact) == _hit_keys(one_shot)
    assert Index.open(root, verify=True).num_chunks == one_shot.num_chunks


def test_embedding_handed_to_another_thread_runs_in_slices(one_shot: Index, tiny_tok: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A service passes its compute thread as `run_torch`: embedding goes there in slices sized by the time a
    chunk takes (so decoding steps run between slices), and the index is the same as one embedded at once."""
    from rasd.index import writer

    monkeypatch.setattr(writer, "EMBED_SLICE_MAX", 4)
    monkeypatch.setattr(writer, "EMBED_SLICE_S", 60.0)     # every chunk is fast: slices grow to the cap
    docs = topic_documents()
    root = tmp_path / "sliced"
    build_index(docs[:1], root, model=tiny_tok, chunk_tokens=24, overlap=6)
    sizes: list[int] = []

    def run_torch(fn, *args):   # noqa: ANN001, ANN202 - a stand-in for ComputeThread.run
        if fn is writer._timed_embed:
            sizes.append(len(args[1]))
        return fn(*args)

    grown = add_documents(root, docs[1:], run_torch=run_torch)
    assert sum(sizes) == grown.num_chunks - grown.segments[0].chunks.num_rows
    assert sizes[0] == 2 and max(sizes) == 4 and len(sizes) > 2
    assert _hit_keys(grown) == _hit_keys(one_shot)
    np.testing.assert_allclose(_scores(grown), _scores(one_shot), atol=1e-5)


def test_compaction_reuses_embeddings(tiny_tok: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = topic_documents(repeat=1)
    build_index(docs[:3], tmp_path / "i", model=tiny_tok, chunk_tokens=24, overlap=6)
    add_documents(tmp_path / "i", docs[3:])
    import rasd.index.embed as embed

    monkeypatch.setattr(embed, "embed_texts", lambda *a, **k: pytest.fail("compaction must not re-embed"))
    assert compact_index(tmp_path / "i").num_documents == len(docs)


def test_in_memory_documents_mix_with_paths(tiny_tok: str, tmp_path: Path) -> None:
    (tmp_path / "extra.md").write_text("Penguins live in the southern hemisphere and swim very well.")
    index = build_index([*topic_documents(1), tmp_path / "extra.md"], tmp_path / "i", model=tiny_tok)
    assert index.search("swimming birds of the south", k=1)[0].title == "extra"
    assert index.documents([6])[0].source.endswith("extra.md")


def test_faiss_kinds(tiny_tok: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="rasd.index"):
        ivf = build_index(topic_documents(), tmp_path / "ivf", model=tiny_tok, chunk_tokens=24, overlap=6,
                          faiss="ivf")
    assert "uses a flat index" in caplog.text                    # too few vectors to train IVF
    assert ivf.manifest["segments"][0]["faiss"] == "flat" and ivf.manifest["faiss"] == "ivf"
    hnsw = build_index(topic_documents(), tmp_path / "hnsw", model=tiny_tok, chunk_tokens=24, overlap=6,
                       faiss="hnsw")
    assert hnsw.search(QUERIES[0], k=1)[0].title == "Rockets"
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((2000, 16)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    index, kind = build_vector_index(vectors, "ivf")
    assert kind == "ivf" and index.nlist == 45
    _, ids = search_vectors(index, vectors[:20], 1)
    assert (ids[:, 0] == np.arange(20)).mean() >= 0.9


def test_leftovers_are_ignored_then_cleaned(one_shot: Index, tiny_tok: str, tmp_path: Path) -> None:
    """What a writer that started from generation 1 (next segment 2) and crashed left is removed by the next
    commit; a segment numbered past the committed counter could be a live writer's on another node (whose
    lock did not exclude us) and stays until the counter passes it."""
    root = tmp_path / "i"
    build_index(topic_documents()[:3], root, model=tiny_tok, chunk_tokens=24, overlap=6)
    (root / ".tmp-seg-000002-abc").mkdir()
    (root / ".tmp-seg-000002-abc" / "tokens.npy").write_bytes(b"junk")
    (root / "seg-000002-dead00").mkdir()                          # renamed, but never committed
    (root / "seg-000009-later0").mkdir()                          # maybe another node's, not committed yet
    (root / "manifest.json.tmp-123").write_text("{")
    (root / "manifest-00000002.json.tmp-99-1").write_text("{")    # a claim's temporary
    (root / "notes.txt").write_text("a person's file")
    assert Index.open(root).num_documents == 3
    add_documents(root, topic_documents()[3:])
    names = {p.name for p in root.iterdir()}
    assert "notes.txt" in names and "seg-000009-later0" in names
    assert not {".tmp-seg-000002-abc", "seg-000002-dead00", "manifest.json.tmp-123",
                "manifest-00000002.json.tmp-99-1"} & names
    assert _hit_keys(Index.open(root)) == _hit_keys(one_shot)


def test_build_refuses_existing_index_and_foreign_folder(tiny_tok: str, tmp_path: Path) -> None:
    docs = topic_documents(1)
    build_index(docs[:2], tmp_path / "i", model=tiny_tok)
    with pytest.raises(IndexInputError, match="already holds an index"):
        build_index(docs, tmp_path / "i", model=tiny_tok)
    again = build_index(docs, tmp_path / "i", model=tiny_tok, overwrite=True)
    assert again.num_documents == len(docs) and len(list((tmp_path / "i").glob("seg-*"))) == 1
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("x")
    with pytest.raises(IndexInputError, match="not empty"):
        build_index(docs, tmp_path / "other", model=tiny_tok)


# --------------------------------------------------------------------------------------------- open errors


def _corrupt_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_open_errors_are_one_line(tiny_tok: str, tmp_path: Path) -> None:
    root = tmp_path / "i"
    build_index(topic_documents(1), root, model=tiny_tok)
    seg = next(root.glob("seg-*"))
    cases = []
    with pytest.raises(IndexOpenError, match="no such index directory") as e:
        Index.open(tmp_path / "nope")
    cases.append(e)
    with pytest.raises(IndexOpenError, match="not a rasd index") as e:
        Index.open(tmp_path)
    cases.append(e)
    _corrupt_byte(seg / "tokens.npy")                              # same size: only the checksum sees it
    with pytest.raises(IndexOpenError, match="tokens.npy: sha256 checksum differs") as e:
        Index.open(root)
    cases.append(e)
    _corrupt_byte(seg / "tokens.npy")                              # flipped back
    (seg / "sa.npy").write_bytes(b"short")
    with pytest.raises(IndexOpenError, match="sa.npy: size 5 bytes differs") as e:
        Index.open(root)
    cases.append(e)
    (seg / "sa.npy").unlink()
    with pytest.raises(IndexOpenError, match="missing file") as e:
        Index.open(root)
    cases.append(e)
    manifest = json.loads((root / "manifest.json").read_text())
    (root / "manifest.json").write_text(json.dumps(dict(manifest, format_version=99)))
    with pytest.raises(IndexOpenError, match="format version 99 is not supported") as e:
        Index.open(root)
    cases.append(e)
    for numbered in root.glob("manifest-*.json"):                 # no copy to fall back on
        numbered.unlink()
    (root / "manifest.json").write_text('{"format": "rasd-index", ')
    with pytest.raises(IndexOpenError, match="corrupt manifest .*rasd index repair") as e:
        Index.open(root)
    cases.append(e)
    assert all("\n" not in str(c.value) for c in cases)


# --------------------------------------------------------------------------------------------- tokenizers


def test_tokenizer_mismatch_is_a_clear_error(one_shot: Index, tmp_path: Path) -> None:
    other = str(make_tiny_tokenizer(tmp_path / "other-tok", vocab_size=280))
    with pytest.raises(TokenizerMismatchError, match="does not match the index's tokenizer"):
        add_documents(one_shot.root, [Document("more text")], model=other)
    with pytest.raises(TokenizerMismatchError, match="tokenizes differently"):
        check_tokenizer(one_shot, other)
    with pytest.raises(TokenizerMismatchError):
        one_shot.check_tokenizer(load_tokenizer(other))
    check_tokenizer(one_shot, one_shot.tokenizer_name)
    same = make_tiny_tokenizer(tmp_path / "same-tok")              # same training: same tokenizer, new path
    check_tokenizer(one_shot, str(same))
    assert one_shot.num_documents == 6                             # the failed add changed nothing


@pytest.mark.parametrize("name", ["tiny", "default"])
def test_tokenizing_equals_the_tokenizer_call_and_converts_where_asked(name: str, tiny_tok: str) -> None:
    """Documents are encoded by the Rust tokenizer directly (it releases the GIL) and converted to arrays
    through `run_python` (a service's compute thread); ids and offsets equal the Python wrapper's."""
    from rasd.index.chunking import _PROBE

    tok = load_tokenizer(tiny_tok if name == "tiny" else "default")
    texts = [d.text for d in topic_documents(3)] + [_PROBE, "  leading  and trailing  ", "x"]
    calls: list[str] = []

    def run_python(fn, *args):   # noqa: ANN001, ANN202 - a stand-in for ComputeThread.run_background
        calls.append(fn.__name__)
        return fn(*args)

    got = tokenize_documents(tok, texts, batch_size=4, run_python=run_python)
    want = tok(texts, add_special_tokens=False, return_offsets_mapping=True)
    assert [g.ids.tolist() for g in got] == want["input_ids"]
    assert [g.offsets.tolist() for g in got] == [[list(o) for o in offs] for offs in want["offset_mapping"]]
    assert all(g.ids.dtype == np.int32 and g.offsets.dtype == np.int64 and g.offsets.shape == (len(g.ids), 2)
               for g in got)
    assert calls == ["_ids_array", "_offsets_array"] * len(texts)


def test_default_tokenizer_end_to_end(tmp_path: Path) -> None:
    """The real SmolLM2 tokenizer: datastore tokens equal the model's own tokenization, and its folder matches."""
    from rasd.decoding.model.loading import default_model_path

    docs = topic_documents(2)
    index = build_index(docs, tmp_path / "i")                       # model="default"
    tok = load_tokenizer("default")
    assert index.tokenizer_name == "default" and index.embedder_name == "default"
    assert index.document_tokens([0]) == [tok(docs[0].text, add_special_tokens=False)["input_ids"]]
    check_tokenizer(index, str(default_model_path()))
    ctx = tok(" the second stage carries the", add_special_tokens=False)["input_ids"]
    length, conts = index.datastores()[0].lookup(ctx, length=3)
    assert length == len(ctx) and tok.decode(conts[0]).startswith(" payload into")


# --------------------------------------------------------------------------------------------- CLI


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_build_add_info_search_compact(tiny_tok: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    for name, text in TOPICS.items():
        (docs / f"{name}.txt").write_text(text * 2)
    more = tmp_path / "more.jsonl"
    more.write_text(json.dumps({"id": "p1", "title": "Penguins", "text": "Penguins swim in cold southern seas."}))
    root = str(tmp_path / "idx")
    code, out, _ = _cli(capsys, "index", "build", str(docs), "--out", root, "--model", tiny_tok,
                        "--chunk-tokens", "32", "--overlap", "8", "--quiet")
    assert code == 0 and "6 documents" in out
    code, out, _ = _cli(capsys, "index", "add", root, str(more), "--quiet")
    assert code == 0 and "7 documents" in out and "2 segment(s)" in out
    code, out, _ = _cli(capsys, "index", "info", root, "--verify", "--json")
    info = json.loads(out)
    assert code == 0 and info["documents"] == 7 and len(info["segments"]) == 2 and info["bytes"] > 0
    assert info["verified"] and info["tokenizer"] == tiny_tok
    code, out, _ = _cli(capsys, "index", "info", root)
    assert code == 0 and "7 documents" in out and "seg-000002" in out
    code, out, _ = _cli(capsys, "index", "search", root, "penguins in cold water", "-k", "2", "--json")
    hits = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and len(hits) == 2 and hits[0]["title"] == "Penguins" and hits[0]["external_id"] == "p1"
    code, out, _ = _cli(capsys, "index", "search", root, "making bread dough")
    assert code == 0 and out.startswith("1. [") and "bread" in out
    code, out, _ = _cli(capsys, "index", "compact", root, "--quiet")
    assert code == 0 and "1 segment(s)" in out


@pytest.mark.parametrize(("args", "message"), [
    (["index", "info", "{tmp}/nope"], "no such index directory"),
    (["index", "search", "{tmp}", "q"], "not a rasd index"),
    (["index", "build", "{tmp}/x.bin.txt", "--out", "{tmp}/o", "--model", "{tok}"], "binary file"),
    (["index", "build", "{tmp}/x.pdf", "--out", "{tmp}/o", "--model", "{tok}"], "unsupported file type"),
    (["index", "build", "{tmp}/ok.txt", "--out", "{tmp}/o", "--overlap", "300", "--model", "{tok}"], "--overlap"),
])
def test_cli_errors_are_one_line_exit_2(tiny_tok: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        args: list[str], message: str) -> None:
    (tmp_path / "x.bin.txt").write_bytes(b"\x00\x01")
    (tmp_path / "x.pdf").write_bytes(b"%PDF")
    (tmp_path / "ok.txt").write_text("fine")
    code, out, err = _cli(capsys, *[a.format(tmp=tmp_path, tok=tiny_tok) for a in args])
    assert code == 2 and out == ""
    assert err.startswith("rasd: error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()                            # a failed build creates nothing


def test_the_writer_lock_waits_at_most_its_timeout(tmp_path: Path) -> None:
    """A service's ingest must not hang on a writer that never finishes (a stuck CLI `add`, another replica)."""
    import threading
    import time

    from rasd.fsio import LockTimeout, writer_lock

    held, release = threading.Event(), threading.Event()

    def other_writer() -> None:
        with writer_lock(tmp_path):
            held.set()
            release.wait(10)

    thread = threading.Thread(target=other_writer)
    thread.start()
    assert held.wait(5)
    start = time.monotonic()
    with pytest.raises(LockTimeout, match="another writer"):
        with writer_lock(tmp_path, timeout_s=0.3):
            pass
    assert 0.3 <= time.monotonic() - start < 3
    release.set()
    thread.join(5)
    with writer_lock(tmp_path, timeout_s=0.3):     # free again: taken at once
        pass


def test_an_idempotency_key_adds_a_batch_once_and_survives_compaction(tiny_tok: str, tmp_path: Path) -> None:
    from rasd.index.writer import idempotency_record

    docs = topic_documents()
    root = tmp_path / "idx"
    build_index(docs[:2], root, model=tiny_tok, chunk_tokens=24, overlap=6)
    claim = {"key": "k1", "body": "b1", "nonce": "first"}
    assert add_documents(root, docs[2:4], idempotency=claim).num_documents == 4
    again = add_documents(root, docs[2:4], idempotency={**claim, "nonce": "second"})
    assert again.num_documents == 4, "the same key never adds twice"
    assert idempotency_record(root, "k1") == {"body": "b1", "nonce": "first", "added": 2,
                                              "segment": again.segments[-1].name}
    assert compact_index(root).num_documents == 4
    assert idempotency_record(root, "k1")["added"] == 2, "kept across a compaction"
    assert add_documents(root, docs[4:5], idempotency={"key": "k2", "body": "b", "nonce": "x"}).num_documents == 5
