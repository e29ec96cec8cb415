"""Per-category accepted tokens by source, from a `rasd bench --answers` JSONL (what docs/benchmarks.md quotes).

    python scripts/source_table.py answers.jsonl[.gz] [--method rasd]

Each cell: the share of the method's accepted draft tokens that came from that source in that category,
with the accepted draft tokens per 100 generated tokens (bonus tokens, the target's own, are not drafts).
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path


def aggregate(path: Path, method: str) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
    """(category -> source -> accepted draft tokens, category -> generated tokens) for `method`."""
    by_source: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    generated: dict[str, int] = defaultdict(int)
    text = gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()
    for line in text.splitlines():
        row = json.loads(line)
        if row["method"] != method:
            continue
        for cat in (row["category"], "overall"):
            generated[cat] += int(row["new_tokens"])
            for source, count in (row.get("accepted_by_source") or {}).items():
                if source not in ("bonus", "prefill"):
                    by_source[cat][source] += int(count)
    return by_source, generated


def table(by_source: dict[str, dict[str, int]], generated: dict[str, int]) -> str:
    sources = sorted({s for counts in by_source.values() for s in counts})
    cats = sorted(c for c in generated if c != "overall") + ["overall"]
    lines = ["| category | " + " | ".join(sources) + " | drafted tokens accepted per 100 generated |",
             "|---" + "|---:" * (len(sources) + 1) + "|"]
    for cat in cats:
        counts = by_source.get(cat, {})
        total = sum(counts.values())
        cells = [f"{100 * counts.get(s, 0) / total:.0f}%" if total else "—" for s in sources]
        name = f"**{cat}**" if cat == "overall" else cat
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {100 * total / max(generated[cat], 1):.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("answers", type=Path)
    parser.add_argument("--method", default="rasd")
    args = parser.parse_args()
    print(table(*aggregate(args.answers, args.method)))


if __name__ == "__main__":
    main()
