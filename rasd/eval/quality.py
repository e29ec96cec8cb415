"""Answer quality of a `rasd bench` run on LongBench rows: LongBench v1's own metric per row (`longbench_metrics`),
and the retrieval evidence recall of `--task docqa`, per category and overall.

Why once per run: every lossless method gives the reference's tokens, so quality is a property of the model,
the prompt and the retrieval, not of the method; it is scored on the reference method's answers, and a method
whose answers differ (a baseline in other kernels, sampling) is named with how many differ and its own score.
Evidence recall tells a retrieval miss (no chunk holds the answer) from a model miss (it was there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rasd.eval.longbench_metrics import metric_for, normalize_answer, score_answer, unscored_reason

OVERALL = "overall"


def evidence_found(evidence: Sequence[str], answers: Sequence[str]) -> bool:
    """Whether a gold answer, normalized as LongBench normalizes QA answers, occurs as whole words in the
    normalized text of the retrieved chunks."""
    text = f" {normalize_answer(' '.join(evidence))} "
    return any(gold and f" {gold} " in text for gold in (normalize_answer(a) for a in answers))


def score_prompt(prompt: Any, prediction: str) -> dict[str, Any]:
    """One row of the quality table's input: its metric and score (None where not scored) and evidence."""
    item = prompt.item
    metric = metric_for(item.dataset) if item.answers else None
    score = score_answer(item.dataset, prediction, item.answers, item.all_classes or ()) if metric else None
    evidence = evidence_found(prompt.evidence, item.answers) if prompt.evidence is not None and item.answers else None
    return {"index": prompt.index, "question_id": item.question_id, "category": item.category,
            "dataset": item.dataset, "metric": metric, "score": score, "evidence_found": evidence}


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Rows, metrics, mean score over the scored rows and evidence recall over the rows with evidence."""
    scored = [r["score"] for r in rows if r["score"] is not None]
    found = [r["evidence_found"] for r in rows if r["evidence_found"] is not None]
    metrics = sorted({r["metric"] for r in rows if r["metric"]})
    return {"rows": len(rows), "scored_rows": len(scored),
            "metric": ("+".join(metrics) or None) if len(metrics) <= 2 else f"{len(metrics)} metrics",
            "mean_score": sum(scored) / len(scored) if scored else None,
            "evidence_rows": len(found), "evidence_recall": sum(found) / len(found) if found else None}


def _unscored(prompts: Sequence[Any]) -> dict[str, Any]:
    """{dataset or category: {rows, reason}} for the rows that get no score."""
    out: dict[str, Any] = {}
    for p in prompts:
        if not p.item.answers:
            key, reason = p.item.dataset or p.item.category, "no gold answers"
        elif metric_for(p.item.dataset) is None:
            key, reason = p.item.dataset or p.item.category, unscored_reason(p.item.dataset)
        else:
            continue
        entry = out.setdefault(key, {"rows": 0, "reason": reason})
        entry["rows"] += 1
    return out


def _texts(records: Sequence[Any], method: str, tokenizer: Any) -> dict[int, str]:
    return {r.index: tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in records if r.method == method}


def _differing(prompts: Sequence[Any], records: Sequence[Any], reference: str, tokenizer: Any) -> dict[str, Any]:
    """Per method whose answers are not the reference's on every prompt: how many differ, its own mean score."""
    ref = {r.index: r.token_ids for r in records if r.method == reference}
    out: dict[str, Any] = {}
    for method in dict.fromkeys(r.method for r in records if r.method != reference):
        differ = sum(r.token_ids != ref.get(r.index) for r in records if r.method == method)
        if differ:
            texts = _texts(records, method, tokenizer)
            own = summarize([score_prompt(p, texts[p.index]) for p in prompts if p.index in texts])
            out[method] = {"answers_differ": differ, "mean_score": own["mean_score"]}
    return out


def quality_section(prompts: Sequence[Any], records: Sequence[Any], reference: str | None,
                    tokenizer: Any) -> dict[str, Any] | None:
    """results.json's `quality`, scored on `reference`'s answers; None when no prompt has gold answers."""
    if reference is None or not any(p.item.answers for p in prompts):
        return None
    texts = _texts(records, reference, tokenizer)
    rows = [score_prompt(p, texts[p.index]) for p in prompts if p.index in texts]
    categories = sorted({r["category"] for r in rows})
    return {"reference": reference,
            "per_category": {c: summarize([r for r in rows if r["category"] == c]) for c in categories},
            "overall": summarize(rows),
            "per_dataset": {d: summarize([r for r in rows if r["dataset"] == d])
                            for d in sorted({r["dataset"] for r in rows if r["dataset"]})},
            "unscored": _unscored(prompts), "differing_methods": _differing(prompts, records, reference, tokenizer),
            "per_prompt": rows}


# ------------------------------------------------------------------------------------------------ tables

HEADER = ("category", "rows", "metric", "mean score", "evidence recall")


def table_rows(section: dict[str, Any]) -> list[list[str]]:
    """The quality table's cells, per category then overall (the terminal and the report print the same)."""
    groups = [*section["per_category"].items(), (OVERALL, section["overall"])]
    return [[name, str(g["rows"]), g["metric"] or "-", _fmt(g["mean_score"]),
             _fmt(g["evidence_recall"]) + (f" ({g['evidence_rows']})" if g["evidence_rows"] else "")]
            for name, g in groups]


def notes(section: dict[str, Any]) -> list[str]:
    """What the table does not say: rows left unscored and why, methods whose answers differ."""
    out = [f"not scored: {key} ({u['rows']} rows): {u['reason']}" for key, u in section["unscored"].items()]
    ref_score = _fmt(section["overall"]["mean_score"])
    out += [f"{m}'s answers differ from {section['reference']}'s on {d['answers_differ']} prompts "
            f"(its mean score {_fmt(d['mean_score'])}, {section['reference']} {ref_score})"
            for m, d in section["differing_methods"].items()]
    return out


def format_quality(section: dict[str, Any] | None) -> str:
    """The quality table for the terminal, with its notes under it."""
    if section is None:
        return "answer quality: not scored (no gold answers in this dataset)"
    rows = [list(HEADER), *table_rows(section)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = [f"answer quality ({section['reference']}'s answers; LongBench metrics):"]
    lines += [_line(r, widths) for r in rows]
    return "\n".join(lines + notes(section))


def _line(cells: Sequence[str], widths: Sequence[int]) -> str:
    """Text columns (category, metric) to the left, numbers to the right."""
    return "  ".join(c.ljust(w) if i in (0, 2) else c.rjust(w)
                     for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
