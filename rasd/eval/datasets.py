"""Benchmark prompts: Spec-Bench / LongBench JSONL rows as `BenchItem`s, fitted to the model's context as
`BenchPrompt`s with the chat template applied once, so every method decodes the same token ids.

Data files are read where they are (e.g. `../shared/data`), never copied.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rasd.text import as_id_list, encode_prompt

if TYPE_CHECKING:
    pass


@dataclass
class BenchItem:
    """One benchmark question before tokenisation.

    `context` is the part of `text` that may be shortened when the prompt is longer than the model's
    window (LongBench's documents); None where the record has no separate context slot.
    """

    question_id: str | int
    category: str
    text: str
    context: str | None = None
    dataset: str | None = None
    answers: list[str] | None = None        # gold answers (LongBench), scored by `quality`
    all_classes: list[str] | None = None    # the label set of a classification dataset (LongBench trec)


@dataclass
class BenchPrompt:
    """A tokenised prompt, with how many tokens truncation removed (0 if none)."""

    index: int
    item: BenchItem
    input_ids: list[int]
    truncated_tokens: int = 0
    scope: Any = None          # RetrievalScope (bench_docqa) for retrieval methods, None otherwise
    evidence: list[str] | None = None   # docqa: the text of the retrieved chunks the prompt was built from


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """Yield the JSON objects of a `.jsonl` or `.jsonl.gz` file, skipping blank lines."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                yield json.loads(line)


def parse_record(record: dict[str, Any], index: int, default_category: str) -> BenchItem | None:
    """Turn one dataset row into a BenchItem, or None if it holds no usable prompt.

    Recognised shapes: Spec-Bench / MT-bench (`turns`: the first turn is the prompt), LongBench
    (`prompt`, or `context` + `question`), and plain `question` rows (GSM8K-style).
    """
    dataset = record.get("dataset")
    category = str(record.get("category") or dataset or default_category)
    qid = _question_id(record, index)
    context = record.get("context") if isinstance(record.get("context"), str) else None
    gold = gold_answers(record)
    turns = record.get("turns")
    if isinstance(turns, list) and turns and isinstance(turns[0], str):
        return BenchItem(qid, category, turns[0], None, dataset, *gold)
    prompt = record.get("prompt")
    if isinstance(prompt, str) and prompt.strip():
        usable = context if context and context in prompt else None
        return BenchItem(qid, category, prompt, usable, dataset, *gold)
    question = record.get("question")
    if isinstance(question, str) and question.strip():
        if context:
            return BenchItem(qid, category, f"{context}\n\n{question}", context, dataset, *gold)
        return BenchItem(qid, category, question, None, dataset, *gold)
    return None


def gold_answers(record: dict[str, Any]) -> tuple[list[str] | None, list[str] | None]:
    """(gold answers, classification labels) of a row: LongBench's `answers` list and `all_classes`, or the
    `{"answers": [...], "all_classes": [...]}` object some LongBench exports put under `answers` (trec)."""
    answers, classes = record.get("answers"), record.get("all_classes")
    if isinstance(answers, dict):
        answers, classes = answers.get("answers"), answers.get("all_classes", classes)
    if isinstance(answers, str):
        answers = [answers]
    good = [str(a) for a in answers] if isinstance(answers, list) and answers else None
    return good, [str(c) for c in classes] if isinstance(classes, list) else None


def _question_id(record: dict[str, Any], index: int) -> str | int:
    """The record's own id where it has one (Spec-Bench `question_id`, LongBench dataset + key)."""
    for key in ("question_id", "task_id", "id"):
        if record.get(key) is not None:
            return record[key]
    if record.get("source_key") is not None:
        return f"{record.get('dataset', 'row')}-{record['source_key']}"
    return index


def load_items(path: str | Path, categories: Sequence[str] | None = None,
               limit: int | None = None) -> list[BenchItem]:
    """Read a dataset file, keep the wanted categories and at most `limit` prompts per category.

    A category filter matches either the `category` or the `dataset` field, so LongBench can be cut by
    task (`hotpotqa`) as well as by group (`multi-doc QA`). File order is kept: the first N per category.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset {path} not found")
    wanted = set(categories or ())
    default_category = path.name.split(".")[0]
    items: list[BenchItem] = []
    per_category: dict[str, int] = {}
    for index, record in enumerate(read_jsonl(path)):
        item = parse_record(record, index, default_category)
        if item is None or (wanted and not wanted & {item.category, item.dataset}):
            continue
        if limit is not None and per_category.get(item.category, 0) >= limit:
            continue
        per_category[item.category] = per_category.get(item.category, 0) + 1
        items.append(item)
    if not items:
        raise ValueError(f"no prompts in {path}" + (f" for categories {sorted(wanted)}" if wanted else ""))
    return items


def _keep_tokens(ids: list[int], keep: int, side: str) -> list[int]:
    """Keep `keep` tokens: the end (`left`: cut from the left) or both ends (`middle`, LongBench's rule)."""
    if keep <= 0:
        return []
    if side == "left":
        return ids[-keep:]
    head = keep // 2
    return ids[:head] + ids[len(ids) - (keep - head):]


def fit_prompt(item: BenchItem, tokenizer: Any, max_prompt_tokens: int, index: int = 0,
               chat: bool = True) -> BenchPrompt | None:
    """Tokenise `item`, shortening it to `max_prompt_tokens` if needed; None if it cannot fit.

    A separate context (LongBench documents) is cut from the left, so the instruction before it and the
    question after it survive. A prompt without one is cut in the middle, LongBench's own rule, which keeps
    the instruction and the question at the two ends. Decode/re-encode can shift a boundary by a token, so
    the cut is re-checked and deepened a few times.
    """
    ids = encode_prompt(tokenizer, item.text, chat)
    if len(ids) <= max_prompt_tokens:
        return BenchPrompt(index, item, ids)
    piece = item.context if item.context and item.context in item.text else item.text
    side = "left" if piece is item.context else "middle"
    piece_ids = as_id_list(tokenizer(piece, add_special_tokens=False)["input_ids"])
    excess = len(ids) - max_prompt_tokens
    for _ in range(5):
        keep = len(piece_ids) - excess
        if keep <= 0:
            return None
        text = item.text.replace(piece, tokenizer.decode(_keep_tokens(piece_ids, keep, side)), 1)
        new_ids = encode_prompt(tokenizer, text, chat)
        if len(new_ids) <= max_prompt_tokens:
            return BenchPrompt(index, item, new_ids, truncated_tokens=len(ids) - len(new_ids))
        excess += len(new_ids) - max_prompt_tokens + 2
    return None


def prepare_prompts(items: Sequence[BenchItem], tokenizer: Any, max_prompt_tokens: int,
                    long_prompts: str = "truncate", chat: bool = True,
                    log: Callable[[str], None] = print) -> list[BenchPrompt]:
    """Tokenise every item; truncate or skip the ones longer than the budget, saying which."""
    prompts: list[BenchPrompt] = []
    for item in items:
        index = len(prompts)
        if long_prompts == "skip":
            ids = encode_prompt(tokenizer, item.text, chat)
            if len(ids) > max_prompt_tokens:
                log(f"skip {item.category}/{item.question_id}: {len(ids)} prompt tokens "
                    f"> {max_prompt_tokens}")
                continue
            prompts.append(BenchPrompt(index, item, ids))
            continue
        prompt = fit_prompt(item, tokenizer, max_prompt_tokens, index, chat)
        if prompt is None:
            log(f"skip {item.category}/{item.question_id}: cannot fit {max_prompt_tokens} prompt tokens")
            continue
        if prompt.truncated_tokens:
            where = "context from the left" if item.context else "prompt in the middle"
            log(f"truncated {item.category}/{item.question_id}: {prompt.truncated_tokens} tokens of the "
                f"{where} (now {len(prompt.input_ids)} tokens)")
        prompts.append(prompt)
    return prompts
