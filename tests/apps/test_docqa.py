"""Document QA: prompt building and fitting, LongBench row handling, and `rasd ask` end to end on a real index."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rasd.apps.docqa import Source, encode_messages, fit_sources, user_message
from rasd.eval.bench_docqa import qa_rows, split_passages


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from rasd.decoding.model.loading import default_model_path

    return AutoTokenizer.from_pretrained(str(default_model_path()))


def _sources(n: int, words: int = 60) -> list[Source]:
    return [Source(doc_id=i, chunk_id=10 + i, score=1.0 - i / 10, text=" ".join([f"fact{i}"] * words),
                   title=f"T{i}") for i in range(n)]


def test_user_message_numbers_sources_in_rank_order() -> None:
    msg = user_message("What is it?", _sources(3, 2))
    assert msg.index("[1] T0: fact0") < msg.index("[2] T1: fact1") < msg.index("[3] T2: fact2")
    assert msg.rstrip().endswith("Question: What is it?")


def test_fit_sources_drops_lowest_ranked_until_it_fits(tokenizer) -> None:
    sources = _sources(4)
    full = len(encode_messages(tokenizer, "q?", sources))
    one_less = len(encode_messages(tokenizer, "q?", sources[:3]))
    ids, kept = fit_sources(tokenizer, "q?", sources, max_prompt_tokens=one_less)
    assert [s.doc_id for s in kept] == [0, 1, 2] and len(ids) == one_less < full
    ids, kept = fit_sources(tokenizer, "q?", sources, max_prompt_tokens=full)
    assert len(kept) == 4


def test_fit_sources_rejects_a_question_too_long_alone(tokenizer) -> None:
    with pytest.raises(ValueError, match="question alone"):
        fit_sources(tokenizer, "word " * 400, _sources(2), max_prompt_tokens=50)


def test_split_passages_longbench_markers() -> None:
    ctx = "Passage 1:\nAlpha one.\nmore\nPassage 2:\nBeta two.\nPassage 10:\nGamma."
    assert split_passages(ctx) == ["Alpha one.\nmore", "Beta two.", "Gamma."]
    assert split_passages("plain text without markers") == ["plain text without markers"]


def test_qa_rows_keeps_rows_with_context_and_question(tmp_path: Path) -> None:
    rows = [{"dataset": "hotpotqa", "category": "multi-doc QA", "context": "c1", "question": "q1", "source_key": 1,
             "answers": ["a1", "b1"]},
            {"dataset": "gov_report", "category": "summarization", "context": "c2", "question": ""},
            {"dataset": "hotpotqa", "category": "multi-doc QA", "context": "c3", "question": "q3", "source_key": 3},
            {"dataset": "qasper", "category": "single-doc QA", "context": "c4", "question": "q4"}]
    path = tmp_path / "lb.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    got = qa_rows(path, limit=1)
    assert [(item.category, ctx, q) for item, ctx, q in got] == [("multi-doc QA", "c1", "q1"),
                                                                 ("single-doc QA", "c4", "q4")]
    assert [item.answers for item, _, _ in got] == [["a1", "b1"], None]
    assert [q for _, _, q in qa_rows(path, categories=["hotpotqa"])] == ["q1", "q3"]
    with pytest.raises(ValueError, match="no rows"):
        qa_rows(path, categories=["nothing"])


def test_docqa_prompts_carry_the_retrieved_chunks_as_evidence(tmp_path: Path, monkeypatch) -> None:
    """The evidence `rasd bench` looks for the gold answer in is the text of the chunks the prompt was built from
    (the ones that fit), not every chunk retrieved."""
    from rasd.apps import docqa
    from rasd.eval import bench_docqa

    class FakeIndex:
        def datastores(self):
            return []

        def document_tokens(self, doc_ids):
            return [[d] for d in doc_ids]

    class FakeQA:
        def __init__(self, index, target, **options):
            pass

        def prepare(self, question):
            return [1, 2, 3], _sources(2)

    monkeypatch.setattr(bench_docqa, "row_index", lambda *args: FakeIndex())
    monkeypatch.setattr(docqa, "DocQA", FakeQA)
    path = tmp_path / "lb.jsonl"
    path.write_text(json.dumps({"dataset": "hotpotqa", "context": "c", "question": "q", "answers": ["fact1"]}))
    target = type("Target", (), {"name": "tiny"})()
    [prompt] = bench_docqa.prepare_docqa_prompts(path, None, None, target, 8, 4, lambda _: None)
    assert prompt.evidence == [s.text for s in _sources(2)] and prompt.item.answers == ["fact1"]
    assert prompt.scope.scope_docs == [[0], [1]]


# ------------------------------------------------------------------------- end to end on the real model

DOCS = [
    ("Lighthouses", "The Eddystone Lighthouse stands on rocks south of Plymouth. The present tower, designed by "
                    "James Douglass, was first lit in 1882 and is the fourth lighthouse on the site."),
    ("Bridges", "The Forth Bridge is a cantilever railway bridge across the Firth of Forth in Scotland. It opened "
                "in 1890 and was designed by John Fowler and Benjamin Baker."),
    ("Canals", "The Caledonian Canal connects the Scottish east coast at Inverness with the west coast at Corpach "
               "near Fort William. It was designed by Thomas Telford and opened in 1822."),
]


@pytest.fixture(scope="module")
def qa_setup(tmp_path_factory):
    from rasd.decoding.model.loading import load_model
    from rasd.index import Document, build_index
    from rasd.index.store import Index

    path = tmp_path_factory.mktemp("docqa") / "index"
    build_index([Document(text=t, source=f"test:{title}", title=title) for title, t in DOCS], path)
    return Index.open(path), load_model("default")


@pytest.mark.slow
def test_docqa_methods_equal_hf_greedy_on_the_same_prompt(qa_setup) -> None:
    import torch

    from rasd.apps.docqa import DocQA

    index, target = qa_setup
    question = "Who designed the Forth Bridge and when did it open?"
    answers = {m: DocQA(index, target, method=m, top_k=2, max_new_tokens=48).ask(question)
               for m in ("ar", "retrieval", "rasd")}
    assert answers["rasd"].sources[0].title == "Bridges"
    ids, _ = DocQA(index, target, method="ar", top_k=2, max_new_tokens=48).prepare(question)
    x = torch.tensor([ids])
    with torch.inference_mode():
        ref = target.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=48, do_sample=False,
                                    eos_token_id=sorted(target.eos_token_ids), pad_token_id=0)[0, len(ids):].tolist()
    for method, answer in answers.items():
        assert answer.token_ids == ref, method
    assert answers["rasd"].stats.mean_accepted_tokens > 1.0
    by_source = answers["rasd"].stats.accepted_by_source      # the answer copies spans of the sources
    assert by_source.get("documents", 0) + by_source.get("datastore", 0) + by_source.get("context", 0) > 0


@pytest.mark.slow
def test_rasd_ask_cli_json_and_errors(qa_setup, tmp_path: Path, capsys) -> None:
    from rasd.cli import main

    index, _ = qa_setup
    rc = main(["ask", "--index", str(index.root), "--top-k", "1", "--max-new-tokens", "16", "--json",
               "When was the Caledonian Canal opened?"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and set(out) >= {"answer", "sources", "stats"}
    assert out["sources"][0]["text"].startswith("The Caledonian Canal")
    assert set(out["sources"][0]) >= {"doc_id", "chunk_id", "score", "text"}
    assert main(["ask", "--index", str(tmp_path / "missing"), "q?"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rasd: error:")
    assert main(["ask", "--index", str(index.root), "   "]) == 2
    assert "empty" in capsys.readouterr().err
