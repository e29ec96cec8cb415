"""Looping answers in `rasd bench`: the repetition share on hand-made token lists, and the speedups on the answers
that do not loop in the aggregate, the terminal table and the plot."""

from __future__ import annotations

import pytest

from rasd.eval.aggregate import build_results
from rasd.eval.bench_output import format_table, plot_speedups
from rasd.eval.looping import (
    LOOPING_SHARE,
    REPEAT_NGRAM,
    answer_reference,
    is_looping,
    looping_line,
    repetition_share,
)
from tests.eval.test_bench import record


def test_repetition_share_counts_tokens_that_end_an_earlier_8_gram():
    assert REPEAT_NGRAM == 8 and LOOPING_SHARE == 0.20
    assert repetition_share([]) == 0.0 and repetition_share([5] * 7) == 0.0      # shorter than one n-gram
    assert repetition_share(list(range(30))) == 0.0
    # two cycles of 8: only the last token closes an 8-gram seen before ([0..7] again)
    assert repetition_share(list(range(8)) * 2) == pytest.approx(1 / 16)
    # three cycles: every 8-gram ending in the third cycle (tokens 16..24) was seen one cycle earlier
    assert repetition_share(list(range(8)) * 3) == pytest.approx(9 / 24)
    # one token 20 times: 13 eight-grams, all the same, the first new
    assert repetition_share([5] * 20) == pytest.approx(12 / 20)


def test_looping_starts_at_the_threshold():
    assert repetition_share([5] * 10) == pytest.approx(0.2) and is_looping([5] * 10)
    assert not is_looping([5] * 10 + [6])                                    # 2 of 11
    assert answer_reference(["pld", "hf"], "ar") == "ar"
    assert answer_reference(["pld", "hf"], None) == "hf" and answer_reference(["pld", "eagle"], None) == "pld"


LOOP = [1, 2, 3] * 10            # repetition share 20/30: loops
PLAIN = list(range(10, 40))      # no repeat


def _records():
    """Prompt 0 loops and pld flies through it; prompt 1 does not loop (two categories)."""
    return [record("ar", 0, "qa", LOOP, 3.0, 29, 1.0), record("ar", 1, "rag", PLAIN, 3.0, 29, 1.0),
            record("pld", 0, "qa", LOOP, 0.5, 5, 5.8), record("pld", 1, "rag", PLAIN, 2.0, 20, 1.5)]


def test_the_aggregate_gives_every_speedup_also_without_the_looping_answers():
    results = build_results({}, _records(), ["ar", "pld"])
    loops = results["looping"]
    assert loops["reference"] == "ar" and loops["overall"] == {"answers": 2, "looping": 1, "share": 0.5,
                                                               "stopped_on_repetition": 0}
    assert [row["looping"] for row in loops["per_prompt"]] == [True, False]
    assert loops["per_prompt"][0]["repetition_share"] == pytest.approx(20 / 30, abs=1e-4)
    pld = results["methods"]["pld"]
    assert pld["speedup_vs_ar"] == pytest.approx((58 / 2.5) / (58 / 6.0))
    assert pld["speedup_vs_ar_not_looping"] == pytest.approx((29 / 2.0) / (29 / 3.0))     # prompt 1 alone
    assert pld["num_looping"] == 1 and pld["speedup_vs_hf_not_looping"] is None          # hf was not run
    assert pld["per_category"]["qa"]["speedup_vs_ar_not_looping"] is None                 # all of qa loops
    assert pld["per_category"]["rag"]["speedup_vs_ar_not_looping"] == pytest.approx(1.5)
    assert "looping answers: 1 of 2 (50%) [qa 1 of 1 (100%)] (ar's answers" in looping_line(loops)


def test_the_table_and_the_plot_show_the_split(tmp_path):
    results = build_results({"model": "m", "device": "cpu", "dtype": "float32", "max_new_tokens": 30}, _records(),
                            ["ar", "pld"])
    table = format_table(results)
    header, *_, overall_pld, note = table.splitlines()
    assert "not loop" in header and overall_pld.startswith("overall") and "pld" in overall_pld
    assert f"{results['methods']['pld']['speedup_vs_ar']:.2f}x" in overall_pld and "1.50x" in overall_pld
    assert note.startswith("not loop: speedup vs ar on the answers that do not loop; looping answers: 1 of 2 (50%)")
    png = tmp_path / "speedup.png"
    plot_speedups(results, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
