"""bench/inprocess_load.py: the sample prompts built here, replayed through the service's batched scheduler
and checked token for token against HF greedy (how the GPU document-QA numbers were measured)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import load_script


@pytest.mark.slow
def test_saved_prompts_replay_through_the_batch_equal_to_hf(tmp_path: Path) -> None:
    script = load_script("inprocess_load")
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "load.json"
    assert script.main(["--save-prompts", str(prompts), "--limit", "3", "--max-tokens", "12"]) == 0
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    assert len(rows) == 3 and all(r["prompt_ids"] and r["sources"] for r in rows)
    preps = script.read_prompts(str(prompts), "rasd", 12)
    assert preps[0].sources[0].doc_id == rows[0]["sources"][0]["doc_id"]      # sources scope the datastore

    assert script.main(["--prompts", str(prompts), "--concurrency", "3", "--max-tokens", "12",
                        "--threads", "2", "--out", str(out), "--plot", str(tmp_path / "load.png")]) == 0
    summary = json.loads(out.read_text())
    (level,) = summary["levels"]
    assert (level["concurrency"], level["completed"], level["errors"], level["timeouts"]) == (3, 3, 0, 0)
    assert level["identical_to_in_process"] == 1.0 and level["differs"] == []   # batched == HF greedy alone
    assert level["completion_tokens"] > 0 and summary["hf_tokens_per_s"] > 0
    assert (tmp_path / "load.png").stat().st_size > 0


def test_replay_needs_prompts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load_script("inprocess_load").main(["--concurrency", "2"])
    assert "--prompts" in capsys.readouterr().err
