"""Answer quality in `rasd bench`: LongBench v1's metrics on hand-made answers with values worked out by hand,
the gold answers read from LongBench rows, retrieval evidence recall, and the per-category quality section."""

from __future__ import annotations

import pytest

from rasd.eval.datasets import BenchItem, BenchPrompt, gold_answers, load_items
from rasd.eval.longbench_metrics import (
    classification_score,
    code_sim_score,
    count_score,
    metric_for,
    normalize_answer,
    qa_f1_score,
    retrieval_score,
    rouge_l_score,
    score_answer,
    unscored_reason,
)
from rasd.eval.quality import evidence_found, format_quality, quality_section
from rasd.eval.runners import RunRecord
from tests.eval.test_bench import LONGBENCH, NO_DATA


def test_normalization_and_qa_f1():
    assert normalize_answer("The  Cat, sat! An apple.") == "cat sat apple"
    # "the cat sat" -> [cat, sat]; "a cat sat on" -> [cat, sat, on]: 2 shared, P = 1, R = 2/3, F1 = 0.8
    assert qa_f1_score("the cat sat", "a cat sat on") == pytest.approx(0.8)
    assert qa_f1_score("dog", "cat") == 0.0 and qa_f1_score("", "cat") == 0.0
    assert qa_f1_score("cat cat", "cat") == pytest.approx(2 * 0.5 * 1 / 1.5)   # a repeated word counts once


def test_rouge_l_is_the_f_measure_of_the_longest_common_word_subsequence():
    # [the cat sat on the mat] vs [the cat is on the mat]: LCS "the cat on the mat" = 5 of 6 words each side
    assert rouge_l_score("the cat sat on the mat", "the cat is on the mat") == pytest.approx(5 / 6)
    assert rouge_l_score("mat the", "the cat mat") == pytest.approx(2 * (1 / 2) * (1 / 3) / (1 / 2 + 1 / 3))
    assert rouge_l_score("", "the cat") == 0.0


def test_count_retrieval_classification_and_code_similarity():
    assert count_score("There are 46 passages, not 45.", "46") == 0.5
    assert count_score("no number", "46") == 0.0
    assert retrieval_score("Paragraph 12", "Paragraph 12") == 1.0
    assert retrieval_score("12 or 13", "Paragraph 12") == 0.5
    assert retrieval_score("12", "no paragraph named") == 0.0
    classes = ["Other entity", "Other", "Date", "Food"]
    assert classification_score("Other entity", "Other entity", all_classes=classes) == 1.0   # "Other" inside gold
    assert classification_score("Date and Food", "Date", all_classes=classes) == 0.5
    assert classification_score("Nothing", "Date", all_classes=classes) == 0.0
    assert code_sim_score("\n# a comment\nx = foo(1)\nmore", "x = foo(1)") == 1.0   # first line that is code
    assert code_sim_score("abcd", "abce") == 0.75          # Indel distance 2 over 8 characters


def test_score_answer_takes_the_best_gold_and_the_first_line_where_longbench_does():
    assert score_answer("hotpotqa", "Paris France", ["London", "Paris"]) == pytest.approx(2 / 3)
    assert score_answer("samsum", "Tom is late.\nextra words here", ["Tom is late."]) == 1.0
    assert score_answer("qmsum", "Tom is late.\nextra words here", ["Tom is late."]) < 1.0   # not cut
    assert score_answer("trec", "Date\nFood", ["Date"], ["Date", "Food"]) == 1.0
    assert metric_for("lcc") == "code_sim" and metric_for("multifieldqa_zh") is None and metric_for(None) is None
    assert "Chinese" in unscored_reason("multifieldqa_zh") and "not a LongBench" in unscored_reason("squad")


def test_gold_answers_from_both_row_shapes():
    assert gold_answers({"answers": ["a", "b"]}) == (["a", "b"], None)
    assert gold_answers({"answers": {"answers": ["Date"], "all_classes": ["Date", "Food"]}}) == (
        ["Date"], ["Date", "Food"])
    assert gold_answers({"answers": ["x"], "all_classes": ["x", "y"]}) == (["x"], ["x", "y"])
    assert gold_answers({"turns": ["hi"]}) == (None, None) and gold_answers({"answers": []}) == (None, None)


def test_evidence_is_a_normalized_gold_answer_as_whole_words_in_the_chunks():
    chunks = ["Bob Dylan recorded it in 1990.", "The Traveling Wilburys were a supergroup."]
    assert evidence_found(chunks, ["bob dylan"]) and evidence_found(chunks, ["The Traveling Wilburys!"])
    assert not evidence_found(chunks, ["George Harrison"])
    assert not evidence_found(chunks, ["199"])                   # a number inside another is not found
    assert not evidence_found(chunks, ["the"])                   # normalized to nothing


class WordTokenizer:
    """Token id i is the word WORDS[i]."""

    WORDS = ["<eos>", "paris", "london", "is", "the", "capital", "sum", "46"]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(self.WORDS[i] for i in ids if not (skip_special_tokens and i == 0))


def _prompt(index, dataset, category, answers, evidence=None):
    return BenchPrompt(index, BenchItem(index, category, "q", None, dataset, answers), [1], evidence=evidence)


def _record(method, index, tokens):
    return RunRecord(method=method, index=index, question_id=index, category="", token_ids=tokens,
                     finish_reason="length", prefill_time_s=0.1, decode_time_s=1.0, total_time_s=1.1,
                     decode_tokens=len(tokens) - 1)


def test_the_quality_section_per_category_with_evidence_unscored_rows_and_differing_methods():
    prompts = [_prompt(0, "hotpotqa", "multi-doc QA", ["Paris"], ["Paris is the capital."]),
               _prompt(1, "hotpotqa", "multi-doc QA", ["London"], ["Nothing here."]),
               _prompt(2, "passage_count", "synthetic", ["46"]),
               _prompt(3, "multifieldqa_zh", "single-doc QA", ["x"])]
    tokens = {0: [1, 3, 4, 5], 1: [1], 2: [7], 3: [1]}      # "paris is the capital", "paris", "46", "paris"
    records = [_record("ar", i, t) for i, t in tokens.items()]
    records += [_record("pld", i, t) for i, t in tokens.items()] + [_record("hf", i, t) for i, t in tokens.items()]
    records[-3] = _record("hf", 1, [2])                      # hf says "london" on prompt 1
    section = quality_section(prompts, records, "ar", WordTokenizer())
    qa = section["per_category"]["multi-doc QA"]
    # prompt 0: [paris, is, capital] vs [paris]: P 1/3, R 1, F1 1/2; prompt 1: 0
    assert qa["metric"] == "qa_f1" and qa["mean_score"] == pytest.approx((1 / 2 + 0) / 2)
    assert (qa["evidence_rows"], qa["evidence_recall"]) == (2, 0.5)
    synthetic = section["per_category"]["synthetic"]
    assert synthetic["mean_score"] == 1.0 and synthetic["evidence_recall"] is None
    assert section["per_category"]["single-doc QA"] == {"rows": 1, "scored_rows": 0, "metric": None,
                                                        "mean_score": None, "evidence_rows": 0,
                                                        "evidence_recall": None}
    assert section["overall"]["mean_score"] == pytest.approx((1 / 2 + 0 + 1) / 3)
    assert section["overall"]["metric"] == "count+qa_f1"
    assert list(section["unscored"]) == ["multifieldqa_zh"]
    assert list(section["differing_methods"]) == ["hf"] and section["differing_methods"]["hf"]["answers_differ"] == 1
    assert section["differing_methods"]["hf"]["mean_score"] == pytest.approx((1 / 2 + 1 + 1) / 3)
    text = format_quality(section)
    assert "multi-doc QA" in text and "0.25" in text and "0.50 (2)" in text
    assert "not scored: multifieldqa_zh (1 rows): multifieldqa_zh is Chinese" in text
    assert "hf's answers differ from ar's on 1 prompts" in text


def test_a_group_of_many_metrics_names_how_many():
    from rasd.eval.quality import summarize

    rows = [{"metric": m, "score": 1.0, "evidence_found": None} for m in ("qa_f1", "count", "code_sim")]
    assert summarize(rows)["metric"] == "3 metrics" and summarize(rows[:2])["metric"] == "count+qa_f1"


def test_no_gold_answers_no_quality_section():
    prompts = [BenchPrompt(0, BenchItem(0, "writing", "q"), [1])]
    assert quality_section(prompts, [_record("ar", 0, [1])], "ar", WordTokenizer()) is None
    assert "not scored" in format_quality(None)


@pytest.mark.skipif(not LONGBENCH.exists(), reason=f"{LONGBENCH} absent ({NO_DATA})")
def test_every_longbench_row_has_gold_answers_and_a_metric():
    items = load_items(LONGBENCH)
    assert len(items) == 109 and all(it.answers for it in items)
    assert all(metric_for(it.dataset) for it in items)
    trec = [it for it in items if it.dataset == "trec"]
    assert trec and all(it.all_classes and it.answers[0] in it.all_classes for it in trec)
