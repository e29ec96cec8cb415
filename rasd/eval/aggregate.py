"""Benchmark aggregation: per-category and overall totals (sum of tokens / sum of time, the headline),
per-prompt medians (a single slow prompt on a noisy machine can move a ratio of sums), speedups against `hf`
and `ar` measured in the same run, the same speedups on the prompts whose reference answer does not loop
(`looping`), greedy match rates against the reference, per-step statistics."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rasd.eval.looping import answer_reference, looping_indices, looping_section
from rasd.eval.runners import RunRecord, split_dtype

if TYPE_CHECKING:
    pass

OVERALL = "overall"
SUMMARY_KEYS = ("tokens_per_s", "e2e_tokens_per_s", "speedup_vs_hf", "speedup_vs_ar", "median_speedup_vs_hf",
                "median_speedup_vs_ar", "tokens_per_s_not_looping", "speedup_vs_hf_not_looping",
                "speedup_vs_ar_not_looping", "num_looping", "mean_accepted_tokens", "greedy_match_rate", "num_prompts")

def _ratio(num: float | None, den: float | None) -> float | None:
    """num / den, or None where either is missing or the denominator is not positive."""
    if num is None or den is None or den <= 0 or not math.isfinite(num):
        return None
    return num / den


def _median(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(kept) if kept else None


def summarize_group(records: Sequence[RunRecord]) -> dict[str, Any]:
    """Speed and acceptance of one method over a set of prompts (ratios of sums, not means of ratios)."""
    decode_tokens = sum(r.decode_tokens for r in records)
    decode_time = sum(r.decode_time_s for r in records)
    new_tokens = sum(r.new_tokens for r in records)
    total_time = sum(r.total_time_s for r in records)
    with_steps = [r for r in records if r.steps and r.mean_accepted_tokens is not None]
    steps = sum(r.steps for r in with_steps)
    accepted = sum(r.mean_accepted_tokens * r.steps for r in with_steps)
    return {"tokens_per_s": _ratio(decode_tokens, decode_time),
            "e2e_tokens_per_s": _ratio(new_tokens, total_time),
            "mean_accepted_tokens": _ratio(accepted, steps) if with_steps else None,
            "num_prompts": len(records)}


def match_rate(records: Sequence[RunRecord], reference: dict[int, RunRecord] | None) -> float | None:
    """Fraction of prompts whose tokens equal the reference method's, token for token."""
    if reference is None:
        return None
    pairs = [(r, reference[r.index]) for r in records if r.index in reference]
    if not pairs:
        return None
    return sum(r.token_ids == ref.token_ids for r, ref in pairs) / len(pairs)


def greedy_reference(methods: Sequence[str], greedy: bool) -> str | None:
    """The method greedy outputs are compared with: our `ar`, else HF greedy; None when sampling.

    Why `ar` first: every method must reproduce plain decoding in the same dtype bit for bit (our exactness
    claim); HF computes the same model with other kernels, so it may differ at genuine near-ties, which the bench
    lists apart with HF's top-2 gap at each (`near_ties`)."""
    if not greedy:
        return None
    for name in ("ar", "hf"):
        if name in methods:
            return name
    return None


def reference_for(name: str, methods: Sequence[str], reference: str | None) -> str | None:
    """A dtype variant (`rasd:dtype=float32`) is matched with `ar` in its own dtype (`ar:dtype=float32`) when that
    ran: same output is promised within one dtype."""
    dtype = split_dtype(name)[1]
    if reference is None or dtype is None:
        return reference
    own = f"{reference}:dtype={dtype}"
    return own if own in methods else reference


def _by_method(records: Sequence[RunRecord]) -> dict[str, dict[int, RunRecord]]:
    out: dict[str, dict[int, RunRecord]] = {}
    for r in records:
        out.setdefault(r.method, {})[r.index] = r
    return out


def _group_summary(records: Sequence[RunRecord], by_method: dict[str, dict[int, RunRecord]],
                   reference: str | None, looping: set[int]) -> dict[str, Any]:
    """summarize_group plus the per-prompt quantities that need the other methods' records, and the decode speed
    on the prompts whose reference answer does not loop."""
    summary = summarize_group(records)
    summary["tokens_per_s_not_looping"] = summarize_group([r for r in records
                                                           if r.index not in looping])["tokens_per_s"]
    summary["num_looping"] = sum(r.index in looping for r in records)
    for base in ("hf", "ar"):
        others = by_method.get(base)
        if not others:
            summary[f"median_speedup_vs_{base}"] = None
            continue
        ratios = [_ratio(r.tokens_per_s, others[r.index].tokens_per_s) for r in records if r.index in others]
        summary[f"median_speedup_vs_{base}"] = _median(ratios)
    summary["greedy_match_rate"] = match_rate(records, by_method.get(reference) if reference else None)
    return summary


def aggregate(records: Sequence[RunRecord], methods: Sequence[str], greedy: bool = True,
              looping: set[int] | None = None) -> dict[str, Any]:
    """The `methods` section of results.json: overall and per-category summaries with speedups; `looping`: the
    prompt indices whose reference answer loops, left out of the `*_not_looping` keys."""
    reference = greedy_reference(methods, greedy)
    by_method = _by_method(records)
    categories = sorted({r.category for r in records})
    loops = looping or set()
    out: dict[str, Any] = {}
    for name in methods:
        mine = [r for r in records if r.method == name]
        own = reference_for(name, methods, reference)
        entry = _group_summary(mine, by_method, own, loops)
        entry["per_category"] = {c: _group_summary([r for r in mine if r.category == c], by_method, own, loops)
                                 for c in categories}
        out[name] = entry
    _add_speedups(out)
    return {name: _order_keys(entry) for name, entry in out.items()}


def _add_speedups(methods: dict[str, Any]) -> None:
    """speedup_vs_X = tokens_per_s / X's tokens_per_s on the same prompts (null if X was not run); the same on the
    prompts whose reference answer does not loop (`speedup_vs_X_not_looping`)."""
    for entry in methods.values():
        for base in ("hf", "ar"):
            other = methods.get(base)
            groups = [(entry, other)] + [(summary, other["per_category"].get(cat) if other else None)
                                         for cat, summary in entry["per_category"].items()]
            for summary, ref in groups:
                for speed, key in (("tokens_per_s", f"speedup_vs_{base}"),
                                   ("tokens_per_s_not_looping", f"speedup_vs_{base}_not_looping")):
                    summary[key] = _ratio(summary[speed], ref[speed]) if ref else None


def _order_keys(entry: dict[str, Any]) -> dict[str, Any]:
    """A stable key order for readable JSON: the summary keys, then per_category."""
    ordered = {k: entry.get(k) for k in SUMMARY_KEYS}
    if "per_category" in entry:
        ordered["per_category"] = {c: _order_keys(s) for c, s in entry["per_category"].items()}
    return ordered


def build_results(meta: dict[str, Any], records: Sequence[RunRecord], methods: Sequence[str],
                  greedy: bool = True) -> dict[str, Any]:
    """The whole results.json document: run metadata, then per-method summaries."""
    results = {key: meta.get(key) for key in ("model", "device", "dtype", "torch_threads", "max_new_tokens")}
    results.update({k: v for k, v in meta.items() if k not in results})
    results["greedy_reference"] = greedy_reference(methods, greedy)
    results["looping"] = looping_section(records, answer_reference(methods, results["greedy_reference"]))
    results["methods"] = aggregate(records, methods, greedy, looping_indices(results["looping"]))
    results["step_stats"] = {name: step_stats([r for r in records if r.method == name]) for name in methods}
    return results


def step_stats(records: Sequence[RunRecord]) -> dict[str, Any]:
    """Per-step detail of one method over all its prompts, for `--report` (a separate key of results.json).

    - `accept_length_hist`: steps by tokens committed (bonus included);
    - `position_acceptance`: for draft depth d = 1, 2, ...: `reached` steps whose verified tree had depth
      >= d, `accepted` steps that accepted the token at depth d (needs per-step tree depths: our engine);
    - `accepted_by_source` / `drafted_by_source`: token counts summed over prompts;
    - `tree_tokens_by_bucket`: verified tree size in tokens (root included, as on the cost curve) per
      step, counted per cost-curve context bucket of that step's context length.
    """
    lengths = [n for r in records for n in (r.accept_lengths or [])]
    out: dict[str, Any] = {"steps": len(lengths),
                           "accept_length_hist": _counts(lengths),
                           "accepted_by_source": _sum_counts(r.accepted_by_source for r in records),
                           "drafted_by_source": _sum_counts(r.drafted_by_source for r in records),
                           "position_acceptance": None, "tree_tokens_by_bucket": None}
    with_depths = [r for r in records if r.accept_lengths and r.tree_depths
                   and len(r.tree_depths) == len(r.accept_lengths)]
    pairs = [(a, d) for r in with_depths for a, d in zip(r.accept_lengths, r.tree_depths, strict=True)]
    if pairs:
        deepest = max(d for _, d in pairs)
        out["position_acceptance"] = [{"depth": d, "reached": sum(depth >= d for _, depth in pairs),
                                       "accepted": sum(acc - 1 >= d for acc, _ in pairs)}
                                      for d in range(1, deepest + 1)]
    sized = [r for r in records if r.tree_sizes and r.accept_lengths and len(r.tree_sizes) == len(r.accept_lengths)]
    if sized:
        from rasd.decoding.sizing.cost import context_bucket

        buckets: dict[str, dict[str, int]] = {}
        for r in sized:
            context = r.prompt_tokens + 1          # the prompt plus the first new token from prefill
            for size, accepted in zip(r.tree_sizes, r.accept_lengths, strict=True):
                hist = buckets.setdefault(str(context_bucket(context)), {})
                hist[str(size + 1)] = hist.get(str(size + 1), 0) + 1
                context += accepted
        out["tree_tokens_by_bucket"] = {b: dict(sorted(h.items(), key=lambda kv: int(kv[0])))
                                        for b, h in sorted(buckets.items(), key=lambda kv: int(kv[0]))}
    return out


def _counts(values: Sequence[int]) -> dict[str, int]:
    """{value: count} with string keys (JSON), in increasing order of value."""
    hist: dict[int, int] = {}
    for v in values:
        hist[v] = hist.get(v, 0) + 1
    return {str(k): hist[k] for k in sorted(hist)}


def _sum_counts(dicts: Any) -> dict[str, int]:
    total: dict[str, int] = {}
    for d in dicts:
        for key, n in (d or {}).items():
            total[key] = total.get(key, 0) + int(n)
    return dict(sorted(total.items()))
