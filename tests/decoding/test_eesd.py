"""EESD: the early-exit self-draft equals HF greedy token for token, trains end to end, fails clearly untrained.

Tiny random Llamas: a fresh exit layer (a copy of target layer N = 1 of 2) makes the draft the target itself
(nearly everything accepted, blocks cut by max_new_tokens); a perturbed one is an unrelated draft (almost
everything rejected). Both must give HF `generate`'s tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rasd.cli import main
from rasd.decoding.proposers import make_proposer
from rasd.decoding.proposers.early_exit import (
    ThompsonLength,
    early_exit_model,
    load_early_exit,
    new_exit_layer,
    save_exit_layer,
)
from rasd.decoding.runtime.engine import SpeculativeDecoder
from rasd.decoding.sizing.sizers import FixedSizer, ThompsonSizer
from rasd.decoding.step.sampling import SamplingParams
from rasd.decoding.step.tree import DraftTree
from rasd.train.eesd import distill_loss, train_eesd
from tests.helpers import TINY_VOCAB, assert_greedy_equal, hf_greedy, random_prompt, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = "the quick brown fox jumps over the lazy dog and a b c d e f g h i j k l m n o p".split()


def exit_file(tmp_path: Path, target: torch.nn.Module, noise: float = 0.0, name: str = "exit",
              vocab: torch.Tensor | None = None) -> Path:
    layer = new_exit_layer(target, 1)
    if noise:
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in layer.parameters():
                p.add_(noise * torch.randn(p.shape, generator=gen))
    path = tmp_path / f"{name}.safetensors"
    save_exit_layer(path, layer, 1, vocab=vocab)
    return path


@pytest.mark.parametrize("noise", [0.0, 0.5])
@pytest.mark.parametrize("seed", [0, 1])
def test_eesd_greedy_equals_hf(tmp_path: Path, seed: int, noise: float) -> None:
    target = tiny_llama(seed)
    proposer = make_proposer("eesd", target_model=target, eesd=exit_file(tmp_path, target, noise))
    decoder = SpeculativeDecoder(target, proposer, sizer=FixedSizer(16))
    accepted = 0
    for length in (1, 7, 40):
        prompt = random_prompt(length, seed + length)
        out = decoder.generate(prompt, max_new_tokens=29)
        assert_greedy_equal(target, prompt, out.token_ids, hf_greedy(target, prompt, 29), f"eesd noise={noise}")
        accepted += out.stats.num_accepted_tokens
    if noise == 0.0:
        assert accepted > 40          # the draft IS the target: most drafted tokens are accepted
    assert proposer.length.sizer.alpha > 1.0   # the Thompson posterior learnt from the verdicts


def test_early_exit_model_shares_target_modules() -> None:
    target = tiny_llama(0)
    draft = early_exit_model(target, new_exit_layer(target, 1), 1)
    assert draft.lm_head is target.lm_head
    assert draft.get_decoder().layers[0] is target.get_decoder().layers[0]
    assert draft.get_decoder().norm is not target.get_decoder().norm   # a copy: the LDLP tap must not see drafts
    assert draft.config.num_hidden_layers == 2
    x = torch.tensor([random_prompt(9, 3)])
    with torch.no_grad():   # exit layer = copy of the target's layer 1 and N = 1 of 2: the draft is the target
        assert torch.allclose(draft(x).logits, target(x).logits, atol=1e-5)


def test_eesd_sampling_attaches_q(tmp_path: Path) -> None:
    target = tiny_llama(0)
    proposer = make_proposer("eesd", target_model=target, eesd=exit_file(tmp_path, target, 0.5))
    decoder = SpeculativeDecoder(target, proposer, sizer=FixedSizer(16))
    params = SamplingParams(temperature=0.8, seed=3)
    a = decoder.generate(random_prompt(5, 0), max_new_tokens=20, sampling=params).token_ids
    b = decoder.generate(random_prompt(5, 0), max_new_tokens=20, sampling=params).token_ids
    assert len(a) == 20 and len(b) == 20
    proposer.start(random_prompt(5, 0), params)
    tree = proposer.propose(random_prompt(5, 0), 8)
    assert tree.num_draft_tokens >= 1 and set(tree.q) == set(range(1, len(tree)))


def test_thompson_length_posterior() -> None:
    length = ThompsonLength(ThompsonSizer(max_depth=6, seed=0))
    tree = DraftTree.chain(1, [2, 3, 4], "eesd")
    length.observe(tree, [1, 2, 3])   # all accepted: alpha += 3, no rejection
    assert (length.sizer.alpha, length.sizer.beta) == (4.0, 1.0)
    length.observe(tree, [1])         # one accepted, then a rejection
    assert (length.sizer.alpha, length.sizer.beta) == (5.0, 2.0)
    assert all(1 <= length.limit([1]) <= 6 for _ in range(50))


def test_missing_weights_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("RASD_HOME", str(tmp_path))
    with pytest.raises(ValueError, match="rasd train eesd"):
        make_proposer("eesd", target_model=tiny_llama(0), model_name="default")
    with pytest.raises(ValueError, match="rasd train eesd"):
        load_early_exit(tiny_llama(0), None, "some/model")
    assert main(["generate", "--method", "eesd", "--prompt", "hello"]) == 2   # before loading any model
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rasd train eesd" in err[0] and "--eesd PATH" in err[0]


def test_distill_loss_is_cross_entropy_to_the_teacher() -> None:
    logits = torch.tensor([[[2.0, 0.0, -1.0, 0.5]]])
    teacher = torch.tensor([0.6, 0.3, 0.05, 0.05])
    lp, ids = teacher.log().topk(2)
    loss = distill_loss(logits, lp[None, None], ids[None, None], torch.ones(1, 1, dtype=torch.bool))
    logq = logits[0, 0].log_softmax(-1)
    tail = torch.log(logq[2].exp() + logq[3].exp())
    expected = -(0.6 * logq[0] + 0.3 * logq[1] + 0.1 * tail)
    assert torch.isclose(loss, expected, atol=1e-5)


def test_train_eesd_function_reports_agreement() -> None:
    target = tiny_llama(0)
    prompts = torch.stack([torch.tensor(random_prompt(8, i)) for i in range(24)])
    layer, vocab, report = train_eesd(target, prompts, layers=1, gen_tokens=12, steps=3, batch=4)
    assert vocab is None and report["draft_vocab"] == TINY_VOCAB and report["vocab_coverage"] == 1.0
    assert report["layers"] == 1 and 0.0 <= report["agreement"] <= 1.0
    assert report["agreement_before"] == 1.0     # layer 1 copied from a 2-layer target: exact
    assert not any(p.grad is not None for p in target.parameters())   # only the exit layer learns


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-layer random Llama with a tiny BPE tokenizer (trained here) and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny-eesd")
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train_from_iterator([" ".join(WORDS * 30)], trainers.BpeTrainer(vocab_size=100,
                                                                        special_tokens=["<unk>", "</s>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", eos_token="</s>")
    tok.chat_template = "{% for m in messages %}user: {{ m['content'] }} assistant: {% endfor %}"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128,
                         eos_token_id=tok.eos_token_id, bos_token_id=None, pad_token_id=tok.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def prompt_file(tmp_path: Path) -> Path:
    gen = torch.Generator().manual_seed(0)
    rows = [{"turns": [" ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (12,), generator=gen))]}
            for _ in range(20)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_train_eesd_cli_end_to_end(tiny_model_dir: Path, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "eesd" / "tiny.safetensors"
    rc = main(["train", "eesd", "--model", str(tiny_model_dir), "--data", str(prompt_file(tmp_path)),
               "--out", str(out), "--steps", "4", "--seqs", "12", "--prompt-tokens", "8", "--gen-tokens", "10",
               "--batch", "4", "--draft-vocab", "40"])
    assert rc == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["layers"] == 1 and report["sequences"] == 12 and 0.0 <= report["agreement"] <= 1.0
    assert report["draft_vocab"] == 40 and 0.0 < report["vocab_coverage"] <= 1.0
    assert "held-out top-1 agreement" in capsys.readouterr().err
    assert out.stat().st_size < 2_000_000
    rc = main(["generate", "--model", str(tiny_model_dir), "--method", "eesd", "--eesd", str(out), "--prompt",
               "the quick brown fox", "--max-new-tokens", "8", "--sizing", "fixed", "--json"])
    assert rc == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) >= 1


def test_subset_head_masks_the_rest_of_the_vocabulary(tmp_path: Path) -> None:
    target = tiny_llama(0)
    vocab = torch.arange(0, TINY_VOCAB, 3)
    draft = load_early_exit(target, exit_file(tmp_path, target, vocab=vocab))
    x = torch.tensor([random_prompt(9, 3)])
    with torch.no_grad():
        full, part = target(x).logits, draft(x).logits            # exit = target's layer 1: same hidden state
    outside = torch.ones(TINY_VOCAB, dtype=torch.bool)
    outside[vocab] = False
    assert torch.isinf(part[..., outside]).all() and (part[..., outside] < 0).all()
    assert torch.allclose(part[..., vocab], full[..., vocab], atol=1e-5)


@pytest.mark.parametrize("noise", [0.0, 0.5])
def test_subset_eesd_greedy_equals_hf(tmp_path: Path, noise: float) -> None:
    """Tokens outside the draft vocabulary are never drafted, yet the output is still the target's."""
    target = tiny_llama(1)
    vocab = torch.arange(0, TINY_VOCAB, 2)
    proposer = make_proposer("eesd", target_model=target, eesd=exit_file(tmp_path, target, noise, vocab=vocab))
    decoder = SpeculativeDecoder(target, proposer, sizer=FixedSizer(16))
    for length in (3, 20):
        prompt = random_prompt(length, length)
        out = decoder.generate(prompt, max_new_tokens=25)
        assert_greedy_equal(target, prompt, out.token_ids, hf_greedy(target, prompt, 25), f"subset noise={noise}")
    proposer.start(random_prompt(5, 0), SamplingParams(temperature=0.9, seed=1))
    tree = proposer.propose(random_prompt(5, 0), 6)
    for node, q in tree.q.items():   # sampled nodes: q is a distribution over the draft vocabulary only
        assert tree.tokens[node] % 2 == 0 and float(q[1::2].sum()) == 0.0 and abs(float(q.sum()) - 1) < 1e-5


def test_distill_loss_sends_tokens_outside_the_draft_vocabulary_to_the_tail() -> None:
    logits = torch.tensor([[[2.0, 0.0, -1.0]]])            # the student's 3-token vocabulary
    lp = torch.tensor([0.5, 0.3, 0.1]).log()                 # teacher top-3; the 2nd is outside (-1)
    ids = torch.tensor([0, -1, 1])
    loss = distill_loss(logits, lp[None, None], ids[None, None], torch.ones(1, 1, dtype=torch.bool))
    logq = logits[0, 0].log_softmax(-1)
    tail = torch.log(logq[2].exp())                          # mass the student puts outside the teacher's top ids
    expected = -(0.5 * logq[0] + 0.1 * logq[1] + (1 - 0.6) * tail)
    assert torch.isclose(loss, expected, atol=1e-5)


def test_draft_vocabulary_ranks_the_targets_expected_counts() -> None:
    from rasd.train.common import SelfGenerated
    from rasd.train.eesd import coverage, draft_vocabulary, to_draft_ids

    # 2 sequences, prompt 1 token, 3 generated; teacher top-2 per position
    tokens = torch.tensor([[9, 1, 2, 3], [9, 1, 1, 4]])
    ids = torch.tensor([[[1, 5], [2, 5], [3, 6]], [[1, 6], [1, 6], [4, 5]]], dtype=torch.int32)
    logp = torch.tensor([[[0.9, 0.1], [0.6, 0.4], [0.7, 0.3]], [[0.8, 0.2], [0.5, 0.5], [0.6, 0.4]]]).log()
    data = SelfGenerated(tokens=tokens, valid=torch.ones_like(tokens, dtype=torch.bool), prompt_len=1,
                         teacher_logp=logp.half(), teacher_ids=ids)
    rows = torch.tensor([0, 1])
    vocab = draft_vocabulary(data, rows, 3, 10, always={7})
    # expected counts: token 1 = .9+.8+.5 = 2.2, token 5 = .1+.4+.4 = .9, token 6 = .3+.2+.5 = 1.0; 7 is forced
    assert vocab.tolist() == [1, 6, 7]
    assert draft_vocabulary(data, rows, 0, 10) is None and draft_vocabulary(data, rows, 10, 10) is None
    assert to_draft_ids(torch.tensor([1, 2, 7]), vocab, 10).tolist() == [0, -1, 2]
    assert coverage(data, rows, vocab) == pytest.approx(3 / 6)   # greedy tokens 1,2,3,1,1,4: three are 1


def test_optree_and_rasd_draft_with_the_self_draft(tmp_path: Path) -> None:
    """`optree` without a draft model and `--draft-model eesd` use the target's early-exit draft, losslessly."""
    from rasd.decoding.model.loading import LoadedModel, load_draft
    from rasd.decoding.runtime.engine import build_decoder

    target = tiny_llama(2)
    loaded = LoadedModel(model=target, tokenizer=None, name="tiny", device="cpu", dtype="float32")
    path = exit_file(tmp_path, target, 0.3)
    draft = load_draft("eesd", loaded, str(path))
    assert draft is not None and draft.name == "eesd:tiny" and draft.model.lm_head is target.lm_head
    with pytest.raises(Exception, match="self-draft of 'other'"):
        load_draft("eesd:other", loaded, str(path))
    prompt = random_prompt(12, 4)
    want = hf_greedy(target, prompt, 24)
    for method, kwargs in (("optree", {"eesd": str(path)}), ("rasd", {"draft": draft}), ("draft", {"draft": draft})):
        decoder = build_decoder(loaded, method, sizing="fixed", max_nodes=8, **kwargs)
        out = decoder.generate(prompt, max_new_tokens=24)
        assert_greedy_equal(target, prompt, out.token_ids, want, method)
        if method != "draft":   # `draft`'s chain stops under p̂ 0.05, which a random 96-token model never reaches
            assert out.stats.num_draft_tokens > 0, method


def test_builtin_prompts_are_sharegpt_when_the_shared_data_is_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """ShareGPT when it is there; else the offline prompts, said on stderr (a silent fallback trains another head)."""
    import gzip

    from rasd.train.common import SHAREGPT, load_prompts

    monkeypatch.setenv("RASD_DATA", str(tmp_path / "nowhere"))
    assert "Python reference" in load_prompts("builtin", 3)[0]       # offline fallback: CPython's reference
    assert "no ShareGPT at" in capsys.readouterr().err
    rows = [{"conversations": [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": "answer"}]}
            for i in range(4)]
    (tmp_path / SHAREGPT).parent.mkdir(parents=True)
    with gzip.open(tmp_path / SHAREGPT, "wt") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv("RASD_DATA", str(tmp_path))
    assert load_prompts("builtin", 3) == ["question 0", "question 1", "question 2"]
    assert "no ShareGPT" not in capsys.readouterr().err


def test_self_generation_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second run over the same prompts reads the target's continuations back instead of generating."""
    from rasd.train.common import self_generate

    target = tiny_llama(0)
    prompts = torch.stack([torch.tensor(random_prompt(6, i)) for i in range(5)])
    first = self_generate(target, prompts, 7, batch=2, layer=1, cache=tmp_path)
    assert len(list(tmp_path.glob("*.pt"))) == 1

    def no_generate(*args: object, **kwargs: object) -> None:
        raise AssertionError("generated again")

    monkeypatch.setattr(target, "generate", no_generate)
    again = self_generate(target, prompts, 7, batch=2, layer=1, cache=tmp_path)
    assert torch.equal(first.tokens, again.tokens) and torch.equal(first.teacher_ids, again.teacher_ids)
    with pytest.raises(AssertionError, match="generated again"):   # other prompts: another key
        self_generate(target, prompts[:3], 7, batch=2, cache=tmp_path)


def test_eesd_hangs_runner_up_siblings_on_the_chain(tmp_path: Path) -> None:
    target = tiny_llama(0)
    proposer = make_proposer("eesd", target_model=target, eesd=exit_file(tmp_path, target, 0.5))
    proposer.start(random_prompt(5, 0), SamplingParams())
    proposer.length.limit = lambda context: 3   # a 3-token chain
    tree = proposer.propose(random_prompt(5, 0), 16)
    assert tree.num_draft_tokens == 3 + 3 * 2 and tree.parents[1:4] == [0, 1, 2]   # the chain comes first
    for node in range(4, len(tree)):   # siblings: leaves under chain nodes 0..2, never better than the chain's
        parent = tree.parents[node]
        assert parent in (0, 1, 2) and tree.scores[node] <= tree.scores[parent + 1]


def test_adaeagle_with_the_self_draft_spec_uses_the_eesd_predictor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    """`--draft-model eesd` must not make adaeagle look for a `draft-model` LDLP."""
    from rasd.decoding.model.loading import LoadedModel, load_draft
    from rasd.decoding.runtime.engine import build_decoder

    monkeypatch.setenv("RASD_HOME", str(tmp_path))
    target = tiny_llama(0)
    loaded = LoadedModel(model=target, tokenizer=None, name="tiny", device="cpu", dtype="float32")
    draft = load_draft("eesd", loaded, str(exit_file(tmp_path, target)))
    with pytest.raises(ValueError, match="--drafter eesd"):
        build_decoder(loaded, "adaeagle", draft=draft)


@pytest.mark.parametrize("answer", [True, False])
def test_eesd_behind_a_gate_equals_hf(tmp_path: Path, answer: bool) -> None:
    """A closed gate (`rasd.decoding.sizing.gate`) means no draft forward at all; output is HF greedy either way."""
    from tests.decoding.test_gate import Fixed

    target = tiny_llama(0)
    gate = Fixed(answer)
    proposer = make_proposer("eesd", target_model=target, eesd=exit_file(tmp_path, target, 0.0), gate=gate)
    forwards: list[int] = []
    proposer.model.get_decoder().norm.register_forward_hook(lambda *_: forwards.append(1))   # every draft forward
    prompt = random_prompt(12, 4)
    out = SpeculativeDecoder(target, proposer, sizer=FixedSizer(16)).generate(prompt, max_new_tokens=20)
    assert_greedy_equal(target, prompt, out.token_ids, hf_greedy(target, prompt, 20), f"gate={answer}")
    assert bool(forwards) == answer and gate.choices[answer] > 0
    assert (out.stats.num_accepted_tokens > 0) == answer   # the draft IS the target: accepted when it runs
