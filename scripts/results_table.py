"""Print a `rasd bench` results.json as a Markdown table (what docs/benchmarks.md quotes).

    python scripts/results_table.py results.json [--method pld] [--baseline hf]

One row per category: each method's decode tok/s, the focus methods' speedup against the baseline (mean of
tokens and per-prompt median), mean accepted tokens and greedy match rate.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def fmt(value: float | None, pattern: str) -> str:
    return "—" if value is None else pattern.format(value)


def table(results: dict, focus: list[str], baseline: str) -> str:
    methods = list(results["methods"])
    head = ["category"] + [f"{m} tok/s" for m in methods]
    for m in focus:
        head += [f"{m} vs {baseline}", f"{m} median", f"{m} mean acc.", f"{m} match"]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    first = results["methods"][methods[0]]["per_category"]
    for cat in list(first) + ["overall"]:
        row = [f"**{cat}**" if cat == "overall" else cat]
        for m in methods:
            entry = results["methods"][m] if cat == "overall" else results["methods"][m]["per_category"][cat]
            row.append(fmt(entry.get("tokens_per_s"), "{:.1f}"))
        for m in focus:
            e = results["methods"][m] if cat == "overall" else results["methods"][m]["per_category"][cat]
            row += [fmt(e.get(f"speedup_vs_{baseline}"), "{:.2f}x"), fmt(e.get(f"median_speedup_vs_{baseline}"),
                    "{:.2f}x"), fmt(e.get("mean_accepted_tokens"), "{:.2f}"), fmt(e.get("greedy_match_rate"),
                                                                                  "{:.2f}")]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path)
    p.add_argument("--method", action="append", default=None, help="focus method (repeatable; default pld)")
    p.add_argument("--baseline", default="hf", choices=["hf", "ar"])
    args = p.parse_args(argv)
    print(table(json.loads(args.results.read_text()), args.method or ["pld"], args.baseline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
