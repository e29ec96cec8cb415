"""Looping answers: which reference answers repeat themselves, so that speed can be reported without them.

Why: a small model decoding greedily often loops, and copy-based drafting accepts a loop almost for free, so a
few looping answers can carry a method's whole speedup. Measured on LongBench with the embedded model: one
answer was "Cipriano Castro: 2018, 2019, 2020" six times over, accepted in long copied blocks. The bench
therefore reports the speedup on every answer, the speedup on the answers that do not loop, and how many loop.

An answer's *repetition share* is the share of its tokens that end an n-gram of `REPEAT_NGRAM` tokens which
already occurred earlier in the same answer; it *loops* when that share is at least `LOOPING_SHARE`.
- 8 tokens: longer than the phrases an answer legitimately repeats ("the number of", a name with its title),
  short enough that one repeated sentence counts;
- 20 %: a fifth of an answer spent saying again what it said is a loop to a reader, while an answer that
  quotes one phrase twice stays well under it.

All lossless methods give the reference's tokens, so the split is made once, on the reference method's answers,
and the same prompts are left out of every method and of its baseline (a speedup compares the same prompts).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPEAT_NGRAM = 8        # tokens in the n-gram whose earlier occurrence makes a token a repeat
LOOPING_SHARE = 0.20    # an answer loops when at least this share of its tokens are repeats


def repetition_share(tokens: Sequence[int], ngram: int = REPEAT_NGRAM) -> float:
    """The share of `tokens` that end an `ngram`-token n-gram already seen earlier in `tokens` (0.0 if empty)."""
    if not tokens:
        return 0.0
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    for end in range(ngram, len(tokens) + 1):
        gram = tuple(tokens[end - ngram: end])
        if gram in seen:
            repeats += 1
        seen.add(gram)
    return repeats / len(tokens)


def is_looping(tokens: Sequence[int]) -> bool:
    """Whether an answer loops (its repetition share reaches `LOOPING_SHARE`)."""
    return repetition_share(tokens) >= LOOPING_SHARE


def answer_reference(methods: Sequence[str], greedy_reference: str | None) -> str | None:
    """The method whose answers stand for every method's: the greedy reference, else (sampling: answers differ by
    method) `ar`, `hf` or the first method, so that every method is split on the same prompts."""
    if greedy_reference is not None:
        return greedy_reference
    return next((m for m in ("ar", "hf") if m in methods), methods[0] if methods else None)


def shares_by_prompt(records: Sequence[Any], reference: str | None) -> dict[int, float]:
    """{prompt index: repetition share of the reference's answer}."""
    return {r.index: repetition_share(r.token_ids) for r in records if r.method == reference}


def looping_section(records: Sequence[Any], reference: str | None) -> dict[str, Any]:
    """results.json's `looping`: the rule, the counts overall and per category, and every prompt's share."""
    refs = [r for r in records if r.method == reference]
    rows = [{"index": r.index, "question_id": r.question_id, "category": r.category,
             "repetition_share": round(repetition_share(r.token_ids), 4), "looping": is_looping(r.token_ids),
             "finish_reason": r.finish_reason} for r in refs]
    categories = sorted({row["category"] for row in rows})
    return {"reference": reference, "ngram": REPEAT_NGRAM, "threshold": LOOPING_SHARE,
            "overall": _counts(rows),
            "per_category": {c: _counts([row for row in rows if row["category"] == c]) for c in categories},
            "per_prompt": rows}


def looping_indices(section: dict[str, Any] | None) -> set[int]:
    """The prompt indices whose reference answer loops."""
    return {row["index"] for row in (section or {}).get("per_prompt", []) if row["looping"]}


def _counts(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    looping = sum(row["looping"] for row in rows)
    stopped = sum(row["finish_reason"] == "repetition" for row in rows)
    return {"answers": len(rows), "looping": looping, "share": looping / len(rows) if rows else None,
            "stopped_on_repetition": stopped}


def format_counts(counts: dict[str, Any]) -> str:
    """`2 of 9 (22%)`."""
    share = counts.get("share")
    return f"{counts['looping']} of {counts['answers']}" + (f" ({100 * share:.0f}%)" if share is not None else "")


def looping_line(section: dict[str, Any] | None) -> str:
    """One line for the terminal and the report: how many reference answers loop, overall and per category."""
    if not section or not section.get("reference"):
        return "looping answers: - (no reference method)"
    per = section["per_category"]
    cats = ", ".join(f"{c} {format_counts(per[c])}" for c in per if per[c]["looping"]) if len(per) > 1 else ""
    stopped = section["overall"].get("stopped_on_repetition") or 0
    return (f"looping answers: {format_counts(section['overall'])}" + (f" [{cats}]" if cats else "")
            + (f"; stopped on repetition: {stopped}" if stopped else "")
            + f" ({section['reference']}'s answers; looping: >= {100 * section['threshold']:.0f}% of the tokens "
              f"end an n-gram of {section['ngram']} tokens seen before in the answer)")
