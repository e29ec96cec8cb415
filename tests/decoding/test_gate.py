"""DraftGate: the draft-or-not bandit on measured tokens per second (pure logic, a fake clock)."""

from __future__ import annotations

import pytest

from rasd.decoding.proposers import make_proposer
from rasd.decoding.runtime.engine import SpeculativeDecoder
from rasd.decoding.sizing.gate import DRAFT, PLAIN, DraftGate
from rasd.decoding.sizing.sizers import FixedSizer
from tests.helpers import assert_greedy_equal, hf_greedy, random_prompt, tiny_llama


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def simulate(gate: DraftGate, clock: Clock, steps: int, draft: tuple[int, float], plain: tuple[int, float],
             bucket: int = 0, length: int = 10) -> int:
    """Run `steps` steps; each arm commits (tokens, seconds) per step. Returns the final length."""
    for _ in range(steps):
        tokens, seconds = draft if gate.choose(length, bucket) else plain
        clock.now += seconds
        length += tokens
    return length


def test_gate_prefers_the_faster_arm_and_backs_off_from_the_slower() -> None:
    clock = Clock()
    gate = DraftGate(block=1, explore_every=4, max_backoff=8, clock=clock)
    simulate(gate, clock, 400, draft=(2, 1.2), plain=(1, 1.0))   # draft: 1.67 tok/s, plain: 1.0
    assert gate.share() > 0.9
    clock = Clock()
    gate = DraftGate(block=1, explore_every=4, max_backoff=8, clock=clock)
    simulate(gate, clock, 400, draft=(1, 1.25), plain=(1, 1.0))  # draft never adds a token and costs 25%
    assert gate.share() < 0.06
    assert gate.buckets[0].backoff == 8                          # exploration interval doubled to the cap
    assert gate.buckets[0].arms[DRAFT].pulls >= 2               # but the losing arm is still tried


def test_gate_follows_a_change_of_regime() -> None:
    clock = Clock()
    gate = DraftGate(block=1, explore_every=4, max_backoff=4, clock=clock)
    length = simulate(gate, clock, 200, draft=(1, 1.25), plain=(1, 1.0))
    before = gate.choices[DRAFT]
    simulate(gate, clock, 200, draft=(3, 1.25), plain=(1, 1.0), length=length)
    assert gate.choices[DRAFT] - before > 150                    # the draft became worth it: the gate follows


def test_the_faster_arm_wins_while_the_text_moves_both_arms_more_than_they_differ() -> None:
    """Prompts change every 100 steps and with them both arms' speed (x1 / x1.8); the plain arm is always 10%
    faster. Rates kept per arm compared the leader's recent prompt with the other arm's stale one; blocks
    compared with their neighbours see the same prompt."""
    clock = Clock()
    gate = DraftGate(block=8, clock=clock)
    length = 10
    for i in range(3000):
        easy = 1.8 if (i // 100) % 2 else 1.0
        use = gate.choose(length, 0)
        clock.now += (1.1 if use else 1.0) / easy
        length += 1
    assert gate.share() < 0.25
    assert gate.buckets[0].best() == PLAIN


def test_buckets_are_learnt_separately() -> None:
    clock = Clock()
    gate = DraftGate(block=1, explore_every=4, max_backoff=8, clock=clock)
    length = 10
    for i in range(600):
        bucket = i % 2
        use = gate.choose(length, bucket)
        tokens = (3 if bucket == 1 else 1) if use else 1     # the draft helps only in bucket 1
        clock.now += 1.2 if use else 1.0
        length += tokens
    assert gate.buckets[1].best() == DRAFT
    assert gate.buckets[0].best() == PLAIN


def test_reset_does_not_credit_the_gap_between_requests() -> None:
    clock = Clock()
    gate = DraftGate(block=1, clock=clock)
    gate.choose(10, 0)
    clock.now += 100.0          # the caller's time between requests
    gate.reset()
    gate.choose(5, 0)           # a new, shorter request
    assert gate.buckets[0].arms[DRAFT].pulls == 0
    clock.now += 1.0
    gate.choose(7, 0)
    assert gate.buckets[0].arms[DRAFT].pulls == 1
    assert gate.buckets[0].arms[DRAFT].rate == 2.0


def test_with_step_numbers_only_the_step_just_before_is_credited() -> None:
    """A caller that asks the gate on some steps only (`rasd` asks its one-node arm where nothing was copied)
    numbers its steps: time and tokens of unasked steps in between go to no arm; the next pair is credited."""
    clock = Clock()
    gate = DraftGate(block=4, clock=clock)
    gate.choose(10, 0, step=0)
    clock.now += 1.0           # step 0: 2 tokens in 1 s
    clock.now += 2.0           # steps 1-2, of no arm: 10 tokens in 2 s
    gate.choose(22, 0, step=3)
    assert gate.buckets[0].arms[DRAFT].pulls == 0, "steps 0-2 must not be credited to step 0's arm"
    clock.now += 1.0
    gate.choose(24, 0, step=4)
    assert gate.buckets[0].arms[DRAFT].pulls == 1
    assert gate.buckets[0].arms[DRAFT].rate == 2.0


def test_a_choice_holds_for_a_block_of_the_buckets_steps() -> None:
    clock = Clock()
    gate = DraftGate(block=4, clock=clock)
    arms, length = [], 10
    for i in range(8):
        bucket = 1 if i == 2 else 0                      # a step of another bucket does not end the block
        arms.append(gate.choose(length, bucket))
        clock.now += 1.0
        length += 2 if arms[-1] else 1
    assert [a for i, a in enumerate(arms) if i != 2] == [DRAFT] * 4 + [PLAIN] * 3   # each arm's first block
    gate.choose(length, 0)
    assert gate.buckets[0].arms[DRAFT].rate == 2.0       # 2 tokens per second, every step credited
    assert gate.buckets[0].arms[PLAIN].rate == 1.0
    assert gate.buckets[1].arms[DRAFT].pulls == 1


# ------------------------------------------------------------------------------------------------------
# the gate inside proposers: a closed gate drafts nothing (no draft forward), output stays HF greedy

class Fixed(DraftGate):
    """A gate that always gives the same answer (and counts its calls)."""

    def __init__(self, answer: bool):
        super().__init__()
        self.answer = answer

    def choose(self, context_len: int, bucket: int = 0, step: int | None = None) -> bool:
        self.choices[self.answer] += 1
        return self.answer


@pytest.mark.parametrize("answer", [DRAFT, PLAIN])
@pytest.mark.parametrize("method", ["draft", "optree", "rasd"])
def test_gated_proposers_equal_hf_greedy(method: str, answer: bool) -> None:
    target, draft = tiny_llama(0), tiny_llama(0, init=0.03)
    prompt = random_prompt(24, seed=3) * 2             # repeated text: `rasd`'s context source has matches
    gate = Fixed(answer)
    proposer = make_proposer(method, draft_model=draft, gate=gate)
    forwards = []
    draft.model.norm.register_forward_hook(lambda *_: forwards.append(1))
    out = SpeculativeDecoder(target, proposer, sizer=FixedSizer(8)).generate(prompt, max_new_tokens=24)
    assert_greedy_equal(target, prompt, out.token_ids, hf_greedy(target, prompt, 24), method)
    assert gate.choices[answer] > 0
    sources = set(out.token_sources)
    if answer == PLAIN:
        assert not forwards and "draft" not in sources and "optree" not in sources
    else:
        assert forwards


def test_engine_gates_model_drafters_but_not_the_eagle_head() -> None:
    """The gate's bandit stands before drafters that cost a large share of a step; the EAGLE head's first
    forward is judged by the cost sizer (`root_pays`) instead, so `eagle`, and `adaeagle` over the head, have
    none; `adaeagle` over a draft model or the self-draft keeps it."""
    from rasd.decoding.proposers.registry import METHODS

    gated = {name for name, spec in METHODS.items() if spec.gates_draft(None)}
    assert gated == {"draft", "optree", "eesd", "rasd"}
    assert METHODS["adaeagle"].gates_draft("eesd") and METHODS["adaeagle"].gates_draft("some/draft")
    assert not METHODS["eagle"].gates_draft("some/draft")
    proposer = make_proposer("rasd", gate=Fixed(DRAFT))
    assert proposer.gate is None                        # nothing to gate without a draft model


def tiny_target(name: str):  # noqa: ANN201
    from types import SimpleNamespace

    return SimpleNamespace(model=tiny_llama(0), tokenizer=None, max_context=512, name=name, device="cpu",
                           dtype="float32")


def test_gate_on_or_off_is_the_callers_choice() -> None:
    """`eagle:gate=on|off` in a benchmark: no bandit by default, one when asked; output is unchanged."""
    from rasd.decoding.model.eagle_head import EagleHead
    from rasd.decoding.runtime.engine import build_decoder

    target = tiny_target("tiny-gate-off")
    head = EagleHead(target.model).eval()
    assert build_decoder(target, "eagle", head=head).proposer.gate is None
    gated = build_decoder(target, "eagle", head=head, gate=True)
    assert isinstance(gated.proposer.gate, DraftGate)
    with pytest.raises(ValueError, match="no draft gate"):
        build_decoder(target, "pld", gate=True)
    assert build_decoder(target, "eagle", head=head, gate=False).proposer.gate is None
    prompt = random_prompt(12, 3)
    assert_greedy_equal(target.model, prompt, gated.generate(prompt, 20).token_ids,
                        hf_greedy(target.model, prompt, 20), "eagle gated")


def test_a_head_that_is_never_right_skips_its_forwards_and_output_is_unchanged() -> None:
    """Where the sizer has learnt that the head's depth-1 node is never accepted, `root_pays` refuses the head's
    first forward: most steps run no head forward at all (a few are let through to be measured again), and the
    tokens are HF's."""
    from rasd.decoding.model.eagle_head import EagleHead
    from rasd.decoding.runtime.engine import build_decoder
    from rasd.decoding.step.tree import DraftTree

    target = tiny_target("tiny-root-guard")
    head = EagleHead(target.model).eval()
    decoder = build_decoder(target, "eagle", head=head)
    rejected = DraftTree.chain(0, [1], "eagle", scores=[0.9])
    for _ in range(300):
        decoder.sizer.estimator.update(rejected, [])
    forwards: list[int] = []
    head.register_forward_hook(lambda *_: forwards.append(1))
    prompt = random_prompt(12, 5)
    out = decoder.generate(prompt, 40)
    assert_greedy_equal(target.model, prompt, out.token_ids, hf_greedy(target.model, prompt, 40), "eagle refused")
    steps = out.stats.steps
    assert 0 < len(forwards) < steps / 2, (len(forwards), steps)
