"""scripts/source_table.py: per-category accepted draft tokens by source from a bench answers file."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import load_script


def test_shares_and_rates_per_category(tmp_path: Path) -> None:
    rows = [
        {"method": "rasd", "category": "qa", "new_tokens": 100, "accepted_by_source": {"bonus": 60, "context": 30,
                                                                                        "recycling": 10}},
        {"method": "rasd", "category": "coding", "new_tokens": 50, "accepted_by_source": {"bonus": 40, "draft": 10}},
        {"method": "pld", "category": "qa", "new_tokens": 100, "accepted_by_source": {"context": 99}},
    ]
    path = tmp_path / "answers.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    script = load_script("source_table")
    by_source, generated = script.aggregate(path, "rasd")
    assert dict(by_source["qa"]) == {"context": 30, "recycling": 10} and generated["overall"] == 150
    text = script.table(by_source, generated).splitlines()
    assert text[0].startswith("| category | context | draft | recycling |")
    assert text[2] == "| coding | 0% | 100% | 0% | 20 |"
    assert text[3] == "| qa | 75% | 0% | 25% | 40 |"
    assert text[4] == "| **overall** | 60% | 20% | 20% | 33 |"
