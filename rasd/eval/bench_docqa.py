"""Document-QA mode of `rasd bench` (`--task docqa`): LongBench contexts become indexed collections.

LongBench contexts (5k-50k tokens) do not fit the default model's 8k window, which is exactly why a
document-QA service indexes and retrieves instead of pasting them whole. Per QA row (both `context` and
`question`): the context is split into its passages (LongBench marks them "Passage N:"), indexed once
(cached under $RASD_HOME/bench-indexes/ by content hash), and the question goes through the docqa pipeline's
retrieval and prompt. Every method — the HF baselines included — then decodes the identical prompt; the
retrieval methods also draft from the row's datastore, scoped to the retrieved passages.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rasd.eval.datasets import BenchItem, BenchPrompt, gold_answers, read_jsonl

PASSAGE = re.compile(r"(?:^|\n)Passage \d+:\n")


@dataclass
class RetrievalScope:
    """What a retrieval method needs for one prompt: the row's datastores and the retrieved documents."""

    datastores: list[Any]
    scope_docs: list[list[int]]


def qa_rows(path: str | Path, categories: Sequence[str] | None = None,
            limit: int | None = None) -> list[tuple[BenchItem, str, str]]:
    """(item, context, question) for rows with both fields, first `limit` per category, file order."""
    wanted, per_category, rows = set(categories or ()), {}, []
    for i, record in enumerate(read_jsonl(path)):
        context, question = record.get("context"), record.get("question")
        if not (isinstance(context, str) and context.strip() and isinstance(question, str) and question.strip()):
            continue
        dataset = record.get("dataset")
        category = str(record.get("category") or dataset or "docqa")
        if wanted and not wanted & {category, dataset}:
            continue
        if limit is not None and per_category.get(category, 0) >= limit:
            continue
        per_category[category] = per_category.get(category, 0) + 1
        qid = f"{dataset or 'row'}-{record.get('source_key', i)}"
        rows.append((BenchItem(qid, category, question, context, dataset, *gold_answers(record)), context, question))
    if not rows:
        raise ValueError(f"no rows with both context and question in {path}")
    return rows


def split_passages(context: str) -> list[str]:
    """LongBench multi-document contexts as their passages; anything else as one document."""
    parts = [p.strip() for p in PASSAGE.split(context)]
    parts = [p for p in parts if p]
    return parts or [context]


def row_index(context: str, source: str, model: str, log: Callable[[str], None]) -> Any:
    """The row's index, built once and cached by (content, model) hash."""
    from rasd.index.documents import Document
    from rasd.index.store import Index
    from rasd.index.writer import build_index
    from rasd.paths import bench_index_dir

    digest = hashlib.sha256(f"{model}\0{context}".encode()).hexdigest()[:20]
    path = bench_index_dir(digest)
    if not (path / "manifest.json").exists():
        log(f"indexing {source} ({len(context)} chars) into {path}")
        docs = [Document(text=p, source=source, title=p.splitlines()[0][:80]) for p in split_passages(context)]
        build_index(docs, path, model=model)
    return Index.open(path)


def prepare_docqa_prompts(path: str | Path, categories: Sequence[str] | None, limit: int | None, target: Any,
                          max_new_tokens: int, top_k: int, log: Callable[[str], None]) -> list[BenchPrompt]:
    """Retrieve and build each QA row's prompt (untimed); attach the row's RetrievalScope and the retrieved chunks'
    text (the evidence `quality` looks for the gold answer in)."""
    from rasd.apps.docqa import DocQA

    prompts: list[BenchPrompt] = []
    for item, context, question in qa_rows(path, categories, limit):
        index = row_index(context, str(item.question_id), target.name, log)
        qa = DocQA(index, target, method="ar", top_k=top_k, max_new_tokens=max_new_tokens)
        ids, sources = qa.prepare(question)
        doc_ids = list(dict.fromkeys(s.doc_id for s in sources))
        scope = RetrievalScope(index.datastores(), index.document_tokens(doc_ids) if doc_ids else [])
        prompts.append(BenchPrompt(len(prompts), item, ids, scope=scope, evidence=[s.text for s in sources]))
    return prompts
