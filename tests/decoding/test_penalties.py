"""Penalties and logit bias: every proposer equals plain decoding under them, greedy and sampled.

References written apart from `decoding.logits`: HF `generate(repetition_penalty=...)`, and a plain loop that
recomputes the whole sequence every token and applies the OpenAI formulas by hand.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from rasd.decoding.proposers import RecyclingMatrix, make_proposer
from rasd.decoding.runtime.engine import SpeculativeDecoder, vocab_size
from rasd.decoding.sizing.sizers import FixedSizer
from rasd.decoding.step.batch_decoder import BatchDecoder
from rasd.decoding.step.logits import LogitsProcessors
from rasd.decoding.step.sampling import SamplingParams
from rasd.decoding.step.tree import DraftTree
from tests.decoding.test_sampling_exact import ALPHA, SVOCAB, TARGET, hf_warp
from tests.helpers import assert_greedy_equal, pooled_chisquare, random_prompt, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

METHODS = ["ar", "pld", "draft", "recycling"]


def decoder(model: torch.nn.Module, method: str) -> SpeculativeDecoder:
    draft = model if method == "draft" else None
    options: dict[str, Any] = {"top_k": 2, "width": 3, "min_prob": 0.0} if method == "draft" else {}
    if method == "recycling":
        options["recycling"] = RecyclingMatrix(vocab_size(model))
    return SpeculativeDecoder(model, make_proposer(method, draft, **options), sizer=FixedSizer(8))


def repeating(seed: int) -> list[int]:
    head = random_prompt(30, seed)
    return head + head[:12]


def hf_repetition(model: torch.nn.Module, prompt: list[int], n: int, penalty: float) -> list[int]:
    x = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                             repetition_penalty=penalty, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def by_hand(logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams) -> torch.Tensor:
    """The formulas of the module doc, one row, no tensors shared with the implementation."""
    logits = logits.float().clone()
    for tok, bias in params.logit_bias:
        logits[tok] += bias
    for tok in set(prompt) | set(output):
        if params.repetition_penalty != 1.0:
            r = params.repetition_penalty
            logits[tok] = logits[tok] / r if logits[tok] > 0 else logits[tok] * r
    for tok in set(output):
        logits[tok] -= params.frequency_penalty * output.count(tok) + params.presence_penalty
    return logits


def plain_loop(model: torch.nn.Module, prompt: list[int], n: int, params: SamplingParams) -> list[int]:
    """Greedy decoding that reruns the whole sequence each token (no cache) and processes by hand."""
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([prompt + out])).logits[0, -1]
            out.append(int(by_hand(logits, prompt, out, params).argmax()))
    return out


@pytest.mark.parametrize("method", METHODS)
def test_greedy_with_repetition_penalty_equals_hf(method: str) -> None:
    model = tiny_llama(0)
    params = SamplingParams(repetition_penalty=1.3)
    for seed in range(3):
        prompt = repeating(seed)
        out = decoder(model, method).generate(prompt, 32, sampling=params)
        ref = hf_repetition(model, prompt, 32, 1.3)
        assert out.token_ids == ref, f"{method} seed {seed}"


PROCESSED = [SamplingParams(frequency_penalty=0.8, presence_penalty=0.5),
             SamplingParams(presence_penalty=-1.5),
             SamplingParams(logit_bias=((5, 4.0), (7, -100.0)), repetition_penalty=0.8, frequency_penalty=0.3)]


@pytest.mark.parametrize("params", PROCESSED)
@pytest.mark.parametrize("method", METHODS)
def test_greedy_with_penalties_and_bias_equals_the_plain_loop(method: str, params: SamplingParams) -> None:
    model = tiny_llama(1)
    accepted = 0
    for seed in range(2):
        prompt = repeating(seed + 10)
        out = decoder(model, method).generate(prompt, 24, sampling=params)
        assert_greedy_equal(model, prompt, out.token_ids, plain_loop(model, prompt, 24, params), method)
        accepted += out.stats.num_accepted_tokens
    if method in ("pld", "draft") and params.presence_penalty < 0:   # repeats encouraged: drafts accepted
        assert accepted > 0, "drafts must be accepted for the per-node path to be exercised"


def test_each_tree_node_is_processed_from_its_own_path() -> None:
    """Two branches writing different tokens: each node's counts hold its own ancestors only."""
    params = SamplingParams(frequency_penalty=1.0)
    proc = LogitsProcessors(params, [1, 2])
    tree = DraftTree.root_only(3)
    a = tree.add(0, 4, "x")
    b = tree.add(a, 4, "x")
    c = tree.add(0, 5, "x")
    out = proc.apply(torch.zeros(len(tree), 8), [1, 2, 3], tree)
    assert out[0].tolist() == [0, 0, 0, -1, 0, 0, 0, 0]             # the root: the committed output (3)
    assert out[a, 4] == -1 and out[b, 4] == -2 and out[c, 4] == 0 and out[c, 5] == -1
    assert out[b, 5] == 0 and (out[:, 1] == 0).all()                 # the prompt is not output


def test_a_batch_with_and_without_penalties_gives_each_request_its_own_tokens() -> None:
    model = tiny_llama(2)
    requests = [(repeating(20), SamplingParams(repetition_penalty=1.4)), (repeating(21), SamplingParams()),
                (repeating(22), SamplingParams(frequency_penalty=1.0, logit_bias=((9, 3.0),)))]
    batch = BatchDecoder(model, slots=4)
    streams, blocks = [], {}
    for prompt, params in requests:
        stream = decoder(model, "pld").stream(prompt, 20, sampling=params)
        streams.append(stream)
        blocks[id(stream)] = batch.add(stream) or []
    for _ in range(200):
        if not len(batch):
            break
        for stream, block in batch.step():
            blocks[id(stream)] += block
    for (prompt, params), stream in zip(requests, streams, strict=True):
        assert_greedy_equal(model, prompt, blocks[id(stream)], plain_loop(model, prompt, 20, params))


def test_a_bias_outside_the_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        LogitsProcessors(SamplingParams(logit_bias=((10_000, 1.0),)), [1]).apply(torch.zeros(2, 8), [1, 2])


@pytest.mark.parametrize("bad", [{"repetition_penalty": 0.0}, {"repetition_penalty": float("nan")},
                                 {"frequency_penalty": float("inf")}, {"logit_bias": ((1, float("nan")),)}])
def test_invalid_processor_settings_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)


# ------------------------------------------------------------------------------------------------------
# sampling under penalties: exact
# ------------------------------------------------------------------------------------------------------

PEN = SamplingParams(temperature=1.0, repetition_penalty=1.3, frequency_penalty=1.0, presence_penalty=0.5,
                     logit_bias=((3, 1.5),))
SHORT = random_prompt(12, seed=3, vocab=SVOCAB)


def exact_triple(model: torch.nn.Module, prompt: list[int], params: SamplingParams) -> np.ndarray:
    """P(t1, t2, t3) [V, V, V] of plain sampling with the processors applied by hand to every prefix."""
    plain = replace(params, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0, logit_bias=())

    def dist(out: list[int], logits: torch.Tensor) -> torch.Tensor:
        return hf_warp(by_hand(logits, prompt, out, params)[None], plain)[0]

    v = SVOCAB
    with torch.inference_mode():
        p1 = dist([], model(torch.tensor([prompt])).logits[0, -1])
        rows = model(torch.tensor([prompt + [a] for a in range(v)])).logits[:, -1]
        p2 = torch.stack([dist([a], rows[a]) for a in range(v)])
        rows = model(torch.tensor([prompt + [a, b] for a in range(v) for b in range(v)])).logits[:, -1]
        p3 = torch.stack([dist([a, b], rows[a * v + b]) for a in range(v) for b in range(v)]).reshape(v, v, v)
    return (p1[:, None, None] * p2[:, :, None] * p3).double().numpy()


@pytest.mark.parametrize("method", ["ar", "pld", "draft"])
def test_sampling_with_penalties_is_exact(method: str) -> None:
    """The third token follows an accepted draft node in many runs: its distribution must be the node's own,
    processed from its path (a verifier that processed every node like the root fails this, checked)."""
    target = tiny_llama(**TARGET)
    joint = exact_triple(target, SHORT, PEN)
    draft = tiny_llama(seed=6, vocab=SVOCAB, init=0.3) if method == "draft" else None
    options = {"max_depth": 2, "min_prob": 0.0} if method == "draft" else {}
    dec = SpeculativeDecoder(target, make_proposer(method, draft, **options), sizer=FixedSizer(16))
    counts, accepted = np.zeros((SVOCAB,) * 3), 0
    for i in range(1500):
        out = dec.generate(SHORT, 3, sampling=replace(PEN, seed=2 * i))
        counts[tuple(out.token_ids)] += 1
        accepted += out.stats.num_accepted_tokens
    if method != "ar":
        assert accepted > 100, f"{method}: {accepted} drafts accepted; the test needs them to have power"
    assert counts[joint == 0].sum() == 0
    p = min(pooled_chisquare(counts, joint), pooled_chisquare(counts.sum((0, 1)), joint.sum((0, 1))))
    assert p > ALPHA, f"{method}: p = {p:.3g}, the distribution differs from plain sampling under penalties"
