"""Tests of the benchmark report (`rasd bench --report DIR`, `python -m rasd.eval.report`).

Reports are built from a hand-made results dict with every optional key, from
tests/eval/data/results_before_report.json (a real run written before the report existed: plots must be
skipped with a note), and end to end through `rasd bench --report` on a tiny random Llama (the model loader
is patched to return it).
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest

from rasd.eval import bench, report
from rasd.eval.aggregate import step_stats
from rasd.eval.runners import RunRecord
from tests.eval import test_bench

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "tests" / "eval" / "data" / "results_before_report.json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ALL_PLOTS = ("speedup.png", "accepted_tokens.png", "position_acceptance.png", "accepted_by_source.png",
             "cost_curve.png")

tiny_tokenizer = test_bench.tiny_tokenizer   # module fixtures, shared with the bench tests
tiny_target = test_bench.tiny_target


def _summary(tps: float, acc: float | None, n: int = 2, **extra) -> dict:
    s = {"tokens_per_s": tps, "e2e_tokens_per_s": tps * 0.9, "speedup_vs_hf": None, "speedup_vs_ar": None,
         "median_speedup_vs_hf": None, "median_speedup_vs_ar": None, "mean_accepted_tokens": acc,
         "greedy_match_rate": 1.0, "num_prompts": n}
    s.update(extra)
    return s


def synthetic_results() -> dict:
    """A results.json with two categories, three methods and every key the report can use."""
    methods = {}
    for name, tps, acc in (("ar", 10.0, 1.0), ("hf", 10.5, 1.0), ("rasd", 21.234, 2.5)):
        entry = _summary(tps, acc, 4, speedup_vs_hf=tps / 10.5, speedup_vs_ar=tps / 10.0,
                         speedup_vs_hf_not_looping=tps / 10.5 * 0.75, speedup_vs_ar_not_looping=tps / 10.0 * 0.75)
        entry["per_category"] = {"qa": _summary(tps * 1.1, acc, speedup_vs_hf=tps * 1.1 / 11.55),
                                 "rag": _summary(tps * 0.9, acc, speedup_vs_hf=None)}
        methods[name] = entry
    return {"model": "tiny", "device": "cpu", "dtype": "float32", "torch_threads": 1, "max_new_tokens": 8,
            "dataset": "q.jsonl", "limit": 2, "num_prompts": 4, "date": "2026-11-26T08:00:00Z",
            "greedy_reference": "hf", "methods": methods,
            "looping": {"reference": "hf", "ngram": 8, "threshold": 0.2,
                        "overall": {"answers": 4, "looping": 1, "share": 0.25, "stopped_on_repetition": 0},
                        "per_category": {"qa": {"answers": 2, "looping": 1, "share": 0.5, "stopped_on_repetition": 0},
                                         "rag": {"answers": 2, "looping": 0, "share": 0.0,
                                                 "stopped_on_repetition": 0}},
                        "per_prompt": []},
            "quality": {"reference": "hf",
                        "per_category": {"qa": {"rows": 2, "scored_rows": 2, "metric": "qa_f1", "mean_score": 0.5,
                                                "evidence_rows": 2, "evidence_recall": 1.0},
                                         "rag": {"rows": 2, "scored_rows": 2, "metric": "rouge_l",
                                                 "mean_score": 0.25, "evidence_rows": 0, "evidence_recall": None}},
                        "overall": {"rows": 4, "scored_rows": 4, "metric": "qa_f1+rouge_l", "mean_score": 0.375,
                                    "evidence_rows": 2, "evidence_recall": 1.0},
                        "per_dataset": {}, "unscored": {}, "differing_methods": {}, "per_prompt": []},
            "step_stats": {
                "hf": {"steps": 20, "accept_length_hist": {"1": 20}, "accepted_by_source": {},
                       "drafted_by_source": {}, "position_acceptance": None, "tree_tokens_by_bucket": None},
                "rasd": {"steps": 10, "accept_length_hist": {"1": 4, "3": 3, "4": 3},
                         "accepted_by_source": {"datastore": 9, "context": 6, "bonus": 10, "draft": 0},
                         "drafted_by_source": {"datastore": 20, "context": 15},
                         "position_acceptance": [{"depth": 1, "reached": 8, "accepted": 6},
                                                 {"depth": 2, "reached": 8, "accepted": 6},
                                                 {"depth": 3, "reached": 5, "accepted": 3}],
                         "tree_tokens_by_bucket": {"256": {"1": 2, "4": 5}, "1024": {"8": 3}}}},
            "cost_curves": [{"key": "tiny-ctx256", "context_len": 256, "sizes": [1, 2, 4, 8],
                             "latency_s": [0.010, 0.011, 0.012, 0.016], "methods": ["rasd"]},
                            {"key": "tiny-ctx1024", "context_len": 1024, "sizes": [1, 2, 4, 8],
                             "latency_s": [0.012, 0.013, 0.015, 0.020], "methods": ["rasd"]}]}


def assert_valid_png(path: Path) -> None:
    from PIL import Image

    assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 1000, path
    with Image.open(path) as img:
        img.verify()
    with Image.open(path) as img:
        assert img.size[0] > 100 and img.size[1] > 100


def parse_summary(md: str) -> dict[tuple[str, str], dict[str, str]]:
    """The summary table of report.md back as {(category, method): {results.json key: cell}}."""
    section = md.split("## Summary", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    assert header[:2] == ["category", "method"]
    titles = {title: key for key, title, _ in report.TABLE_COLUMNS}
    out = {}
    for line in rows[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        category = cells[0].strip("*")
        out[(category, cells[1])] = {titles[h]: c for h, c in zip(header[2:], cells[2:], strict=True)}
    return out


def assert_table_matches(md: str, results: dict) -> None:
    table = parse_summary(md)
    expected_rows = 0
    for name, entry in results["methods"].items():
        for category in [*entry["per_category"], "overall"]:
            summary = entry if category == "overall" else entry["per_category"][category]
            cells = table[(category, name)]
            expected_rows += 1
            for key, _, _ in report.TABLE_COLUMNS:
                value = summary.get(key)
                if value is None:
                    assert cells[key] == "-", (category, name, key)
                else:
                    assert float(cells[key]) == pytest.approx(value, abs=0.005 + 1e-9), (category, name, key)
    assert len(table) == expected_rows


# --------------------------------------------------------------------------------- the report itself


def test_full_report_from_synthetic_results(tmp_path):
    results = synthetic_results()
    md_path = report.write_report(results, tmp_path / "rep")
    folder = md_path.parent
    for name in ALL_PLOTS:
        assert_valid_png(folder / name)
    md = md_path.read_text()
    assert "> **Note:**" not in md
    for name in ALL_PLOTS:
        assert f"]({name})" in md
    assert_table_matches(md, results)
    assert "2026-11-26T08:00:00Z" in md and "| torch threads | 1 |" in md and "`q.jsonl`" in md
    assert "0.75 (8)" in md and "0.60 (5)" in md                  # acceptance per depth: 6/8, 3/5
    assert "9 (36%)" in md                                        # datastore share of 25 accepted tokens
    assert "| 256 | 10.0 | 11.0 | 12.0 | 16.0 |" in md
    assert "looping answers: 1 of 4 (25%) [qa 1 of 2 (50%)] (hf's answers" in md
    assert "| qa | 2 | qa_f1 | 0.50 | 1.00 (2) |" in md and "| rag | 2 | rouge_l | 0.25 | - |" in md
    assert "| **overall** | 4 | qa_f1+rouge_l | 0.38 | 1.00 (2) |" in md
    html = (folder / "report.html").read_text()
    assert html.count("data:image/png;base64,") == len(ALL_PLOTS) and 'src="speedup.png"' not in html
    assert "<b>overall</b>" in html


def test_committed_results_give_table_and_notes_for_missing_data(tmp_path):
    results = json.loads(COMMITTED.read_text())
    assert report.main([str(COMMITTED), "--out", str(tmp_path / "rep"), "--cost-dir", str(tmp_path)]) == 0
    folder = tmp_path / "rep"
    for name in ("speedup.png", "accepted_tokens.png"):
        assert_valid_png(folder / name)
    for name in ("position_acceptance.png", "accepted_by_source.png", "cost_curve.png"):
        assert not (folder / name).exists()
    md = (folder / "report.md").read_text()
    assert_table_matches(md, results)
    assert md.count("> **Note:** no plot:") == 3 and "date | not recorded" in md
    assert (folder / "report.html").stat().st_size > 10_000


def test_cost_curves_can_come_from_a_cost_cache(tmp_path):
    results = json.loads(COMMITTED.read_text())
    cache = tmp_path / "cost"
    cache.mkdir()
    for version, latency in ((1, 0.5), (2, 0.06)):
        key = f"default-0123abcd-cpu-float32-t2-ctx256-v{version}"
        (cache / f"{key}.json").write_text(json.dumps({"key": key, "context_len": 256, "sizes": [1, 2, 4],
                                                      "latency_s": [latency, latency, 2 * latency]}))
    (cache / "default-0123abcd-cpu-float32-t1-ctx256-v2.json").write_text("{}")   # other thread count
    curves = report.curves_from_cache(results, cache)
    assert [c["key"] for c in curves] == ["default-0123abcd-cpu-float32-t2-ctx256-v2"]
    md = report.write_report(results, tmp_path / "rep", cost_dir=cache).read_text()
    assert_valid_png(tmp_path / "rep" / "cost_curve.png")
    assert "local cache's curves" in md and "| 256 | 60.0 | 60.0 | 120.0 |" in md
    assert "sizes the cost model chose are not shown" in md


def test_missing_baselines_and_values_are_notes_not_crashes(tmp_path):
    results = synthetic_results()
    del results["methods"]["ar"], results["methods"]["hf"], results["step_stats"], results["cost_curves"]
    results["methods"]["rasd"]["mean_accepted_tokens"] = None
    for summary in results["methods"]["rasd"]["per_category"].values():
        summary["mean_accepted_tokens"] = None
    md = report.write_report(results, tmp_path, html_file=False).read_text()
    assert "neither `hf` nor `ar` was run" in md and md.count("> **Note:** no plot:") == 5
    assert not any((tmp_path / name).exists() for name in ALL_PLOTS)
    assert not (tmp_path / "report.html").exists()
    assert_table_matches(md, results)


def test_entry_point_rejects_unreadable_or_foreign_files(tmp_path, capsys):
    (tmp_path / "x.json").write_text('{"a": 1}')
    assert report.main([str(tmp_path / "x.json"), "--out", str(tmp_path / "r")]) == 2
    assert report.main([str(tmp_path / "none.json"), "--out", str(tmp_path / "r")]) == 2
    assert "error" in capsys.readouterr().err


# ----------------------------------------------------------------------------- what bench records


def test_step_stats_position_acceptance_sources_and_buckets():
    def rec(accept, depths, sizes, prompt_tokens):
        return RunRecord(method="m", index=0, question_id=0, category="qa", token_ids=[1] * 9,
                         finish_reason="length", prefill_time_s=0.1, decode_time_s=1.0, total_time_s=1.1,
                         decode_tokens=8, steps=len(accept), mean_accepted_tokens=1.0, accept_lengths=accept,
                         accepted_by_source={"context": sum(accept) - len(accept), "bonus": len(accept)},
                         tree_sizes=sizes, tree_depths=depths, drafted_by_source={"context": sum(sizes)},
                         prompt_tokens=prompt_tokens)

    stats = step_stats([rec([3, 1, 2], [3, 0, 2], [3, 0, 2], 10), rec([1, 4], [1, 3], [1, 5], 700)])
    assert stats["steps"] == 5 and stats["accept_length_hist"] == {"1": 2, "2": 1, "3": 1, "4": 1}
    # depth 1 reached by 4 steps (depths 3,2,1,3), accepted by 3 (accept lengths 3,2,4); depth 3: 2 / 1
    assert stats["position_acceptance"] == [{"depth": 1, "reached": 4, "accepted": 3},
                                            {"depth": 2, "reached": 3, "accepted": 2},
                                            {"depth": 3, "reached": 2, "accepted": 1}]
    assert stats["accepted_by_source"] == {"bonus": 5, "context": 6} and stats["drafted_by_source"] == {"context": 11}
    assert stats["tree_tokens_by_bucket"] == {"256": {"1": 1, "3": 1, "4": 1}, "1024": {"2": 1, "6": 1}}
    hf = RunRecord(method="hf", index=0, question_id=0, category="qa", token_ids=[1, 2], finish_reason="length",
                   prefill_time_s=0.1, decode_time_s=1.0, total_time_s=1.1, decode_tokens=1, accept_lengths=[1])
    assert step_stats([hf])["position_acceptance"] is None and step_stats([hf])["tree_tokens_by_bucket"] is None


def test_bench_accepts_report_next_to_out_and_plot():
    import argparse

    parser = argparse.ArgumentParser(prog="rasd")
    bench.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--dataset", "q.jsonl", "--out", "r.json", "--plot", "r.png",
                              "--report", "rep"])
    assert (args.out, args.plot, args.report) == ("r.json", "r.png", "rep")


@pytest.mark.skipif(not test_bench.HAS_ENGINE, reason="rasd.decoding.runtime.engine not written yet")
def test_bench_report_end_to_end_on_a_tiny_llama(tiny_target, tmp_path, monkeypatch, one_thread, capsys):
    import rasd.decoding.model.loading as models

    monkeypatch.setenv("RASD_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(models, "load_model", lambda *a, **k: tiny_target)
    data = test_bench.write_jsonl(tmp_path / "q.jsonl", [
        {"question_id": 1, "category": "qa", "turns": ["the quick brown fox jumps over the lazy dog " * 3],
         "dataset": "samsum", "answers": ["the quick fox"]},
        {"question_id": 2, "category": "rag", "turns": ["Answer the question based on the passages. " * 3]}])
    out, rep = tmp_path / "results.json", tmp_path / "report"
    rc = bench.main(["--dataset", str(data), "--methods", "ar,hf,pld", "--max-new-tokens", "12",
                     "--stop-on-repetition", "--repetition-window", "4",
                     "--no-progress", "--out", str(out), "--plot", str(tmp_path / "p.png"), "--report", str(rep)])
    assert rc == 0
    printed = capsys.readouterr().out
    results = json.loads(out.read_text())
    assert results["repetition_window"] == 4 and results["looping"]["overall"]["answers"] == 2
    assert results["quality"]["per_category"]["qa"]["metric"] == "rouge_l"
    assert results["quality"]["unscored"] == {"rag": {"rows": 1, "reason": "no gold answers"}}
    assert "looping answers: " in printed and "answer quality (ar's answers" in printed
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", results["date"])
    pld = results["step_stats"]["pld"]
    assert pld["steps"] > 0 and pld["accepted_by_source"]["bonus"] == pld["steps"]
    assert sum(sum(h.values()) for h in pld["tree_tokens_by_bucket"].values()) == pld["steps"]
    assert results["cost_curves"] and "pld" in results["cost_curves"][0]["methods"]
    assert results["step_stats"]["hf"]["tree_tokens_by_bucket"] is None
    md = (rep / "report.md").read_text()
    assert_table_matches(md, results)
    assert "## Answer quality" in md and "| stop on repetition (window) | 4 |" in md
    for name in ("speedup.png", "accepted_tokens.png", "accepted_by_source.png", "cost_curve.png"):
        assert_valid_png(rep / name)
    # a random model may never draft deep enough to plot per-position rates: then a note stands in
    assert (rep / "position_acceptance.png").exists() or "no verified tree held a draft token" in md
    assert (rep / "report.html").exists()


# ------------------------------------------------------------------- the Markdown tables docs/ quotes


def test_speed_table_per_category_with_focus_columns(tmp_path, capsys):
    results = synthetic_results()
    lines = report.speed_table(results, ["rasd"], "hf").splitlines()
    assert lines[0] == ("| category | ar tok/s | hf tok/s | rasd tok/s | rasd vs hf | rasd vs hf (not looping) "
                        "| rasd median | rasd mean acc. | rasd match |")
    assert [line.split(" | ")[0] for line in lines[2:5]] == ["| qa", "| rag", "| **overall**"]
    qa = results["methods"]["rasd"]["per_category"]["qa"]
    assert lines[2] == (f"| qa | 11.0 | 11.6 | {qa['tokens_per_s']:.1f} | {qa['speedup_vs_hf']:.2f}x | - | - | 2.50 "
                        "| 1.00 |")
    assert " | - | - | - | 2.50 |" in lines[3]                   # rag: no speedup recorded for it
    overall = results["methods"]["rasd"]
    assert f" | {overall['speedup_vs_hf']:.2f}x | {overall['speedup_vs_hf_not_looping']:.2f}x | " in lines[4]
    assert lines[5] == "" and lines[6].startswith("looping answers: 1 of 4 (25%)")
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    assert report.main([str(path), "--table", "--focus", "rasd", "--baseline", "ar"]) == 0
    printed = capsys.readouterr().out
    assert "rasd vs ar" in printed and f"{21.234 / 10.0:.2f}x" in printed and not (tmp_path / "report.md").exists()
    assert report.main([str(path), "--table", "--focus", "pld"]) == 2           # pld was not run
    assert "pld not in" in capsys.readouterr().err


def test_source_shares_from_an_answers_file(tmp_path, capsys):
    rows = [
        {"method": "rasd", "category": "qa", "new_tokens": 100, "accepted_by_source": {"bonus": 60, "context": 30,
                                                                                        "recycling": 10}},
        {"method": "rasd", "category": "coding", "new_tokens": 50, "accepted_by_source": {"bonus": 40, "draft": 10}},
        {"method": "pld", "category": "qa", "new_tokens": 100, "accepted_by_source": {"context": 99}},
    ]
    path = tmp_path / "answers.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    by_source, generated = report.answers_by_source(path, "rasd")
    assert by_source["qa"] == {"context": 30, "recycling": 10} and generated["overall"] == 150
    text = report.source_share_table(by_source, generated).splitlines()
    assert text[0].startswith("| category | context | draft | recycling |")
    assert text[2:] == ["| coding | 0% | 100% | 0% | 20 |", "| qa | 75% | 0% | 25% | 40 |",
                        "| **overall** | 60% | 20% | 20% | 33 |"]
    assert report.main([str(path), "--sources", "--method", "pld"]) == 0
    assert capsys.readouterr().out.splitlines()[2] == "| qa | 100% | 99 |"


def test_a_report_needs_out_unless_a_table_is_asked_for(tmp_path, capsys):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(synthetic_results()))
    assert report.main([str(path)]) == 2
    assert "--out is required" in capsys.readouterr().err
    assert report.main([str(tmp_path / "missing.jsonl"), "--sources"]) == 2


def test_rasd_report_is_the_same_entry_point(tmp_path, capsys):
    from rasd import cli

    path = tmp_path / "results.json"
    path.write_text(json.dumps(synthetic_results()))
    assert cli.main(["report", str(path), "--table", "--focus", "rasd"]) == 0
    assert capsys.readouterr().out.strip() == report.speed_table(synthetic_results(), ["rasd"], "hf")
    assert cli.main(["report", str(path), "--out", str(tmp_path / "r"), "--no-html"]) == 0
    assert (tmp_path / "r" / "report.md").exists() and not (tmp_path / "r" / "report.html").exists()
