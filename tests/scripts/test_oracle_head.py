"""scripts/oracle_head.py: the right token found from a node's path, and a boosted head drafting better, losslessly."""

from __future__ import annotations

import pytest

from rasd.decoding.proposers import make_proposer
from rasd.decoding.runtime.engine import SpeculativeDecoder
from rasd.decoding.sizing.sizers import FixedSizer
from tests.decoding.test_eagle import random_head
from tests.helpers import assert_greedy_equal, hf_greedy, load_script, random_prompt, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_nodes_path_and_the_token_the_text_continues_with() -> None:
    script = load_script("oracle_head")
    parents, tokens = [-1, 0, 1, 0, 3], [7, 8, 9, 5, 6]         # root 7; 8 -> 9 and 5 -> 6
    assert script.path_tokens(parents, tokens, 0) == []
    assert script.path_tokens(parents, tokens, 2) == [8, 9]
    assert script.path_tokens(parents, tokens, 4) == [5, 6]
    truth = [1, 2, 7, 8, 9, 4]                                    # context [1, 2, 7], then the target writes 8 9 4
    assert script.true_next(truth, 3, []) == 8
    assert script.true_next(truth, 3, [8, 9]) == 4
    assert script.true_next(truth, 3, [5, 6]) is None             # off the text: nothing to raise
    assert script.true_next(truth, 3, [8, 9, 4]) is None          # past the end of the text


def test_a_boosted_head_is_right_more_often_and_the_output_stays_the_targets() -> None:
    script = load_script("oracle_head")
    target = tiny_llama(11)
    prompt = random_prompt(12, 3)
    ref = hf_greedy(target, prompt, 24)
    truth = list(prompt) + ref
    agreement = []
    for boost in (0.0, 50.0):
        proposer = make_proposer("eagle", head=random_head(target, 5), min_prob=0.0)
        oracle = script.Oracle(proposer, boost)
        oracle.truth = truth
        out = SpeculativeDecoder(target, proposer, sizer=FixedSizer(4)).generate(prompt, 24)
        assert_greedy_equal(target, prompt, out.token_ids, ref)
        assert oracle.tries > 0
        agreement.append(oracle.hits / oracle.tries)
    assert agreement[0] < 0.5 and agreement[1] == 1.0


def test_a_method_without_a_head_is_refused() -> None:
    script = load_script("oracle_head")
    with pytest.raises(SystemExit, match="no EAGLE head"):
        script.head_proposer(make_proposer("pld"))
