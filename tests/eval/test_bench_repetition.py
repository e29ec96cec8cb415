"""`rasd bench --stop-on-repetition`: the engine's repetition stop applied to every method and to the baselines
(HF `generate` through a StoppingCriteria, llama.cpp in its token loop) with the engine's cut, so that every method
still matches the reference token for token; and its flags' one-line errors."""

from __future__ import annotations

import random

import pytest

from rasd.decoding.runtime.repetition import DEFAULT_WINDOW, cut_repeat, first_repeat
from rasd.eval import bench
from rasd.eval.bench import BenchConfig
from rasd.eval.llamacpp import read_tokens
from rasd.eval.runners import RepeatCut
from tests.eval import test_bench

tiny_tokenizer = test_bench.tiny_tokenizer   # module fixtures, shared with the bench tests
tiny_target = test_bench.tiny_target

EOS = 2
LOOP = [9, 8, 7] + [10, 11, 12, 13, 14] * 6      # fires with window 4 after 12 tokens (13, 14, 10, 11 again)


def test_the_cut_fed_token_by_token_or_in_blocks_is_the_engines_cut():
    rng = random.Random(1)
    for _ in range(100):
        tokens = [rng.randrange(3, 6) for _ in range(rng.randint(1, 40))]
        expected, fired = cut_repeat(tokens, 4)
        for block in (1, 3, 7):
            cut = RepeatCut(4, {EOS})
            for end in range(block, len(tokens) + block, block):
                if cut.feed(tokens[:end]):
                    break
            assert cut.cut(tokens) == (expected, fired)
            assert cut.fired_at == first_repeat(tokens, 4)


def test_eos_ends_the_answer_before_the_rule_sees_it():
    cut = RepeatCut(4, {EOS})
    assert not cut.feed([5, 6, 7, 8, EOS, 5, 6, 7, 8, 9]) and cut.cut([5, 6, 7, 8, EOS]) == ([5, 6, 7, 8, EOS], False)
    assert RepeatCut(4, set()).feed([5, 6, 7, 8, EOS, 5, 6, 7, 8])       # without EOS the same tokens fire


def test_the_llamacpp_token_loop_stops_and_cuts_like_the_engine():
    """`read_tokens` is the llama.cpp runner's loop; a plain list stands in for `Llama.generate`'s stream."""
    tokens, finish, first = read_tokens(iter(LOOP), {EOS}, 100, RepeatCut(4, {EOS}))
    assert (tokens, finish) == (cut_repeat(LOOP, 4)[0], "repetition") and first is not None
    assert tokens == [9, 8, 7, 10, 11, 12, 13, 14]
    assert read_tokens(iter(LOOP), {EOS}, 100)[:2] == (LOOP, "length")              # the rule off
    assert read_tokens(iter(LOOP), {EOS}, 5, RepeatCut(4, {EOS}))[:2] == (LOOP[:5], "length")
    assert read_tokens(iter([4, EOS, 6]), {EOS}, 9, RepeatCut(4, {EOS}))[:2] == ([4, EOS], "eos")


def _args(*extra: str):
    import argparse

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(["--dataset", "q.jsonl", *extra])


def test_the_window_flags():
    assert bench.repetition_window(_args()) == 0
    assert bench.repetition_window(_args("--stop-on-repetition")) == DEFAULT_WINDOW
    assert bench.repetition_window(_args("--stop-on-repetition", "--repetition-window", "8")) == 8


@pytest.mark.parametrize(("extra", "message"), [
    (["--stop-on-repetition", "--repetition-window", "3"], "--repetition-window 3: the repetition window must be"),
    (["--stop-on-repetition", "--repetition-window", "5000"], "--repetition-window 5000: the repetition window"),
    (["--repetition-window", "8"], "--repetition-window needs --stop-on-repetition"),
])
def test_a_bad_window_is_a_one_line_error_before_any_model_loads(extra, message, capsys):
    assert bench.main(["--dataset", "q.jsonl", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"rasd bench: error: {message}") and "\n" not in err, err


def test_every_method_and_hf_match_the_reference_with_the_rule_on(tiny_target):
    """On a tiny random Llama that loops, with the rule on: every method's tokens equal `ar`'s (match 1.00), HF's
    too, and they are the rule's cut of the answers decoded without it (so the rule really ran and cut)."""
    prompts = test_bench._e2e_prompts(tiny_target.tokenizer)
    methods = ["ar", "hf", "pld", "hf-pld"]
    window, new = 8, 64
    free, free_records = bench.run_benchmark(tiny_target, prompts, BenchConfig(["ar"], new, progress=False))
    results, records = bench.run_benchmark(tiny_target, prompts,
                                           BenchConfig(methods, new, progress=False, repetition=window))
    assert results["repetition_window"] == window and free["repetition_window"] is None
    expected = {r.index: cut_repeat(r.token_ids, window) for r in free_records}
    assert sorted(fired for _, fired in expected.values()) == [False, True], "one prompt loops, one does not"
    for r in records:
        assert r.token_ids == expected[r.index][0], (r.method, r.index)
        assert r.finish_reason == ("repetition" if expected[r.index][1] else "length"), (r.method, r.index)
    for name in methods:
        assert results["methods"][name]["greedy_match_rate"] == 1.0, name
    assert results["looping"]["overall"]["stopped_on_repetition"] == 1
