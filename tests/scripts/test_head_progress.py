"""scripts/head_progress.py: the shipped heads' reports read, their training summed, the projection fitted."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tests.helpers import load_script


def _report(folder: Path, version: int, tokens: int, steps: int, top1: float) -> None:
    row = {"train_tokens": tokens, "steps": steps, "batch": 2, "seq_len": 10, "regenerate": 8,
           "turns": [1, 2, 3, 4], "agreement": {"top1": [top1, top1 - 0.1, top1 - 0.2, top1 - 0.3],
                                                "top4": [top1 + 0.2] * 4}}
    (folder / f"eagle_head_v{version}_report_2026-01-0{version}.json").write_text(json.dumps(row))


def test_cumulative_training_and_log_fit(tmp_path: Path) -> None:
    for version, top1 in ((1, 0.40), (2, 0.45), (10, 0.50)):     # v10 sorts after v2 by number, not by name
        _report(tmp_path, version, 1000 * version, 50, top1)
    script = load_script("head_progress")
    rows = script.load_reports(tmp_path)
    script.add_cumulative(rows)
    assert [r["version"] for r in rows] == [1, 2, 10]
    assert [r["trained"] for r in rows] == [1000, 2000, 3000]
    slope, icpt = script.fit_log2(rows[:2])                      # one doubling: +0.05
    assert math.isclose(slope, 0.05) and math.isclose(slope * math.log2(1000) + icpt, 0.40)
    assert script.table(rows).splitlines()[2].startswith("| v1 | 1,000 | 50 | 0.0M | 0.400 / 0.300")


def test_shipped_reports_plot(tmp_path: Path) -> None:
    script = load_script("head_progress")
    rows = script.load_reports(Path(__file__).parents[2] / "docs" / "results")
    script.add_cumulative(rows)
    fitted = [r for r in rows if script.self_generated(r)]
    assert len(fitted) >= 2 and all(r["agreement"]["top1"][0] > 0.3 for r in fitted)
    png = tmp_path / "progress.png"
    script.plot(rows, script.fit_log2(fitted), fitted, png)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_an_averaged_head_says_so_with_what_training_alone_reached() -> None:
    script = load_script("head_progress")
    assert script.averaged({"steps": 10}) == ""
    row = {"average_init": 0.5, "agreement_trained": {"top1": [0.5978, 0.56, 0.52, 0.51]}}
    assert script.averaged(row) == ", averaged with its parent at 0.5 (trained alone 0.598)"
