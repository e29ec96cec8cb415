"""One-token copies beside a drafter (`proposers.short_copies`): scored against the text written after them,
offered only while they pay in this request, forgotten by the next; greedy output unchanged either way."""

from __future__ import annotations

from rasd.decoding.proposers import make_proposer
from rasd.decoding.proposers.pld import NgramIndex
from rasd.decoding.proposers.short_copies import ShortCopies, followed
from rasd.decoding.runtime.engine import SpeculativeDecoder
from rasd.decoding.sizing.sizers import FixedSizer
from rasd.decoding.step.sampling import SamplingParams
from rasd.decoding.step.tree import DraftTree
from tests.helpers import hf_greedy, random_prompt, tiny_llama

DRAFT = {"top_k": 2, "width": 4, "min_prob": 0.0}


def _chain(tokens: list[int]) -> DraftTree:
    tree = DraftTree.root_only(0)
    tree.add_path(0, tokens, "context")
    return tree


def test_followed_counts_the_path_the_text_takes_and_waits_while_it_could_go_on() -> None:
    tree = _chain([1, 2, 3])
    tree.add_path(0, [1, 4], "context")
    assert followed(tree, [1, 2, 9]) == (2, True)       # left the trie after two tokens
    assert followed(tree, [1, 4]) == (2, True)          # reached a leaf
    assert followed(tree, [1, 2]) == (2, False)         # 3 may still come
    assert followed(tree, [7]) == (0, True)
    assert followed(tree, []) == (0, False)


def _offered(copies: ShortCopies, text: list[int], start: int) -> list[bool]:
    """Walk `text` from `start` one token a step, as decoding would: was a one-token copy offered each step?"""
    index, out = NgramIndex(4), []
    for end in range(start, len(text) + 1):
        index.extend(text[:end])
        out.append(copies.tree(index, text[:end], 16) is not None)
    return out


def test_copies_are_offered_once_the_written_text_has_been_following_them() -> None:
    """Text that repeats its earlier words: each one-token match's continuation is what follows, so once a few
    tries are decided (ten tokens written after each) the copies go in."""
    words = list(range(100, 140))
    text = words + words                      # the second half copies the first
    offered = _offered(ShortCopies(), text, len(words) + 1)
    assert not any(offered[:10])              # no try decided yet: left out, as before
    assert all(offered[14:])


def test_copies_that_were_never_right_stay_out_and_a_new_request_starts_afresh() -> None:
    """Five common tokens, each followed by a word never seen before: no one-token copy is ever right."""
    text = [t for k in range(60) for t in (k % 5, 100 + k)]
    copies = ShortCopies()
    assert not any(_offered(copies, text, 12))
    assert copies.attempts > copies.min_evidence and copies.tokens == 0.0
    copies.reset()
    assert (copies.tokens, copies.attempts) == (0.0, 0.0)


def _triples(n: int) -> tuple[list[int], list[int]]:
    """A prompt of n three-word phrases, and an answer quoting each after a word of its own: every quote starts
    with a one-token match (the word before it is new) and its next two tokens are right."""
    phrases = [[10 + 3 * i, 11 + 3 * i, 12 + 3 * i] for i in range(n)]
    prompt = [t for phrase in phrases for t in (*phrase, 90)]   # ids below the tiny vocabulary (96)
    answer = [t for i, phrase in enumerate(phrases) for t in (60 + i, *phrase)]
    return prompt, answer


def test_rasd_with_a_drafter_offers_one_token_copies_where_they_pay_and_only_there() -> None:
    """Left to the drafter at first (one-token bushes are rarely right), copied once this request's text has been
    following its one-token matches, and left out again for the next request."""
    model = tiny_llama(0)
    proposer = make_proposer("rasd", model, draft_options=DRAFT)
    prompt, answer = _triples(10)
    proposer.start(prompt, SamplingParams())
    quotes = []                                             # at each quote's first word: was the copy offered?
    for k in range(1, len(answer) + 1):
        tree = proposer.propose(prompt + answer[:k], 8)
        if k % 4 == 2:
            quotes.append("context" in tree.sources)
    assert not any(quotes[:5]) and all(quotes[7:]), quotes
    proposer.start(prompt, SamplingParams())                # a new request: its own text decides again
    assert "context" not in proposer.propose(prompt + answer[:2], 8).sources


def test_rasd_with_one_token_copies_always_in_the_tree_decodes_hfs_greedy_tokens() -> None:
    """Losslessness with the copies in every step's tree (thresholds at zero), on a prompt that repeats itself."""
    model = tiny_llama(1)
    head = random_prompt(12, 5)
    prompt = head + head + head[:3]
    proposer = make_proposer("rasd", model, draft_options=DRAFT)
    proposer.short_copies.min_tokens, proposer.short_copies.min_evidence = 0.0, 0.0
    decoder = SpeculativeDecoder(model, proposer, sizer=FixedSizer(16))
    out = decoder.generate(prompt, 24)
    assert out.token_ids == hf_greedy(model, prompt, 24)
    assert out.stats.to_dict()["drafted_by_source"].get("context", 0) > 0


def test_rasd_can_turn_the_copies_off_and_has_none_without_a_drafter() -> None:
    model = tiny_llama(0)
    assert make_proposer("rasd", model, draft_options=DRAFT, short_copies=False).short_copies is None
    assert make_proposer("rasd").short_copies is None       # without a drafter every one-token match is copied


def test_the_drafters_accepted_nodes_where_nothing_was_copied_raise_the_bar_for_copies() -> None:
    """A drafter that has been adding two tokens a step keeps its steps from copies that add one."""
    from rasd.decoding.step.verify import Verdict

    model = tiny_llama(0)
    proposer = make_proposer("rasd", model, draft_options=DRAFT)
    proposer.start([1, 2, 3], SamplingParams())
    tree = DraftTree.root_only(3)
    tree.add_path(0, [4, 5], "eagle")                       # any drafter's tag counts, a draft worker's too
    tree.add(0, 6, "recycling")
    for _ in range(10):
        proposer.observe([1, 2, 3], tree, Verdict(accepted=[1, 2], bonus=7), None)
    copies = proposer.short_copies
    copies.tokens, copies.attempts = 15.0, 10.0             # copies right 1.5 tokens a try
    assert not copies.pays()
    copied = DraftTree.root_only(3)
    copied.add_path(0, [4, 5], "eagle")
    copied.add(0, 6, "context")                             # a step with copies is not the drafter's alone
    for _ in range(30):
        proposer.observe([1, 2, 3], copied, Verdict(accepted=[], bonus=7), None)
    assert not copies.pays()
    proposer.start([1, 2, 3], SamplingParams())
    forced = DraftTree.root_only(3)
    forced.add_path(0, [4, 5], "grammar")                   # tokens a grammar forces are not the drafter's
    for _ in range(10):
        proposer.observe([1, 2, 3], forced, Verdict(accepted=[1, 2], bonus=7), None)
    copies.tokens, copies.attempts = 15.0, 10.0
    assert copies.pays()                                    # a new request: no bar but the floor of one token
