"""`rasd load`'s pure parts (the levels against a real service: tests/serve/test_serve.py)."""

from __future__ import annotations


def test_load_repeat_pass_is_compared_with_the_first() -> None:
    """`rasd load --repeat`: the second pass over the same questions against the first, per concurrency."""
    from rasd.eval.load import format_repeats, repeat_gains

    def level(n: int, rate: float, acc: float, answers: list[str]) -> dict:
        rows = [{"question": f"q{i}", "outcome": "ok", "answer": a} for i, a in enumerate(answers)]
        return {"pass": n, "concurrency": 8, "tokens_per_s": rate, "mean_accepted_tokens": acc, "rows": rows}

    gains = repeat_gains([level(1, 10.0, 1.5, ["a", "b"]), level(2, 25.0, 3.0, ["a", "B"])])
    assert gains == [{"concurrency": 8, "first_tokens_per_s": 10.0, "second_tokens_per_s": 25.0, "speedup": 2.5,
                      "first_accepted": 1.5, "second_accepted": 3.0, "same_answers": 0.5}]
    assert "2.50x" in format_repeats([level(1, 10.0, 1.5, ["a"]), level(2, 25.0, 3.0, ["a"])])
    assert repeat_gains([level(1, 10.0, 1.5, ["a"])]) == []


def test_a_level_that_reasks_answered_questions_is_called_warm() -> None:
    """Levels after the first re-ask the same questions: one whose prompts were mostly cached is named, so a
    table of 15x HF at concurrency 8 is not read as cold throughput; the first level and `--repeat`'s second
    passes are not."""
    from rasd.eval.load import format_warm, warm_levels

    def level(concurrency: int, cached: int, n: int = 1) -> dict:
        return {"concurrency": concurrency, "pass": n, "prompt_tokens": 1000, "cached_prompt_tokens": cached}

    assert warm_levels([level(1, 900), level(4, 971), level(8, 56)]) == ["4/1"]
    assert warm_levels([level(1, 56), level(1, 971, n=2), level(8, 971)]) == ["8/1"]
    assert warm_levels([level(1, 56), level(4, 499)]) == []
    assert warm_levels([{"concurrency": 4, "pass": 1, "prompt_tokens": 0, "cached_prompt_tokens": 0}] * 2) == []
    note = format_warm(["4/1", "8/1"])
    assert "levels 4/1, 8/1" in note and "fresh" in note
