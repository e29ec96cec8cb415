"""The response history (SuffixDecoding's drafting source) and the `suffix` method.

The store: LRU eviction within its size, honest size accounting (tracemalloc), the longest-suffix lookup equal
to a brute-force scan on random sequences (also after evictions and a pickle round trip), fast lookups.
The proposer: SuffixDecoding's length rule (nodes <= factor x match length) and probability rule.
Lossless: `suffix` and `rasd` with a history equal HF greedy and our `ar` token for token, with drafts
actually accepted on a repeated question, and exact sampling (χ² against the exact joint distribution).
"""

from __future__ import annotations

import pickle
import random
import time
import tracemalloc
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from rasd.decoding.drafting.history import HistoryMatch, ResponseHistory
from rasd.decoding.proposers import METHODS, make_proposer
from rasd.decoding.proposers.suffix import HISTORY, SuffixProposer, weighted_tree
from rasd.decoding.runtime.engine import SpeculativeDecoder, build_decoder
from rasd.decoding.sizing.sizers import FixedSizer
from tests.decoding.test_sampling_exact import PROMPT, SVOCAB, T1, TARGET, check_against_exact, exact_joint
from tests.helpers import assert_greedy_equal, hf_greedy, random_prompt, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------- the store

def brute_force(seqs: list[tuple[list[int], int]], context: list[int], max_match: int, min_match: int,
                max_len: int) -> tuple[int, list[tuple[list[int], int]]]:
    """The longest suffix of `context` occurring (with a following token) in any sequence, and every
    continuation after its occurrences with its weight, by scanning everything."""
    best, found = 0, []
    for seq, weight in seqs:
        for off in range(len(seq) - 1):
            k = 0
            while k < min(max_match, off + 1, len(context)) and seq[off - k] == context[-1 - k]:
                k += 1
            if k > best:
                best, found = k, []
            if k == best and k > 0:
                found.append((seq[off + 1: off + 1 + max_len], weight))
    return (best, sorted(found)) if best >= min_match else (0, [])


def as_sorted(match: HistoryMatch) -> list[tuple[list[int], int]]:
    return sorted(zip(match.continuations, match.weights, strict=True))


def stored(history: ResponseHistory) -> list[tuple[list[int], int]]:
    return [(e.tokens.tolist(), e.weight) for e in history._seqs.values()]


@pytest.mark.parametrize("vocab", [3, 6, 40])
def test_lookup_equals_a_brute_force_scan(vocab: int) -> None:
    rng = random.Random(vocab)
    history = ResponseHistory(max_mb=0.25, prompt_tail=5, max_match=12)
    checked = 0
    for step in range(120):
        response = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        history.add([rng.randrange(vocab) for _ in range(8)], response)
        if step % 7 == 0:
            history.add([0, 1, 2, 3, 4], [1, 2])            # duplicates: weights
        seqs = stored(history)
        for _ in range(4):
            base = rng.choice(seqs)[0]
            cut = rng.randrange(1, len(base) + 1)
            context = [rng.randrange(vocab) for _ in range(rng.randrange(0, 4))] + base[max(cut - 15, 0): cut]
            if not context:
                continue
            for min_match in (1, 3):
                expected = brute_force(seqs, context, 12, min_match, 6)
                match = history.lookup(context, max_continuations=10_000, max_len=6, min_match=min_match)
                assert (match.length, as_sorted(match)) == expected, f"context {context}"
                checked += 1
    assert len(history) < 120, "the store never evicted: the test lost its eviction half"
    assert checked > 800


def test_most_recent_occurrences_are_returned_first() -> None:
    history = ResponseHistory(prompt_tail=0)
    for tail in range(10):
        history.add([], [7, 8, 9, tail])
    match = history.lookup([1, 7, 8, 9], max_continuations=3, max_len=1)
    assert match.length == 3 and match.continuations == [[9], [8], [7]] and match.weights == [1, 1, 1]


def test_eviction_is_least_recently_used_and_sizes_add_up() -> None:
    history = ResponseHistory(max_mb=1.0, prompt_tail=4)
    response = list(range(100, 400))
    per = history.cost(4 + len(response))
    fits = history.max_bytes // per
    for i in range(fits):
        assert history.add([i, i, i, i], response)
    assert len(history) == fits and history.bytes_used == fits * per <= history.max_bytes
    assert history.num_tokens == fits * 304
    assert history.lookup([0, 0, 0, 0, 100]).length == 5            # the oldest, now used again
    history.add([-1, -1, -1, -1], response)
    assert len(history) == fits and history.bytes_used <= history.max_bytes
    assert history.lookup([0, 0, 0, 0, 100]).length == 5, "a matched sequence is not evicted first"
    assert history.lookup([1, 1, 1, 1, 100]).length == 1, "the least recently used one is evicted"
    assert not history.add([], list(range(50_000))), "larger than the whole store: refused"
    assert not history.add([1, 2], []), "no response"
    history.clear()
    assert len(history) == 0 and history.bytes_used == 0 and history.lookup([100, 101]).length == 0


def test_duplicates_are_stored_once_with_a_weight() -> None:
    history = ResponseHistory(prompt_tail=2)
    for _ in range(3):
        history.add([5, 6], [1, 2, 3])
    history.add([5, 6], [1, 2, 4])
    assert len(history) == 2
    match = history.lookup([9, 5, 6, 1, 2], max_len=1)
    assert sorted(zip(match.continuations, match.weights, strict=True)) == [([3], 3), ([4], 1)]


def test_size_accounting_is_honest() -> None:
    """The bytes it counts cover what the store really allocates (tracemalloc), and are not wildly above."""
    rng = random.Random(0)
    data = [([rng.randrange(30_000) for _ in range(32)], [rng.randrange(30_000) for _ in range(150)])
            for _ in range(30)]
    tracemalloc.start()
    history = ResponseHistory(max_mb=64)
    before = tracemalloc.get_traced_memory()[0]
    for tail, response in data:
        history.add(tail, response)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert 0.5 * history.bytes_used < used <= history.bytes_used, (used, history.bytes_used)


def test_state_and_pickle_round_trip() -> None:
    rng = random.Random(3)
    history = ResponseHistory(max_mb=2, prompt_tail=6, max_match=16)
    for _ in range(40):
        history.add([rng.randrange(8) for _ in range(6)], [rng.randrange(8) for _ in range(30)])
    history.add([1, 2, 3, 4, 5, 6], [7, 7])
    history.add([1, 2, 3, 4, 5, 6], [7, 7])
    history.lookup([5, 6, 7])                                      # a match reorders use, not age
    state = history.state()
    assert len(pickle.dumps(state)) < 8 * history.num_tokens, "the state carries tokens, not the index"
    copies = [ResponseHistory.from_state(state), pickle.loads(pickle.dumps(history))]
    for copy in copies:
        assert stored(copy) == stored(history) and copy.bytes_used == history.bytes_used
        assert copy.num_tokens == history.num_tokens and copy._table.keys() == history._table.keys()
    for _ in range(50):
        context = [rng.randrange(8) for _ in range(20)]
        expected = history.lookup(context, max_continuations=3)
        assert all(copy.lookup(context, max_continuations=3) == expected for copy in copies)
        assert all(stored(copy) == stored(history) for copy in copies)


def test_lookup_is_fast() -> None:
    """Well under a millisecond in a store of a few MB (measured ~40 µs here)."""
    rng = random.Random(1)
    history = ResponseHistory(max_mb=4)
    answers = [[rng.randrange(2_000) for _ in range(200)] for _ in range(40)]
    for answer in answers:
        history.add([rng.randrange(2_000) for _ in range(32)], answer)
    assert history.bytes_used > 2 * 2**20
    contexts = [random_prompt(60, i, vocab=2_000) + rng.choice(answers)[:rng.randrange(1, 100)] for i in range(200)]
    start = time.perf_counter()
    for context in contexts:
        history.lookup(context)
    per_lookup = (time.perf_counter() - start) / len(contexts)
    print(f"lookup {per_lookup * 1e6:.0f} µs in {history.bytes_used / 2**20:.1f} MB ({history.num_tokens} tokens)")
    assert per_lookup < 1e-3


# ---------------------------------------------------------------------------------------------- the proposer

def test_draft_length_is_capped_by_the_match_length() -> None:
    history = ResponseHistory(prompt_tail=0)
    history.add([], list(range(10, 60)))
    for factor, matched in ((1.0, 3), (2.0, 3), (0.5, 6), (1.0, 12)):
        proposer = SuffixProposer(history, max_spec_factor=factor, use_context=False)
        context = [1, 2] + list(range(10, 10 + matched))
        tree = proposer.propose(context, max_nodes=64)
        assert tree.num_draft_tokens == int(factor * matched), (factor, matched)
        assert tree.tokens[1:] == list(range(10 + matched, 10 + matched + int(factor * matched)))
        assert set(tree.sources[1:]) == {HISTORY}
    assert SuffixProposer(history, max_spec_factor=4.0, use_context=False).propose(
        list(range(10, 30)), max_nodes=5).num_draft_tokens == 5


def test_branches_stop_below_the_minimum_path_probability() -> None:
    match = HistoryMatch(2, [[1, 2, 3], [1, 2, 4], [1, 5], [6]], [6, 1, 2, 1])   # counts: 1: 9, 2: 7, 3: 6
    probs = dict(zip(weighted_tree(0, match, HISTORY, 0.0, 64).tokens[1:],
                     weighted_tree(0, match, HISTORY, 0.0, 64).scores[1:], strict=True))
    assert probs == {1: 0.9, 2: 0.7, 3: 0.6, 4: 0.1, 5: 0.2, 6: 0.1}
    kept = weighted_tree(0, match, HISTORY, 0.15, 64)
    assert sorted(kept.tokens[1:]) == [1, 2, 3, 5]
    assert sorted(weighted_tree(0, match, HISTORY, 0.65, 64).tokens[1:]) == [1, 2]
    assert weighted_tree(0, match, HISTORY, 0.0, 2).tokens[1:] == [1, 2]     # the budget keeps the likeliest


def test_the_method_is_declared_once() -> None:
    spec = METHODS["suffix"]
    assert spec.uses_history and not spec.uses_index and METHODS["rasd"].uses_history
    with pytest.raises(ValueError, match="response history"):
        make_proposer("suffix")
    assert make_proposer("rasd", history=False).history is None
    assert make_proposer("rasd").from_history is None
    history = ResponseHistory()
    assert make_proposer("suffix", history=history).history is history


# ---------------------------------------------------------------------------------------------- lossless

def repeated_question(seed: int, max_new: int) -> tuple[object, list[int], list[int], ResponseHistory]:
    """A model, a prompt, its greedy answer, and a history holding that answer once (asked before)."""
    model = tiny_llama(seed)
    prompt = random_prompt(20, seed + 40)
    ref = hf_greedy(model, prompt, max_new)
    history = ResponseHistory()
    history.add(prompt, ref)
    return model, prompt, ref, history


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("method", ["suffix", "rasd"])
def test_greedy_equals_hf_and_ar_and_the_repeat_is_drafted(method: str, seed: int) -> None:
    model, prompt, ref, history = repeated_question(seed, 40)
    options = {"use_context": False} if method == "suffix" else {}
    proposer = make_proposer(method, history=history, **options)
    out = SpeculativeDecoder(model, proposer, sizer=FixedSizer(16)).generate(prompt, 40)
    assert_greedy_equal(model, prompt, out.token_ids, ref, label=f"{method} seed={seed}")
    ar = SpeculativeDecoder(model, make_proposer("ar"), sizer=FixedSizer(0)).generate(prompt, 40)
    assert ar.token_ids == out.token_ids
    print(f"{method} seed={seed}: mean accepted {out.stats.mean_accepted_tokens:.2f}, "
          f"by source {dict(out.stats.accepted_by_source)}")
    assert out.stats.mean_accepted_tokens > 1.5
    assert out.stats.accepted_by_source[HISTORY] > 20
    other = random_prompt(20, seed + 70)     # a new question: nothing from the history, still lossless
    out = SpeculativeDecoder(model, make_proposer(method, history=history, **options),
                             sizer=FixedSizer(16)).generate(other, 30)
    assert_greedy_equal(model, other, out.token_ids, hf_greedy(model, other, 30), label=f"{method} other")


def test_the_engine_remembers_finished_answers_only() -> None:
    """build_decoder gives `suffix` an empty history; a finished request fills it, so asking again is drafted
    from the first answer; an abandoned request is not remembered."""
    model = tiny_llama(0)
    target = SimpleNamespace(model=model, name="tiny", tokenizer=None, max_context=512, step=None)
    decoder = build_decoder(target, "suffix", sizing="fixed", max_nodes=16, use_context=False)
    history = decoder.proposer.history
    assert isinstance(history, ResponseHistory) and len(history) == 0
    prompt = random_prompt(20, 5)
    first = decoder.generate(prompt, 30)
    assert len(history) == 1 and first.stats.accepted_by_source[HISTORY] == 0
    again = decoder.generate(prompt, 30)
    assert again.token_ids == first.token_ids == hf_greedy(model, prompt, 30)
    assert again.stats.mean_accepted_tokens > 1.5 and again.stats.accepted_by_source[HISTORY] > 10
    stream = decoder.stream(random_prompt(20, 6), 30)
    next(stream)
    stream.close()
    assert len(history) == 1
    shared = ResponseHistory()
    assert build_decoder(target, "rasd", sizing="fixed", history=shared).proposer.history is shared
    assert build_decoder(target, "rasd", sizing="fixed", history=False).proposer.history is None


def test_suffix_sampling_is_exact() -> None:
    """Temperature 1: history nodes are deterministic candidates; the first three tokens keep the exact joint.
    The history holds the target's own samples after the prompt, so its drafts do get accepted."""
    target = tiny_llama(**TARGET)
    joint = exact_joint(target, PROMPT, T1)
    history = ResponseHistory(prompt_tail=8)
    for seed in range(12):
        out = SpeculativeDecoder(target, make_proposer("ar"), sizer=FixedSizer(0)).generate(
            PROMPT, 6, sampling=replace(T1, seed=9_000_000 + 2 * seed))
        history.add(PROMPT, out.token_ids)
    proposer = make_proposer("suffix", history=history, use_context=False, min_token_prob=0.0,
                             max_spec_factor=2.0)
    decoder = SpeculativeDecoder(target, proposer, sizer=FixedSizer(16))
    counts = np.zeros((SVOCAB,) * 3)
    accepted = 0
    for i in range(800):
        out = decoder.generate(PROMPT, 3, sampling=replace(T1, seed=7_000_000 + 2 * i))
        a, b, c = out.token_ids
        counts[a, b, c] += 1
        accepted += out.stats.accepted_by_source[HISTORY]
    print(f"history tokens accepted: {accepted}")
    assert accepted > 200, "too few history acceptances to test anything"
    check_against_exact(counts, joint, "suffix T=1")


def test_a_batch_shares_one_history_and_remembers_its_answers() -> None:
    """Two requests decoded in one batch, drafting from one history: the repeated question is drafted from it,
    both stay HF greedy, and both answers are remembered when they finish."""
    from rasd.decoding.step.batch_decoder import BatchDecoder

    model, prompt, ref, history = repeated_question(0, 30)
    other = random_prompt(20, 90)
    batch = BatchDecoder(model)
    streams = [SpeculativeDecoder(model, make_proposer("suffix", history=history), sizer=FixedSizer(16)).stream(p, 30)
               for p in (prompt, other)]
    for stream in streams:
        batch.add(stream)
    while len(batch):
        batch.step()
    outs = [stream.output for stream in streams]
    assert outs[0] is not None and outs[1] is not None
    assert_greedy_equal(model, prompt, outs[0].token_ids, ref, label="repeat")
    assert_greedy_equal(model, other, outs[1].token_ids, hf_greedy(model, other, 30), label="other")
    assert outs[0].stats.accepted_by_source[HISTORY] > 10
    assert sorted(weight for _, weight in stored(history)) == [1, 2], "the repeat counted twice, the other added"


def test_rasd_with_a_drafter_drafts_only_from_long_history_matches() -> None:
    """Beside a drafter a 1-3 token history match is noise that took steps from it; 4 tokens or more stay."""
    from rasd.decoding.proposers.rasd import HISTORY_MIN_MATCH_WITH_DRAFT
    from rasd.decoding.step.sampling import SamplingParams
    from tests.decoding.test_recycling import ChainDraft

    history = ResponseHistory(prompt_tail=0)
    history.add([], list(range(10, 60)))
    for matched in (1, HISTORY_MIN_MATCH_WITH_DRAFT - 1, HISTORY_MIN_MATCH_WITH_DRAFT):
        context = [1, 2] + list(range(10, 10 + matched))
        alone = make_proposer("rasd", history=history)
        drafting = make_proposer("rasd", history=history, draft_proposer=ChainDraft([3]))
        for proposer in (alone, drafting):
            proposer.start(context, SamplingParams())
        assert HISTORY in alone.propose(context, 16).sources
        assert (HISTORY in drafting.propose(context, 16).sources) == (matched >= HISTORY_MIN_MATCH_WITH_DRAFT)
