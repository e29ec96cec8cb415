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
from rasd.decoding.control import FixedSizer, ThompsonSizer
from rasd.decoding.engine import SpeculativeDecoder
from rasd.decoding.proposers import make_proposer
from rasd.decoding.proposers.early_exit import (
    ThompsonLength,
    early_exit_model,
    load_early_exit,
    new_exit_layer,
    save_exit_layer,
)
from rasd.decoding.sampling import SamplingParams
from rasd.decoding.tree import DraftTree
from rasd.train.eesd import distill_loss, train_eesd
from tests.conftest import assert_greedy_equal, hf_greedy, random_prompt, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = "the quick brown fox jumps over the lazy dog and a b c d e f g h i j k l m n o p".split()


def exit_file(tmp_path: Path, target: torch.nn.Module, noise: float = 0.0, name: str = "exit") -> Path:
    layer = new_exit_layer(target, 1)
    if noise:
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in layer.parameters():
                p.add_(noise * torch.randn(p.shape, generator=gen))
    path = tmp_path / f"{name}.safetensors"
    save_exit_layer(path, layer, 1)
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
    layer, report = train_eesd(target, prompts, layers=1, gen_tokens=12, steps=3, batch=4)
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
               "--batch", "4"])
    assert rc == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["layers"] == 1 and report["sequences"] == 12 and 0.0 <= report["agreement"] <= 1.0
    assert "held-out top-1 agreement" in capsys.readouterr().err
    assert out.stat().st_size < 2_000_000
    rc = main(["generate", "--model", str(tiny_model_dir), "--method", "eesd", "--eesd", str(out), "--prompt",
               "the quick brown fox", "--max-new-tokens", "8", "--sizing", "fixed", "--json"])
    assert rc == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) >= 1
