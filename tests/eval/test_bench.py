"""Tests of `rasd bench`: dataset parsing, truncation, aggregation math, outputs, and an end-to-end run.

The pure parts run on hand-made records and temp files; the end-to-end test uses a tiny random Llama with
a tiny BPE tokenizer trained on the spot, so it needs neither the network nor the embedded model.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from rasd.decoding.model.loading import ModelLoadError
from rasd.eval import bench, runners
from rasd.eval.aggregate import aggregate, build_results, match_rate, summarize_group
from rasd.eval.bench import BenchConfig, parse_methods
from rasd.eval.bench_output import format_table, plot_speedups, write_answers
from rasd.eval.datasets import BenchItem, BenchPrompt, fit_prompt, load_items, parse_record, prepare_prompts
from rasd.eval.near_ties import divergences, first_difference, format_divergences
from rasd.eval.runners import RunRecord, SamplingConfig, rotated
from rasd.text import as_id_list, encode_prompt

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
SPEC_BENCH = DATA / "spec_bench" / "question.jsonl"
LONGBENCH = DATA / "longbench" / "longbench_dev.jsonl"
HAS_ENGINE = importlib.util.find_spec("rasd.decoding.runtime.engine") is not None
NO_DATA = "../shared/data is not on this machine"
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    return path


def record(method: str, index: int, category: str, tokens: list[int], decode_time: float,
           steps: int | None = None, mean_acc: float | None = None) -> RunRecord:
    """A RunRecord whose decode phase is len(tokens)-1 tokens in `decode_time` seconds."""
    return RunRecord(method=method, index=index, question_id=index, category=category, token_ids=tokens,
                     finish_reason="length", prefill_time_s=1.0, decode_time_s=decode_time,
                     total_time_s=1.0 + decode_time, decode_tokens=len(tokens) - 1, steps=steps,
                     mean_accepted_tokens=mean_acc)


# ------------------------------------------------------------------------------------ tiny models


@pytest.fixture(scope="module")
def tiny_tokenizer():
    """A byte-level BPE tokenizer with ChatML specials, trained in milliseconds on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["The quick brown fox jumps over the lazy dog.", "Answer the question based on the passages.",
            "Question: what is the capital of France? Answer: Paris."] * 20
    tok.train_from_iterator(text, trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                     pad_token="<|endoftext|>")
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


@pytest.fixture(scope="module")
def tiny_target(tiny_tokenizer):
    """A random 2-layer Llama wrapped like `load_model` returns it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rasd.decoding.model.loading import LoadedModel

    tok = tiny_tokenizer
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    return LoadedModel(model=model, tokenizer=tok, name="tiny-llama", device="cpu", dtype="float32")


# ------------------------------------------------------------------------------------------ data


def test_spec_bench_rows_use_the_first_turn_and_limit_per_category(tmp_path):
    rows = [{"question_id": i, "category": cat, "turns": [f"q{i}", "second turn"]}
            for i, cat in enumerate(["writing", "writing", "writing", "rag", "rag"])]
    path = write_jsonl(tmp_path / "question.jsonl", rows)
    items = load_items(path, limit=2)
    assert [(it.question_id, it.category, it.text) for it in items] == [
        (0, "writing", "q0"), (1, "writing", "q1"), (3, "rag", "q3"), (4, "rag", "q4")]
    assert [it.question_id for it in load_items(path, categories=["rag"])] == [3, 4]


def test_longbench_shapes_prompt_context_question_and_ids(tmp_path):
    rows = [
        {"dataset": "hotpotqa", "category": "multi-doc QA", "source_key": "7",
         "prompt": "Read.\n\nDOC TEXT\n\nQuestion: who?\nAnswer:", "context": "DOC TEXT", "question": "who?"},
        {"dataset": "trec", "category": None, "source_key": "1", "prompt": "few-shot prompt",
         "context": None},
        {"dataset": "qasper", "context": "A document.", "question": "What?"},
        {"dataset": "bad", "answers": ["no prompt here"]},
    ]
    path = write_jsonl(tmp_path / "lb.jsonl.gz", rows)
    items = load_items(path)
    assert len(items) == 3
    hotpot, trec, qasper = items
    assert (hotpot.question_id, hotpot.category, hotpot.context) == ("hotpotqa-7", "multi-doc QA", "DOC TEXT")
    assert trec.category == "trec" and trec.context is None and trec.text == "few-shot prompt"
    assert qasper.text == "A document.\n\nWhat?" and qasper.context == "A document."
    # the category filter also matches the LongBench `dataset` field
    assert [it.question_id for it in load_items(path, categories=["hotpotqa"])] == ["hotpotqa-7"]


def test_parse_record_falls_back_to_the_file_name_and_row_index():
    item = parse_record({"question": "2+2?"}, 5, "gsm8k")
    assert item == BenchItem(5, "gsm8k", "2+2?", None, None)
    assert parse_record({"turns": []}, 0, "x") is None


def test_load_items_errors_are_one_line(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_items(tmp_path / "missing.jsonl")
    path = write_jsonl(tmp_path / "q.jsonl", [{"question_id": 1, "category": "qa", "turns": ["hi"]}])
    with pytest.raises(ValueError, match="no prompts"):
        load_items(path, categories=["nope"])


def test_as_id_list_accepts_every_tokenizer_return_shape():
    import torch

    assert as_id_list([1, 2, 3]) == [1, 2, 3]
    assert as_id_list({"input_ids": [4, 5], "attention_mask": [1, 1]}) == [4, 5]
    assert as_id_list({"input_ids": [[4, 5]]}) == [4, 5]
    assert as_id_list(torch.tensor([[6, 7]])) == [6, 7]
    with pytest.raises(ValueError):
        as_id_list([[1], [2]])


def test_fit_prompt_cuts_the_context_from_the_left_and_keeps_both_ends(tiny_tokenizer):
    context = " ".join(f"The quick brown fox number {i} jumps." for i in range(60))
    text = f"Answer the question based on the passages.\n\n{context}\n\nQuestion: what is the capital?"
    item = BenchItem("q", "qa", text, context)
    full = encode_prompt(tiny_tokenizer, text)
    budget = len(full) // 3
    prompt = fit_prompt(item, tiny_tokenizer, budget)
    assert prompt is not None and len(prompt.input_ids) <= budget
    assert prompt.truncated_tokens == len(full) - len(prompt.input_ids) > 0
    decoded = tiny_tokenizer.decode(prompt.input_ids)
    assert decoded.startswith("<|im_start|>user\nAnswer the question based on the passages.")
    assert "number 59 jumps.\n\nQuestion: what is the capital?<|im_end|>" in decoded
    assert "number 0 jumps" not in decoded  # the oldest part of the context went first
    # a budget smaller than the prompt without its context cannot be met
    assert fit_prompt(item, tiny_tokenizer, 10) is None


def test_prompts_without_context_are_cut_in_the_middle_or_skipped(tiny_tokenizer):
    text = "HEAD " + " ".join(f"word{i}" for i in range(200)) + " TAIL"
    item = BenchItem(1, "few-shot", text)
    budget = 60
    notes: list[str] = []
    prompts = prepare_prompts([item, BenchItem(2, "qa", "short")], tiny_tokenizer, budget, log=notes.append)
    assert len(prompts) == 2 and [p.index for p in prompts] == [0, 1]
    decoded = tiny_tokenizer.decode(prompts[0].input_ids)
    assert len(prompts[0].input_ids) <= budget and "HEAD" in decoded and "TAIL" in decoded
    assert any("truncated few-shot/1" in n for n in notes)
    skipped = prepare_prompts([item], tiny_tokenizer, budget, long_prompts="skip", log=notes.append)
    assert skipped == [] and any(n.startswith("skip few-shot/1") for n in notes)


@pytest.mark.skipif(not SPEC_BENCH.exists(), reason=f"{SPEC_BENCH} absent ({NO_DATA})")
def test_real_spec_bench_file_parses():
    items = load_items(SPEC_BENCH, limit=2)
    cats = {it.category for it in items}
    assert {"translation", "summarization", "qa", "math_reasoning", "rag", "writing"} <= cats
    assert all(isinstance(it.text, str) and it.text for it in items) and len(items) == 2 * len(cats)


@pytest.mark.skipif(not LONGBENCH.exists(), reason=f"{LONGBENCH} absent ({NO_DATA})")
def test_real_longbench_rows_truncate_inside_their_context(tiny_tokenizer):
    items = load_items(LONGBENCH, categories=["hotpotqa", "trec"], limit=1)
    assert {it.dataset for it in items} == {"hotpotqa", "trec"}
    prompts = prepare_prompts(items, tiny_tokenizer, 2000, log=lambda _: None)
    assert len(prompts) == 2
    for p in prompts:
        assert len(p.input_ids) <= 2000 and p.truncated_tokens > 0
    hotpot = next(p for p in prompts if p.item.dataset == "hotpotqa")
    tail = "Answer:<|im_end|>\n<|im_start|>assistant"
    assert tiny_tokenizer.decode(hotpot.input_ids).rstrip().endswith(tail)


# ----------------------------------------------------------------------------------- aggregation


def test_summary_is_a_ratio_of_sums_and_weights_acceptance_by_steps():
    recs = [record("pld", 0, "qa", list(range(11)), 1.0, steps=5, mean_acc=2.0),
            record("pld", 1, "qa", list(range(31)), 4.0, steps=10, mean_acc=3.0)]
    s = summarize_group(recs)
    assert s["tokens_per_s"] == pytest.approx(40 / 5.0)           # not the mean of 10/1 and 30/4
    assert s["e2e_tokens_per_s"] == pytest.approx(42 / 7.0)
    assert s["mean_accepted_tokens"] == pytest.approx((2 * 5 + 3 * 10) / 15)
    assert s["num_prompts"] == 2


def test_speedups_medians_and_match_rate():
    same, other = [1, 2, 3, 4, 5], [1, 2, 9, 9, 9]
    recs = [
        record("hf", 0, "qa", same, 4.0, 4, 1.0), record("hf", 1, "rag", same, 2.0, 4, 1.0),
        record("ar", 0, "qa", same, 2.0, 4, 1.0), record("ar", 1, "rag", same, 2.0, 4, 1.0),
        record("pld", 0, "qa", same, 1.0, 2, 2.0), record("pld", 1, "rag", other, 0.5, 2, 2.0),
    ]
    methods = aggregate(recs, ["hf", "ar", "pld"])
    pld = methods["pld"]
    assert pld["tokens_per_s"] == pytest.approx(8 / 1.5)
    assert pld["speedup_vs_hf"] == pytest.approx((8 / 1.5) / (8 / 6.0))
    assert pld["speedup_vs_ar"] == pytest.approx((8 / 1.5) / (8 / 4.0))
    assert pld["median_speedup_vs_hf"] == pytest.approx(4.0)         # per-prompt ratios 4 and 4
    assert pld["per_category"]["qa"]["speedup_vs_hf"] == pytest.approx(4.0)
    assert pld["per_category"]["rag"]["speedup_vs_ar"] == pytest.approx(4.0)
    assert pld["greedy_match_rate"] == pytest.approx(0.5)
    assert pld["per_category"]["qa"]["greedy_match_rate"] == 1.0
    assert pld["per_category"]["rag"]["greedy_match_rate"] == 0.0
    assert methods["hf"]["speedup_vs_hf"] == 1.0 and methods["hf"]["greedy_match_rate"] == 1.0


def test_match_reference_falls_back_to_ar_and_sampling_reports_null():
    recs = [record("ar", 0, "qa", [1, 2], 1.0, 1, 1.0), record("pld", 0, "qa", [1, 2], 1.0, 1, 2.0)]
    greedy = build_results({}, recs, ["ar", "pld"], greedy=True)
    assert greedy["greedy_reference"] == "ar"
    assert greedy["methods"]["pld"]["greedy_match_rate"] == 1.0
    assert greedy["methods"]["pld"]["speedup_vs_hf"] is None
    assert greedy["methods"]["pld"]["median_speedup_vs_hf"] is None
    sampled = build_results({}, recs, ["ar", "pld"], greedy=False)
    assert sampled["greedy_reference"] is None
    assert sampled["methods"]["pld"]["greedy_match_rate"] is None
    assert match_rate(recs, None) is None


def test_results_schema():
    recs = [record(m, i, c, [1, 2, 3], 1.0, 2, 1.0) for m in ("hf", "pld") for i, c in enumerate(["a", "b"])]
    meta = {"model": "m", "device": "cpu", "dtype": "float32", "torch_threads": 2, "max_new_tokens": 8}
    results = build_results(meta, recs, ["hf", "pld"])
    assert list(results)[:5] == ["model", "device", "dtype", "torch_threads", "max_new_tokens"]
    keys = {"tokens_per_s", "e2e_tokens_per_s", "speedup_vs_hf", "speedup_vs_ar", "mean_accepted_tokens",
            "greedy_match_rate", "median_speedup_vs_hf"}
    for entry in results["methods"].values():
        assert keys <= set(entry) and set(entry["per_category"]) == {"a", "b"}
        for summary in entry["per_category"].values():
            assert set(summary) == set(entry) - {"per_category"}
    json.dumps(results)  # JSON-serialisable as is


def test_hf_record_counts_only_forwards_after_the_first_token():
    rec = runners._hf_record("hf-pld", [5, 6, 7, 8, 9, 2], [2], first_token_time=11.0, chunks=[2, 1, 3],
                           start=10.0, end=13.0)
    assert rec.decode_tokens == 4 and rec.decode_time_s == pytest.approx(2.0)
    assert rec.prefill_time_s == pytest.approx(1.0) and rec.total_time_s == pytest.approx(3.0)
    assert rec.steps == 2 and rec.accept_lengths == [1, 3] and rec.mean_accepted_tokens == 2.0
    assert rec.finish_reason == "eos" and rec.tokens_per_s == pytest.approx(2.0)


class FakeRunner:
    """Records the calls the run loop makes, so order, warm-up and preparation can be checked."""

    def __init__(self, name: str, log: list[tuple]):
        self.name, self.log = name, log

    def prepare(self, prompts, max_new_tokens):
        self.log.append(("prepare", self.name, len(prompts), max_new_tokens))

    def run(self, prompt_ids, max_new_tokens, seed):
        self.log.append(("run", self.name, tuple(prompt_ids), max_new_tokens, seed))
        return record(self.name, -1, "", [1, 2], 1.0)


def test_run_loop_prepares_warms_up_then_interleaves_methods():
    from rasd.eval.datasets import BenchPrompt
    from rasd.eval.runners import run_prompts

    log: list[tuple] = []
    fakes = [FakeRunner("a", log), FakeRunner("b", log)]
    prompts = [BenchPrompt(i, BenchItem(f"q{i}", "qa", "x"), [i, i]) for i in range(3)]
    records = run_prompts(fakes, prompts, 32, SamplingConfig(temperature=0.5, seed=10), progress=False)
    assert log[:2] == [("prepare", "a", 3, 32), ("prepare", "b", 3, 32)]
    assert log[2:4] == [("run", "a", (0, 0), runners.WARMUP_MAX_NEW_TOKENS, 10),
                        ("run", "b", (0, 0), runners.WARMUP_MAX_NEW_TOKENS, 10)]
    timed = [(e[1], e[2][0], e[4]) for e in log[4:]]
    assert timed == [("a", 0, 10), ("b", 0, 10), ("b", 1, 11), ("a", 1, 11), ("a", 2, 12), ("b", 2, 12)]
    assert [(r.method, r.index, r.question_id) for r in records[:2]] == [("a", 0, "q0"), ("b", 0, "q0")]


def test_engine_runner_prepare_touches_every_context_length():
    seen: list[int] = []
    runner = object.__new__(runners.EngineRunner)
    runner.decoder = type("D", (), {"sizer": type("S", (), {"curve_for": staticmethod(seen.append)})()})()
    runner.prepare([BenchPrompt(0, BenchItem(1, "qa", "x"), [7] * 5)], 3)
    assert seen == [5, 6, 7, 8]


def test_rotation_and_method_parsing():
    assert rotated(["a", "b", "c"], 4) == ["b", "c", "a"]
    assert parse_methods(" ar,hf,,pld,ar ") == ["ar", "hf", "pld"]
    with pytest.raises(ValueError):
        parse_methods(" , ")


def test_method_variants_run_a_method_with_options_changed():
    """Keys and values are checked against the method's options class and converted to the field's type."""
    from rasd.decoding.proposers.registry import method_variant

    assert method_variant("rasd") == ("rasd", {})
    assert method_variant("rasd:history=off") == ("rasd", {"history": False})
    assert method_variant("rasd:head=auto;context_min_ngram=2") == ("rasd", {"head": "auto", "context_min_ngram": 2})
    assert method_variant("pld:max_ngram=3;max_len=8") == ("pld", {"max_ngram": 3, "max_len": 8})
    assert method_variant("eagle:sizing=fixed;max_nodes=1;min_prob=none;gate=on") == (
        "eagle", {"sizing": "fixed", "max_nodes": 1, "min_prob": None, "gate": True})
    assert method_variant("suffix:min_token_prob=0.25") == ("suffix", {"min_token_prob": 0.25})
    with pytest.raises(ValueError, match="KEY=VALUE"):
        method_variant("rasd:history")


@pytest.mark.parametrize(("name", "message"), [
    ("rasd:histroy=off", "method 'rasd' has no option 'histroy'; valid: context_min_ngram, eagle, gate, head, "
                         "history, max_nodes, prune_with, short_copies, sizing"),
    ("pld:length=8", "method 'pld' has no option 'length'"),
    ("ar:gate=off", "method 'ar' has no option 'gate'"),     # no draft model, no gate
    ("rasd:history=maybe", "history='maybe': expected on or off"),
    ("pld:max_ngram=3.5", "max_ngram='3.5': expected an integer"),
    ("rasd:head=sometimes", "head='sometimes': expected one of auto, off"),
    ("eagle:sizing=magic", "sizing='magic' is not one of cost, "),
    ("spec:x=1", "unknown method 'spec'"),
])
def test_a_bad_method_variant_fails_at_parse_time_in_one_line(name, message):
    from rasd.decoding.proposers.registry import method_variant

    with pytest.raises(ValueError) as caught:
        method_variant(name)
    assert message in str(caught.value) and "\n" not in str(caught.value), str(caught.value)


def test_a_good_variant_reaches_the_proposer(tiny_target):
    """What a variant sets is what the decoder's proposer runs with (and the plain method keeps its defaults)."""
    def proposer(name):
        return runners.EngineRunner(name, tiny_target, SamplingConfig()).decoder.proposer

    longer = proposer("rasd:sizing=fixed;context_min_ngram=3;history=off")
    assert longer.retrieval.context.min_ngram == 3 and longer.short_copies is not None   # scored 1-token copies
    assert longer.history is None and longer.flat_curve is None   # history off; fixed sizing: no cost curve
    assert proposer("rasd:sizing=fixed;context_min_ngram=3;short_copies=off").short_copies is None
    plain = proposer("rasd:sizing=fixed")
    assert plain.retrieval.context.min_ngram == 1 and plain.history is not None
    assert proposer("pld:max_ngram=2;sizing=fixed").max_ngram == 2


def test_table_and_plot(tmp_path):
    recs = [record(m, 0, "qa", [1, 2, 3], t, 2, 1.0) for m, t in (("hf", 2.0), ("hf-pld:extra=on", 1.0))]
    results = build_results({"model": "m", "device": "cpu", "dtype": "float32", "max_new_tokens": 3}, recs,
                            ["hf", "hf-pld:extra=on"])
    table = format_table(results)
    assert "qa" in table and "overall" in table and "2.00x" in table
    assert "hf-pld:extra=on " in table      # a long method name is never cut
    png = tmp_path / "speedup.png"
    plot_speedups(results, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_cli_rejects_bad_arguments_before_loading_a_model(tmp_path, capsys):
    assert bench.main(["--dataset", str(tmp_path / "none.jsonl")]) == 2
    assert "not found" in capsys.readouterr().err
    assert bench.main(["--dataset", "x", "--methods", "hf-assisted"]) == 2
    assert "needs --draft-model" in capsys.readouterr().err


def test_register_adds_the_bench_subcommand():
    import argparse

    parser = argparse.ArgumentParser(prog="rasd")
    bench.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--dataset", "q.jsonl", "--category", "rag", "--category", "qa"])
    assert args.func is bench.run_from_args and args.category == ["rag", "qa"]
    assert args.methods == "ar,hf,hf-pld,pld"


# ------------------------------------------------------------------------------------ end to end


def _e2e_prompts(tokenizer):
    items = [BenchItem(1, "qa", "the quick brown fox jumps over the lazy dog"),
             BenchItem(2, "rag", "Answer the question based on the passages. Question: capital of France?")]
    return prepare_prompts(items, tokenizer, 400, log=lambda _: None)


def test_end_to_end_hf_baselines_on_a_tiny_llama(tiny_target, tmp_path):
    prompts = _e2e_prompts(tiny_target.tokenizer)
    config = BenchConfig(["hf", "hf-pld"], max_new_tokens=12, progress=False)
    results, records = bench.run_benchmark(tiny_target, prompts, config)
    assert len(records) == 4 and all(r.new_tokens <= 12 for r in records)
    assert results["methods"]["hf-pld"]["greedy_match_rate"] == 1.0
    assert results["methods"]["hf"]["mean_accepted_tokens"] == 1.0
    assert set(results["methods"]["hf"]["per_category"]) == {"qa", "rag"}
    write_answers(tmp_path / "answers.jsonl", records, tiny_target.tokenizer, "tiny")
    rows = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert {r["method"] for r in rows} == {"hf", "hf-pld"}
    assert all(len(r["token_ids"]) == r["new_tokens"] == r["choices"][0]["new_tokens"][0] for r in rows)


@pytest.mark.skipif(not HAS_ENGINE, reason="rasd.decoding.runtime.engine not written yet")
def test_end_to_end_engine_methods_match_hf_greedy(tiny_target, tmp_path):
    prompts = _e2e_prompts(tiny_target.tokenizer)
    config = BenchConfig(["ar", "hf", "pld"], max_new_tokens=16, progress=False)
    results, records = bench.run_benchmark(tiny_target, prompts, config)
    assert results["greedy_reference"] == "ar"
    assert divergences(tiny_target.model, prompts, records) == [], "fp32: every method equals HF here"
    for name in ("hf", "pld"):
        entry = results["methods"][name]
        assert entry["greedy_match_rate"] == 1.0, name
        assert entry["tokens_per_s"] > 0 and entry["speedup_vs_hf"] > 0
    assert results["methods"]["ar"]["mean_accepted_tokens"] == pytest.approx(1.0)
    for r in records:   # our engine's records carry each step's verified tree depth (from DecodeStats)
        if r.method != "hf":
            assert r.tree_depths is not None and len(r.tree_depths) == r.steps == len(r.tree_sizes or [])
            assert all(a - 1 <= d <= n for a, d, n in zip(r.accept_lengths or [], r.tree_depths, r.tree_sizes or [],
                                                          strict=True))
    assert all(d == 0 for r in records if r.method == "ar" for d in r.tree_depths or [])
    plot_speedups(results, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.skipif(not HAS_ENGINE, reason="rasd.decoding.runtime.engine not written yet")
@pytest.mark.skipif(not SPEC_BENCH.exists(), reason=f"{SPEC_BENCH} absent ({NO_DATA})")
def test_cli_on_the_embedded_model_and_spec_bench(tmp_path, capsys):
    out, plot, answers = tmp_path / "results.json", tmp_path / "results.png", tmp_path / "answers.jsonl"
    rc = bench.main(["--dataset", str(SPEC_BENCH), "--category", "rag", "--category", "translation",
                     "--limit", "1", "--methods", "ar,hf,hf-pld,pld", "--max-new-tokens", "16",
                     "--no-progress",
                     "--out", str(out), "--plot", str(plot), "--answers", str(answers)])
    assert rc == 0
    results = json.loads(out.read_text())
    assert set(results["methods"]) == {"ar", "hf", "hf-pld", "pld"}
    for name in ("ar", "hf-pld", "pld"):
        assert results["methods"][name]["greedy_match_rate"] == 1.0, name
    assert set(results["methods"]["pld"]["per_category"]) == {"rag", "translation"}
    assert len(answers.read_text().splitlines()) == 8 and plot.stat().st_size > 1000
    assert "overall" in capsys.readouterr().out


def test_a_divergence_from_hf_is_reported_with_hfs_top2_gap_there(tiny_target):
    """A record that leaves HF's tokens is listed at its first different token with HF's own top-2 logit gap at
    that point (a plain forward of the prompt and HF's tokens so far); equal or merely shorter records are not."""
    prompts = _e2e_prompts(tiny_target.tokenizer)
    ref = [5, 6, 7, 8]
    recs = [record("hf", 0, "qa", ref, 1.0, 4, 1.0), record("pld", 0, "qa", [5, 6, 9, 8], 1.0, 2, 2.0),
            record("ar", 0, "qa", ref[:3], 1.0, 3, 1.0)]
    rows = divergences(tiny_target.model, prompts, recs)
    assert [(r["method"], r["position"], r["ours"], r["reference"]) for r in rows] == [("pld", 2, 9, 7)]
    with torch.inference_mode():
        logits = tiny_target.model(torch.tensor([prompts[0].input_ids + ref[:2]])).logits[0, -1]
    top = logits.float().topk(2).values
    assert rows[0]["reference_top2_gap"] == pytest.approx(float(top[0] - top[1]))
    assert rows[0]["reference_top2_gap_steps"] > 1000, "fp32 logits: a gap is many steps of their resolution"
    assert "pld" in format_divergences(rows) and "equals hf" in format_divergences([])
    assert first_difference([1, 2], [1, 2]) is None and first_difference([1], [1, 2]) == 1


def test_a_dtype_variant_runs_the_method_on_the_target_in_that_dtype(tiny_target):
    """`ar:dtype=bfloat16` beside `ar`: its own target in bf16, its records under the full name, and a bad dtype
    or key is refused before any work."""
    from rasd.eval.runners import split_dtype

    assert split_dtype("rasd:dtype=float32;history=off") == ("rasd:history=off", "float32")
    assert split_dtype("pld") == ("pld", None)
    runners._TARGETS[(tiny_target.name, "cpu", "bfloat16")] = _bf16_copy(tiny_target)
    prompts = _e2e_prompts(tiny_target.tokenizer)
    config = BenchConfig(["ar", "ar:dtype=bfloat16", "pld:dtype=bfloat16"], max_new_tokens=8, progress=False)
    results, records = bench.run_benchmark(tiny_target, prompts, config)
    assert {r.method for r in records} == {"ar", "ar:dtype=bfloat16", "pld:dtype=bfloat16"}
    assert results["methods"]["pld:dtype=bfloat16"]["greedy_match_rate"] == 1.0, "matched with ar in bf16"
    bf16 = {r.index: r.token_ids for r in records if r.method == "ar:dtype=bfloat16"}
    assert all(r.token_ids == bf16[r.index] for r in records if r.method == "pld:dtype=bfloat16")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--dataset", "x.jsonl", "--methods", "ar:dtype=float8"])
    with pytest.raises(ModelLoadError, match="float8"):
        bench._validate(args, ["ar:dtype=float8"])


def _bf16_copy(loaded):
    import copy
    import dataclasses

    with torch.inference_mode(False):
        model = copy.deepcopy(loaded.model).to(torch.bfloat16)
    return dataclasses.replace(loaded, model=model, dtype="bfloat16")
