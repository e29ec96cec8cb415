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
