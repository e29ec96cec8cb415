"""Greedy speculative decoding == HF `generate` greedy, token for token, for every proposer.

Tiny random Llamas (two seeds), prompts of 1, 7 and 40 tokens, max_new_tokens landing inside an accepted
block, EOS inside an accepted block, fixed and cost-aware sizing, streaming, stop strings, context limit.
The target used as its own draft accepts nearly everything (multi-token blocks get cut); an unrelated
random draft accepts almost nothing (every step rejects).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rasd.decoding.proposers import make_proposer
from rasd.decoding.runtime.engine import GenerationOutput, SpeculativeDecoder
from rasd.decoding.sizing.acceptance import AcceptanceEstimator
from rasd.decoding.sizing.cost import CostCurve
from rasd.decoding.sizing.cost_aware import CostAwareSizer
from rasd.decoding.sizing.simple import FixedSizer
from tests.helpers import assert_greedy_equal, hf_greedy, random_prompt, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

OTHER_DRAFT_SEED = 99
# name -> (method, draft: None | "self" | "other", proposer options)
METHODS: dict[str, tuple[str, str | None, dict[str, Any]]] = {
    "ar": ("ar", None, {}),
    "pld": ("pld", None, {}),
    "draft-chain-self": ("draft", "self", {"top_k": 1, "width": 1, "min_prob": 0.0}),
    "draft-tree-self": ("draft", "self", {"top_k": 2, "width": 4, "min_prob": 0.0}),
    "draft-chain-other": ("draft", "other", {"top_k": 1, "width": 1, "min_prob": 0.0}),
    "draft-tree-other": ("draft", "other", {"top_k": 2, "width": 4, "min_prob": 0.0}),
}
SELF_DRAFTS = ("draft-chain-self", "draft-tree-self")


def make_decoder(target: torch.nn.Module, name: str, sizer: Any = None, **kwargs: Any) -> SpeculativeDecoder:
    method, draft, options = METHODS[name]
    draft_model = {None: None, "self": target, "other": tiny_llama(OTHER_DRAFT_SEED)}[draft]
    return SpeculativeDecoder(target, make_proposer(method, draft_model, **options),
                              sizer=sizer if sizer is not None else FixedSizer(16), **kwargs)


def prompt_of(length: int, seed: int) -> list[int]:
    """Random tokens; long prompts repeat their start so that prompt lookup finds matches."""
    if length < 20:
        return random_prompt(length, seed)
    head = random_prompt(length - 10, seed)
    return head + head[:10]


def committed(out: GenerationOutput) -> int:
    """Tokens the verifier accepted before stop conditions cut the last block (prefill token included)."""
    return 1 + sum(out.stats.accept_lengths)


def check_stats(out: GenerationOutput, name: str) -> None:
    stats = out.stats
    assert stats.new_tokens == len(out.token_ids)
    assert stats.steps == len(stats.accept_lengths) == len(stats.tree_sizes) == len(stats.tree_depths)
    # a tree is at least as deep as the path it accepted, and no deeper than it has nodes
    assert all(a - 1 <= d <= n for a, d, n in zip(stats.accept_lengths, stats.tree_depths, stats.tree_sizes,
                                                  strict=True))
    assert stats.accepted_by_source["bonus"] == stats.steps
    assert stats.num_accepted_tokens == sum(stats.accept_lengths) - stats.steps
    assert committed(out) >= len(out.token_ids)
    if name == "ar":
        assert stats.mean_accepted_tokens == 1.0 and stats.num_draft_tokens == 0
        assert stats.steps == len(out.token_ids) - 1


@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("prompt_len", [1, 7, 40])
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_equals_hf(seed: int, prompt_len: int, name: str) -> None:
    model = tiny_llama(seed)
    prompt = prompt_of(prompt_len, seed)
    decoder = make_decoder(model, name)
    cut_inside_block = False
    for max_new in (13, 37):
        ref = hf_greedy(model, prompt, max_new)
        assert len(ref) == max_new
        out = decoder.generate(prompt, max_new)
        assert_greedy_equal(model, prompt, out.token_ids, ref, label=f"{name} seed={seed} len={prompt_len}")
        assert out.finish_reason == "length"
        check_stats(out, name)
        cut_inside_block |= committed(out) > max_new
    if name in SELF_DRAFTS:
        assert cut_inside_block, "max_new_tokens never landed inside an accepted block: the test lost its point"
        assert out.stats.mean_accepted_tokens > 3


@pytest.mark.parametrize("name", ["pld", "draft-chain-self", "draft-tree-self", "draft-tree-other"])
def test_speculation_actually_happens(name: str) -> None:
    """Guard against vacuous equality: the proposers do propose and get tokens accepted on these prompts."""
    model = tiny_llama(0)
    out = make_decoder(model, name).generate(prompt_of(40, 0), 37)
    assert out.stats.num_draft_tokens > 0
    if name != "draft-tree-other":
        assert out.stats.num_accepted_tokens > 5
        source = "context" if name == "pld" else "draft"
        assert out.stats.accepted_by_source[source] == out.stats.num_accepted_tokens


@pytest.mark.parametrize("prompt_len", [1, 30])
def test_self_draft_chain_accepts_everything(prompt_len: int) -> None:
    """The target drafting for itself predicts exactly its own greedy tokens: every step accepts the whole
    chain (max_depth 6) plus the bonus. Anything less means the draft's KV cache or positions are off
    (a larger init makes attention, hence positions, matter in the random model)."""
    model = tiny_llama(0, init=0.3)
    prompt = random_prompt(prompt_len, 3)
    out = make_decoder(model, "draft-chain-self").generate(prompt, 60)
    assert out.stats.accept_lengths == [7] * len(out.stats.accept_lengths)
    assert_greedy_equal(model, prompt, out.token_ids, hf_greedy(model, prompt, 60))


@pytest.mark.parametrize("name", ["draft-chain-self", "draft-tree-other"])
def test_draft_reading_a_window_of_the_prompt_stays_lossless(name: str) -> None:
    """A draft that reads only the last 8 prompt tokens (`window`) drafts from less context, at their true
    positions: output is still HF greedy, and the draft's cache never held the rest of the prompt."""
    model = tiny_llama(0, init=0.3)
    prompt = random_prompt(30, 5)
    method, draft, options = METHODS[name]
    draft_model = model if draft == "self" else tiny_llama(OTHER_DRAFT_SEED)
    proposer = make_proposer(method, draft_model, window=8, **options)
    out = SpeculativeDecoder(model, proposer, sizer=FixedSizer(16)).generate(prompt, 40)
    assert_greedy_equal(model, prompt, out.token_ids, hf_greedy(model, prompt, 40))
    assert proposer.offset == 30 + 1 - 8   # first drafted after the prefill token
    assert proposer.cache.get_seq_length() == len(proposer.cached) <= 8 + len(out.token_ids)


def eos_candidates(ref: list[int], limit: int = 4) -> list[tuple[int, int]]:
    """(token, index) of tokens whose first occurrence in `ref` is at `index`; index 0 and mid-sequence."""
    seen: dict[int, int] = {}
    for i, tok in enumerate(ref):
        seen.setdefault(tok, i)
    firsts = sorted((i, tok) for tok, i in seen.items())
    picks = [firsts[0]] + [f for f in firsts if 2 <= f[0] <= 30][:limit]
    return [(tok, i) for i, tok in picks]


@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("seed", [0, 1])
def test_eos_inside_accepted_block(seed: int, name: str) -> None:
    model = tiny_llama(seed)
    prompt = prompt_of(40, seed + 10)
    ref = hf_greedy(model, prompt, 40)
    decoder = make_decoder(model, name)
    candidates = eos_candidates(ref)
    assert len(candidates) >= 3, f"too few distinct tokens in the reference: {ref}"
    cut_inside_block = False
    for eos, index in candidates:
        ref_eos = hf_greedy(model, prompt, 40, eos_token_id=eos)
        assert ref_eos == ref[: index + 1]      # HF stops at the first EOS and includes it
        out = decoder.generate(prompt, 40, eos_token_ids={eos, 10_000})
        assert_greedy_equal(model, prompt, out.token_ids, ref_eos, label=f"{name} eos={eos}")
        assert out.finish_reason == "eos" and out.token_ids[-1] == eos
        check_stats(out, name)
        cut_inside_block |= committed(out) > len(out.token_ids)
    if name in SELF_DRAFTS:
        assert cut_inside_block, "EOS never landed inside an accepted block: the test lost its point"


@pytest.mark.parametrize("name", ["ar", "pld", "draft-tree-self", "draft-chain-other"])
def test_stream_blocks_concatenate_to_generate(name: str) -> None:
    model = tiny_llama(1)
    prompt = prompt_of(40, 3)
    ref = hf_greedy(model, prompt, 40)
    for kwargs in ({"max_new_tokens": 37}, {"max_new_tokens": 40, "eos_token_ids": {ref[20]}}):
        expected = make_decoder(model, name).generate(prompt, **kwargs)
        stream = make_decoder(model, name).stream(prompt, **kwargs)
        assert stream.output is None
        blocks = list(stream)
        assert blocks[0] == [expected.token_ids[0]], "the prefill token is streamed on its own"
        assert all(blocks), "no empty blocks"
        flat = [t for b in blocks for t in b]
        assert flat == expected.token_ids
        assert stream.output is not None and stream.output.token_ids == flat
        assert stream.output.finish_reason == expected.finish_reason
        if name == "draft-tree-self":
            assert max(len(b) for b in blocks) > 1, "blocks should carry several tokens"
        # generate's on_tokens callback sees the same blocks
        seen: list[list[int]] = []
        make_decoder(model, name).generate(prompt, on_tokens=seen.append, **kwargs)
        assert seen == blocks


def flat_curve(context_len: int) -> CostCurve:
    return CostCurve(key="flat", context_len=256, sizes=[1, 2, 4, 8, 16, 32, 64], latency_s=[0.01] * 7)


def steep_curve(context_len: int) -> CostCurve:
    sizes = [1, 2, 4, 8, 16, 32, 64]
    # 100 s per token: the measured per-step overhead (ms; a second or so on a loaded machine) cannot make a
    # bigger tree look cheap
    return CostCurve(key="steep", context_len=256, sizes=sizes, latency_s=[100.0 * s for s in sizes])


def cpu_like_curve(context_len: int) -> CostCurve:
    """A measured CPU curve (docs/lab-notes/decoding-speed.md): 1 → 60 ms, 16 → 105, 32 → 130, 64 → 190."""
    return CostCurve(key="cpu", context_len=512, sizes=[1, 16, 32, 64], latency_s=[0.060, 0.105, 0.130, 0.190])


@pytest.mark.parametrize("name", ["pld", "draft-chain-self", "draft-tree-self", "draft-tree-other"])
@pytest.mark.parametrize("curve", [flat_curve, steep_curve, cpu_like_curve])
def test_cost_aware_sizing_keeps_greedy_equality(curve: Any, name: str) -> None:
    model = tiny_llama(0)
    prompt = prompt_of(40, 5)
    ref = hf_greedy(model, prompt, 37)
    sizer = CostAwareSizer(curve, max_nodes=24, estimator=AcceptanceEstimator())
    if curve is steep_curve:
        sizer.explore_every = 10**9   # the claim below is about the cost model, not periodic exploration
    if curve is not cpu_like_curve:
        # the claims below are about these curves; learning the tiny model's real ~1 ms steps would replace
        # the plain step's 10 ms (flat) first, and the sizer would wait for its exploration to find out
        sizer.correction.learn = False
    out = make_decoder(model, name, sizer=sizer).generate(prompt, 37)
    assert_greedy_equal(model, prompt, out.token_ids, ref, label=f"{name} {curve.__name__}")
    check_stats(out, name)
    assert max(out.stats.tree_sizes) <= 24
    if curve is steep_curve:
        # no tree can pay for itself when each token costs as much as one plain step
        assert out.stats.num_draft_tokens == 0 and out.stats.mean_accepted_tokens == 1.0
    if curve is flat_curve and name in SELF_DRAFTS:
        assert out.stats.mean_accepted_tokens > 2


def test_cost_aware_sizing_backs_off_from_a_useless_draft() -> None:
    """An unrelated draft model is (almost) never right: on a CPU-like curve the sizer stops speculating."""
    model = tiny_llama(0)
    prompt = prompt_of(40, 5)
    sizer = CostAwareSizer(cpu_like_curve, max_nodes=24)
    sizer.correction.learn = False   # the tiny model's real timings are flat; the claim is about a CPU-like curve
    sizer.explore_every = 10**9
    out = make_decoder(model, "draft-chain-other", sizer=sizer).generate(prompt, 60)
    sizes = out.stats.tree_sizes
    late = sizes[len(sizes) // 2:]
    assert sum(late) <= 0.25 * len(late), f"still speculating late in the request: {sizes}"
    assert_greedy_equal(model, prompt, out.token_ids, hf_greedy(model, prompt, 60))


@pytest.mark.parametrize("name", [n for n in METHODS if n != "ar"])
def test_greedy_equals_our_ar_long(name: str) -> None:
    model = tiny_llama(1)
    prompt = prompt_of(30, 7)
    ar = make_decoder(model, "ar").generate(prompt, 90)
    for sizer in (FixedSizer(8), CostAwareSizer(flat_curve, max_nodes=32)):
        out = make_decoder(model, name, sizer=sizer).generate(prompt, 90)
        assert_greedy_equal(model, prompt, out.token_ids, ar.token_ids, label=f"{name} vs ar")


@pytest.mark.parametrize("name", ["ar", "pld", "draft-chain-self", "draft-tree-self"])
def test_context_limit_stops_generation(name: str) -> None:
    model = tiny_llama(0)
    prompt = prompt_of(40, 1)
    ref = hf_greedy(model, prompt, 37)
    out = make_decoder(model, name, max_context=50).generate(prompt, 37)
    assert out.token_ids == ref[:10]
    assert out.finish_reason == "length"
    decoder = make_decoder(model, name, max_context=40)
    with pytest.raises(ValueError, match="context"):
        decoder.generate(prompt, 5)
    with pytest.raises(ValueError):
        decoder.generate([], 5)
    with pytest.raises(ValueError):
        make_decoder(model, name).generate(prompt, 0)


class AngleTokenizer:
    """Decodes token i as '<i>' so that stop strings align with token boundaries."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


def expected_stop(ref: list[int], stop: str) -> tuple[list[int], str]:
    tok = AngleTokenizer()
    for j in range(1, len(ref) + 1):
        if stop in tok.decode(ref[:j]):
            text = tok.decode(ref[:j])
            return ref[:j], text[: text.find(stop)]
    raise AssertionError("stop string not in the reference")


@pytest.mark.parametrize("name", ["ar", "pld", "draft-chain-self"])
def test_stop_strings_cut_text_and_tokens(name: str) -> None:
    model = tiny_llama(0)
    prompt = prompt_of(40, 5)
    ref = hf_greedy(model, prompt, 37)
    tok = AngleTokenizer()
    for k in (3, 11, 20):
        stop = f"<{ref[k - 1]}><{ref[k]}>"
        tokens, text = expected_stop(ref, stop)
        out = make_decoder(model, name, tokenizer=tok).generate(prompt, 37, stop=[stop, "<never>"])
        assert out.finish_reason == "stop"
        assert out.token_ids == tokens
        assert out.text == text
    out = make_decoder(model, name, tokenizer=tok).generate(prompt, 37, stop=["<never>"])
    assert out.finish_reason == "length" and out.token_ids == ref and out.text == tok.decode(ref)
    with pytest.raises(ValueError, match="tokenizer"):
        make_decoder(model, name).generate(prompt, 5, stop=["x"])


def stop_in_first_block_case() -> tuple[Any, list[int], list[int], Any, str, list[int], str]:
    """Model, prompt, HF reference, tokenizer, a stop string on new tokens 3-4 and its expected cut."""
    model = tiny_llama(0)
    prompt = prompt_of(40, 5)
    ref = hf_greedy(model, prompt, 37)
    stop = f"<{ref[2]}><{ref[3]}>"
    tokens, text = expected_stop(ref, stop)
    return model, prompt, ref, AngleTokenizer(), stop, tokens, text


def test_stop_string_and_max_new_tokens_in_the_same_block() -> None:
    """Regression: tokens after a stop string were kept when max_new_tokens fell in the same block."""
    model, prompt, _, tok, stop, tokens, text = stop_in_first_block_case()
    # the self-draft chain accepts 7 tokens per step: new tokens 1..7 arrive in one block
    out = make_decoder(model, "draft-chain-self", tokenizer=tok).generate(prompt, 6, stop=[stop])
    assert out.stats.accept_lengths[0] == 7
    assert out.finish_reason == "stop" and out.text == text
    assert out.token_ids == tokens


def test_stop_string_before_eos_in_the_same_block() -> None:
    """Regression: EOS was checked before stop strings, so a stop string earlier in the block was missed."""
    model, prompt, ref, tok, stop, tokens, text = stop_in_first_block_case()
    eos = next(t for t in ref[5:8] if t not in ref[:5])
    out = make_decoder(model, "draft-chain-self", tokenizer=tok).generate(prompt, 37, stop=[stop],
                                                                      eos_token_ids={eos})
    assert out.stats.accept_lengths[0] == 7
    assert out.finish_reason == "stop" and out.text == text
    assert out.token_ids == tokens


def sequential_path_prob(model: torch.nn.Module, context: list[int], path: list[int]) -> float:
    with torch.inference_mode():
        probs = model(torch.tensor([context + path])).logits[0].float().softmax(-1)   # [L, vocab]
    prob = 1.0
    for k, tok in enumerate(path):
        prob *= float(probs[len(context) - 1 + k, tok])
    return prob


def test_draft_tree_scores_are_sequential_path_probabilities() -> None:
    """Each draft node's score is the draft model's probability of its path, as decoding it sequentially
    would give: checks the draft's tree mask, positions and KV cache sync across requests' steps."""
    from rasd.decoding.step.sampling import GREEDY

    model = tiny_llama(2, init=0.3)
    proposer = make_proposer("draft", model, top_k=2, width=4, max_depth=4, min_prob=0.0)
    context = random_prompt(20, 4)
    proposer.start(context, GREEDY)
    for step in range(3):
        tree = proposer.propose(context, 12)
        assert 8 <= tree.num_draft_tokens <= 12 and max(tree.depths()) >= 3
        for node in range(1, len(tree)):
            path = [tree.tokens[i] for i in tree.path_to(node)]
            expected = sequential_path_prob(model, context, path)
            assert tree.scores[node] == pytest.approx(expected, rel=1e-4, abs=1e-7), f"step {step} node {node}"
        # commit part of a non-first branch plus an unrelated token, as a verifier might
        branch = tree.path_to(len(tree) - 1)
        context = context + [tree.tokens[i] for i in branch[:2]] + [int(step * 7 % 96)]


def test_cost_aware_sizer_explores_after_plain_steps_and_learns_real_latency() -> None:
    """A curve measured on a busy machine must not forbid speculation forever: after `explore_every`
    plain steps a small tree is tried, and observed verify times correct the cached curve."""
    model = tiny_llama(0)
    prompt = prompt_of(40, 5)
    ref = hf_greedy(model, prompt, 37)
    sizer = CostAwareSizer(steep_curve, max_nodes=24)
    sizer.explore_every = 8
    out = make_decoder(model, "pld", sizer=sizer).generate(prompt, 37)
    assert out.token_ids == ref
    assert out.stats.num_draft_tokens > 0
    # the tiny model verifies in milliseconds against the curve's 100 s per token: ratios far below 1
    ratios = sizer.correction
    assert ratios.observed and all(v < 0.01 for v in ratios.observed.values()) and ratios.observed_all < 0.01
