"""The repetition stop (`runtime.repetition`): every method, single and batched, gives HF `generate`'s greedy
output stopped by an equivalent `StoppingCriteria` (checked by brute force, not by the automaton), minus the
repeated window, with finish reason "repetition"; a streamed answer never shows a token that is later dropped."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from rasd.decoding.proposers import METHODS, make_proposer
from rasd.decoding.runtime.engine import GenerationStream, SpeculativeDecoder
from rasd.decoding.runtime.repetition import RepeatWatch, check_window, cut_repeat, first_repeat, repeats_at_end
from rasd.decoding.sizing.sizers import FixedSizer
from rasd.decoding.step.batch_decoder import BatchDecoder
from rasd.decoding.step.sampling import SamplingParams
from tests.decoding.test_batch import add, drain
from tests.decoding.test_proposer_contract import inputs_for
from tests.helpers import random_prompt, tiny_llama

WINDOW = 6
NEW_TOKENS = 120
PROMPTS = [random_prompt(9, 3), random_prompt(25, 4) * 2, random_prompt(14, 8)]


def _brute_repeat(tokens: list[int]) -> int:
    """Length of the longest suffix that also ends earlier, by trying every length and start."""
    n = len(tokens)
    return max([k for k in range(1, n) if any(tokens[j: j + k] == tokens[n - k:] for j in range(n - k))],
               default=0)


def test_the_automaton_finds_the_longest_earlier_suffix_after_every_token() -> None:
    rng = random.Random(0)
    for _ in range(200):
        vocab, window = rng.choice([2, 3, 7]), rng.choice([4, 6])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
        watch = RepeatWatch(window)
        for i, token in enumerate(tokens):
            fired = watch.push(token)
            assert watch.repeat == _brute_repeat(tokens[: i + 1])
            assert fired == any(repeats_at_end(tokens[: k + 1], window) for k in range(i + 1))
            assert watch.held == (window if fired else min(watch.repeat, window - 1))


def test_the_cut_keeps_one_cycle_of_a_loop() -> None:
    answer = [1, 2, 3] + [7, 8, 9, 10, 11] * 6
    kept, fired = cut_repeat(answer, 4)
    assert fired and kept == [1, 2, 3, 7, 8, 9, 10, 11]
    assert first_repeat(list(range(50)), 4) is None and cut_repeat([5] * 3, 4) == ([5] * 3, False)
    assert first_repeat([5] * 10, 4) == 5   # a one-token loop: the fifth token repeats the first four


@pytest.mark.parametrize("window", [0, 3, 2000, True, 4.5])
def test_an_unusable_window_is_refused(window: object) -> None:
    with pytest.raises(ValueError, match="repetition window"):
        check_window(window)  # type: ignore[arg-type]


class _Repeats(StoppingCriteria):
    """Stops a row once its newest `window` new tokens repeat an earlier span of its new tokens."""

    def __init__(self, prompt_len: int, window: int):
        self.prompt_len, self.window = prompt_len, window

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> torch.Tensor:
        rows = [repeats_at_end(row[self.prompt_len:].tolist(), self.window) for row in input_ids]
        return torch.tensor(rows, dtype=torch.bool, device=input_ids.device)


def _reference(model: torch.nn.Module, prompt: list[int], max_new: int, window: int) -> tuple[list[int], str]:
    """HF greedy with the equivalent stopping criteria, then the rule's cut (the repeated window dropped)."""
    x = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                             pad_token_id=0, stopping_criteria=StoppingCriteriaList([_Repeats(len(prompt), window)]))
    new = out[0, len(prompt):].tolist()
    if repeats_at_end(new, window):
        return new[:-window], "repetition"
    return new, "length"


def test_a_tiny_model_loops_so_the_rule_is_exercised() -> None:
    model = tiny_llama(0)
    reasons = [_reference(model, p, NEW_TOKENS, WINDOW)[1] for p in PROMPTS]
    assert "repetition" in reasons


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_stops_where_hf_with_the_equivalent_criteria_stops(method: str, tmp_path: Path) -> None:
    model = tiny_llama(0)
    inputs = inputs_for(METHODS[method], model, tmp_path)
    decoder = SpeculativeDecoder(model, make_proposer(method, **inputs), sizer=FixedSizer(16))
    for prompt in PROMPTS:
        streamed: list[int] = []
        out = decoder.generate(prompt, NEW_TOKENS, repetition=WINDOW, on_tokens=streamed.extend)
        expected, reason = _reference(model, prompt, NEW_TOKENS, WINDOW)
        assert (out.token_ids, out.finish_reason) == (expected, reason), method
        assert streamed == out.token_ids            # nothing shown was dropped, nothing kept was unshown
        assert len(out.token_sources) == len(out.token_ids)


def test_a_batch_stops_every_row_where_it_stops_alone() -> None:
    model = tiny_llama(0)
    batch = BatchDecoder(model, chunk_tokens=8)
    blocks: dict[int, list[int]] = {}
    streams: list[GenerationStream] = []
    for method, prompt in zip(["pld", "ar", "pld"], PROMPTS, strict=True):
        dec = SpeculativeDecoder(model, make_proposer(method), sizer=FixedSizer(8))
        add(batch, dec.stream(prompt, NEW_TOKENS, repetition=WINDOW), blocks, streams)
    drain(batch, blocks, streams)
    for stream, prompt in zip(streams, PROMPTS, strict=True):
        expected, reason = _reference(model, prompt, NEW_TOKENS, WINDOW)
        assert stream.output is not None
        assert (stream.output.token_ids, stream.output.finish_reason) == (expected, reason)
        assert blocks[id(stream)] == expected


def test_logprobs_and_sampling_follow_the_cut() -> None:
    """Sampled output with the rule is the same draw as without it, cut by the rule (same seed)."""
    model = tiny_llama(0)
    sampling = SamplingParams(temperature=0.3, seed=5)
    decoder = SpeculativeDecoder(model, make_proposer("pld"), sizer=FixedSizer(8))
    free = decoder.stream(PROMPTS[0], NEW_TOKENS, sampling, logprobs=1)
    list(free)
    cut = decoder.stream(PROMPTS[0], NEW_TOKENS, sampling, logprobs=1, repetition=WINDOW)
    list(cut)
    assert free.output is not None and cut.output is not None
    kept, fired = cut_repeat(free.output.token_ids, WINDOW)
    assert cut.output.token_ids == kept
    assert cut.output.finish_reason == ("repetition" if fired else free.output.finish_reason)
    assert cut.output.logprobs == free.output.logprobs[: len(kept)]


def test_off_by_default() -> None:
    model = tiny_llama(0)
    decoder = SpeculativeDecoder(model, make_proposer("ar"))
    out = decoder.generate(PROMPTS[0], NEW_TOKENS)
    assert out.finish_reason == "length" and len(out.token_ids) == NEW_TOKENS
