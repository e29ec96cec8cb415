"""LongBench v1's answer metrics, one per dataset, applied as its `eval.py` applies them: the best score over the
gold answers, and for trec, triviaqa, samsum and lsht only the prediction's first line.

Why LongBench's own: a score is comparable with published LongBench numbers only under the same metric, and the
datasets differ in kind (extractive QA, summaries, class labels, counts, code lines). Written from LongBench's
definitions (THUDM/LongBench, `metrics.py` and `eval.py`), with maintained libraries where it used others:
- ROUGE-L F comes from Google's `rouge-score` (`rougeL`, no stemming) instead of the `rouge` package: both are
  the F-measure of the longest common subsequence of words, but the tokenizers differ (rouge-score keeps only
  lowercase letters and digits), so a score may differ from LongBench's in punctuation-heavy text;
- the code similarity is `rapidfuzz`'s `fuzz.ratio` (the Indel ratio fuzzywuzzy computes with
  python-Levenshtein), rounded to a whole percent as fuzzywuzzy rounds it;
- the classification score keeps what LongBench's code does, not what its dead branch suggests: a prediction
  naming no class scores 0 (its comparison of a list with 0 is always true, so its closest-class fallback never
  runs), and a matched class contained in the gold label (but not equal to it) is dropped.
The Chinese datasets are not scored: LongBench segments their words with jieba, which rasd does not ship.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

FIRST_LINE_DATASETS = frozenset({"trec", "triviaqa", "samsum", "lsht"})   # few-shot: the answer is one line
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """LongBench's QA normalization: lowercase, no ASCII punctuation, no articles, whitespace collapsed."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def qa_f1_score(prediction: str, gold: str, all_classes: Sequence[str] = ()) -> float:
    """Word-level F1 of the normalized prediction against the normalized gold answer (SQuAD's F1)."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


@cache
def _rouge_scorer() -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


def rouge_l_score(prediction: str, gold: str, all_classes: Sequence[str] = ()) -> float:
    """ROUGE-L F-measure (longest common subsequence of words); 0 for an empty side, as LongBench's guard gives."""
    return float(_rouge_scorer().score(gold, prediction)["rougeL"].fmeasure)


def classification_score(prediction: str, gold: str, all_classes: Sequence[str] = ()) -> float:
    """1 / (classes named in the prediction) when the gold class is among them, else 0.

    A named class that is part of the gold label but not the label itself ("Other" inside "Other entity") does not
    count against it."""
    named = [c for c in all_classes if c in prediction]
    named = [c for c in named if not (c in gold and c != gold)]
    return 1.0 / len(named) if gold in named else 0.0


def _share_equal(numbers: Sequence[str], wanted: str) -> float:
    """The share of the numbers in a prediction that equal the wanted one (0 when it names none)."""
    return sum(n == wanted for n in numbers) / len(numbers) if numbers else 0.0


def count_score(prediction: str, gold: str, all_classes: Sequence[str] = ()) -> float:
    """passage_count: of the numbers the prediction names, the share equal to the gold count."""
    return _share_equal(re.findall(r"\d+", prediction), str(gold))


def retrieval_score(prediction: str, gold: str, all_classes: Sequence[str] = ()) -> float:
    """passage_retrieval_en: of the numbers the prediction names, the share equal to the gold "Paragraph N"'s N
    (0 when the gold names no paragraph)."""
    wanted = re.findall(r"Paragraph (\d+)", gold)
    return _share_equal(re.findall(r"\d+", prediction), wanted[0]) if wanted else 0.0


def code_sim_score(prediction: str, gold: str, all_classes: Sequence[str] = ()) -> float:
    """lcc / repobench-p: fuzzy similarity of the first line that is code (no `, # or //) to the gold line."""
    from rapidfuzz import fuzz

    lines = prediction.lstrip("\n").split("\n")
    first = next((line for line in lines if not any(mark in line for mark in ("`", "#", "//"))), "")
    return round(fuzz.ratio(first, gold)) / 100


METRICS: dict[str, Callable[..., float]] = {
    "qa_f1": qa_f1_score, "rouge_l": rouge_l_score, "classification": classification_score,
    "count": count_score, "retrieval": retrieval_score, "code_sim": code_sim_score}

DATASET_METRIC = {   # LongBench v1's dataset2metric, English datasets
    "narrativeqa": "qa_f1", "qasper": "qa_f1", "multifieldqa_en": "qa_f1", "hotpotqa": "qa_f1",
    "2wikimqa": "qa_f1", "musique": "qa_f1", "triviaqa": "qa_f1",
    "gov_report": "rouge_l", "qmsum": "rouge_l", "multi_news": "rouge_l", "samsum": "rouge_l",
    "trec": "classification", "passage_count": "count", "passage_retrieval_en": "retrieval",
    "lcc": "code_sim", "repobench-p": "code_sim"}

CHINESE_DATASETS = frozenset({"multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh"})


def metric_for(dataset: str | None) -> str | None:
    """The LongBench metric's name for a dataset, None where rasd does not score it."""
    return DATASET_METRIC.get(dataset or "")


def unscored_reason(dataset: str | None) -> str:
    """Why a dataset gets no quality score (said, never skipped in silence)."""
    if not dataset:
        return "the rows name no LongBench dataset"
    if dataset in CHINESE_DATASETS:
        return f"{dataset} is Chinese: LongBench segments it with jieba, which rasd does not ship"
    return f"{dataset} is not a LongBench v1 dataset with a known metric"


def score_answer(dataset: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] = ()) -> float:
    """A prediction's LongBench score: the best over the gold answers (first line only where LongBench cuts)."""
    metric = METRICS[DATASET_METRIC[dataset]]
    if dataset in FIRST_LINE_DATASETS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    return max((metric(prediction, gold, all_classes=all_classes) for gold in answers), default=0.0)
