"""Benchmark output: the printed table, results JSON (atomic), answers JSONL and the speedup plot."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rasd.eval.aggregate import OVERALL
from rasd.eval.looping import looping_line
from rasd.eval.runners import RunRecord
from rasd.fsio import atomic_file

if TYPE_CHECKING:
    pass


def _fmt(value: float | None, pattern: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, pattern) + suffix


def speedup_base(results: dict[str, Any]) -> str:
    """The baseline the headline speedups are against: HF greedy where it ran, else our `ar`."""
    return "hf" if "hf" in results["methods"] else "ar"


def format_table(results: dict[str, Any]) -> str:
    """A plain-text table: one row per (category, method), the overall rows last; under it what `not loop` means
    and how many reference answers loop."""
    methods = results["methods"]
    base = speedup_base(results)
    categories = sorted({c for entry in methods.values() for c in entry["per_category"]})
    width = max([12, *(len(name) for name in methods)])     # variants like rasd:history=off fit whole
    header = (f"{'category':<16} {'method':<{width}} {'tok/s':>7} {'e2e':>7} {'vs hf':>6} {'med':>6} "
              f"{'vs ar':>6} {'not loop':>8} {'acc':>5} {'match':>5} {'n':>3}")
    lines = [header, "-" * len(header)]
    for cat in [*categories, OVERALL]:
        for name, entry in methods.items():
            s = entry if cat == OVERALL else entry["per_category"].get(cat)
            if s is None:
                continue
            lines.append(_table_row(cat, name, s, width, base))
    lines.append(f"not loop: speedup vs {base} on the answers that do not loop; {looping_line(results.get('looping'))}")
    return "\n".join(lines)


def _table_row(category: str, method: str, s: dict[str, Any], width: int = 12, base: str = "hf") -> str:
    return (f"{category[:16]:<16} {method:<{width}} {_fmt(s['tokens_per_s'], '7.2f'):>7} "
            f"{_fmt(s['e2e_tokens_per_s'], '7.2f'):>7} {_fmt(s['speedup_vs_hf'], '.2f', 'x'):>6} "
            f"{_fmt(s['median_speedup_vs_hf'], '.2f', 'x'):>6} {_fmt(s['speedup_vs_ar'], '.2f', 'x'):>6} "
            f"{_fmt(s.get(f'speedup_vs_{base}_not_looping'), '.2f', 'x'):>8} "
            f"{_fmt(s['mean_accepted_tokens'], '5.2f'):>5} {_fmt(s['greedy_match_rate'], '5.2f'):>5} "
            f"{s['num_prompts']:>3}")


def answer_row(record: RunRecord, tokenizer: Any, model_id: str) -> dict[str, Any]:
    """One Spec-Bench-style answer line (`choices[0].turns` etc.) plus flat fields for quick reading."""
    text = tokenizer.decode(record.token_ids, skip_special_tokens=True)
    return {"question_id": record.question_id, "category": record.category, "method": record.method,
            "model_id": model_id, "answer": text, "token_ids": record.token_ids,
            "new_tokens": record.new_tokens, "finish_reason": record.finish_reason,
            "wall_time": record.total_time_s, "prefill_time_s": record.prefill_time_s,
            "decode_time_s": record.decode_time_s, "tokens_per_s": record.tokens_per_s,
            "steps": record.steps, "accept_lengths": record.accept_lengths,
            "accepted_by_source": record.accepted_by_source,
            "choices": [{"index": 0, "turns": [text], "decoding_steps": [record.steps],
                         "new_tokens": [record.new_tokens], "wall_time": [record.total_time_s],
                         "accept_lengths": record.accept_lengths}],
            "tstamp": time.time()}


def _atomic_write(path: str | Path, text: str) -> None:
    """Write via a temporary sibling and rename, so a crash never leaves a truncated results file."""
    with atomic_file(path) as fh:
        fh.write(text)


def write_results(path: str | Path, results: dict[str, Any]) -> None:
    _atomic_write(path, json.dumps(results, indent=2) + "\n")


def write_answers(path: str | Path, records: Sequence[RunRecord], tokenizer: Any, model_id: str) -> None:
    ordered = sorted(records, key=lambda r: (r.index, r.method))
    _atomic_write(path, "".join(json.dumps(answer_row(r, tokenizer, model_id)) + "\n" for r in ordered))


def plot_speedups(results: dict[str, Any], path: str | Path) -> None:
    """Grouped bars per category: each method's speedup vs HF greedy (vs `ar` if HF was not run), solid on every
    answer and hatched on the answers that do not loop (the report's speedup plot, written on its own)."""
    from rasd.eval.report import plot_speedup_split

    plot_speedup_split(results, Path(path), speedup_base(results))
