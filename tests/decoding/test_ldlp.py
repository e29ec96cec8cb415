"""AdaEAGLE: LDLP labels, the weighted L1, the DDD stop rule, the final-norm tap, `adaeagle` == HF greedy, and
`rasd train ldlp` end to end on tiny random models."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rasd.cli import main
from rasd.decoding.proposers import make_proposer
from rasd.decoding.proposers.early_exit import new_exit_layer, save_exit_layer
from rasd.decoding.runtime.engine import SpeculativeDecoder
from rasd.decoding.sizing.ldlp import (
    LDLPController,
    LengthPredictor,
    ddd_stop,
    ldlp_labels,
    shared_tap,
    weighted_l1,
)
from rasd.decoding.sizing.sizers import FixedSizer, make_sizer
from rasd.decoding.step.tree import DraftTree
from rasd.train.ldlp import train_ldlp
from tests.decoding.test_eesd import prompt_file, tiny_model_dir  # noqa: F401  (fixture)
from tests.helpers import assert_greedy_equal, hf_greedy, random_prompt, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


def test_ldlp_labels_hand_made() -> None:
    tokens = torch.tensor([5, 1, 2, 3, 9, 4, 6, 7])
    # drafter's argmax after each prefix: matches the next text token at positions 0, 1, 2, 4, 5, 6
    draft = torch.tensor([1, 2, 3, 0, 4, 6, 7, 8])
    assert ldlp_labels(draft, tokens, k_max=8).tolist() == [3, 2, 1, 0, 3, 2, 1]
    assert ldlp_labels(draft, tokens, k_max=2).tolist() == [2, 2, 1, 0, 2, 2, 1]


def test_weighted_l1_penalises_under_prediction() -> None:
    pred, target = torch.tensor([1.0, 5.0]), torch.tensor([3.0, 4.0])
    assert float(weighted_l1(pred, target, 3.0)) == pytest.approx((3.0 * 2.0 + 1.0 * 1.0) / 2)
    assert float(weighted_l1(target, target, 3.0)) == 0.0


def test_ddd_stop_rule() -> None:
    # a chain with draft probabilities 0.9, 0.8, 0.9, 0.5: cumulative log-probs after each token
    cum = [0.0]
    for p in (0.9, 0.8, 0.9, 0.5):
        cum.append(cum[-1] + math.log(p))
    # k = 2: never before step 2; at step 2 the chain has log(0.72) = -0.33 >= -0.6, continue; step 3:
    # log(0.648) = -0.43, continue; step 4: log(0.324) = -1.13 < -0.6, stop
    assert [ddd_stop(s, cum[s], k=2) for s in range(5)] == [False, False, False, False, True]
    # k = 0: a low-probability first token stops at once; k = 5 drafts on whatever the probabilities
    assert ddd_stop(1, math.log(0.4), k=0)
    assert not any(ddd_stop(s, -5.0, k=5) for s in range(5))


def constant_predictor(hidden: int, k: float, k_max: int = 6) -> LengthPredictor:
    model = LengthPredictor(hidden, width=8, k_max=k_max)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.out.bias.fill_(k)
    return model


def test_controller_cut_applies_k_and_ddd() -> None:
    target = tiny_llama(0)
    controller = LDLPController(target, constant_predictor(64, 1.2))   # k = round(1.2) = 1
    tree = DraftTree.chain(3, [4, 5, 6], "draft", scores=[0.9, 0.5, 0.4])
    controller.tap.last = torch.zeros(1, 2, 64)
    cut = controller.cut(tree)
    # step 1 >= k and log 0.9 >= -0.6: go on; step 2: log 0.5 < -0.6: stop -> depth 2
    assert cut.tokens == [3, 4, 5] and controller.k == 1
    controller = LDLPController(target, constant_predictor(64, 9.0, k_max=6))   # clamped to k_max
    assert controller.predict(3) == 6


def test_tap_gives_final_norm_hidden_of_last_accepted(tmp_path: Path) -> None:
    target = tiny_llama(1)
    proposer = make_proposer("draft", tiny_llama(99), top_k=1, width=1, min_prob=0.0, max_depth=3)
    controller = LDLPController(target, constant_predictor(64, 2.0))
    decoder = SpeculativeDecoder(target, proposer, sizer=make_sizer("ldlp", 16, controller=controller))
    prompt = random_prompt(6, 2)
    stream = decoder.stream(prompt, max_new_tokens=12)
    next(stream)
    next(stream)   # one verified step
    context = prompt + stream.generated
    with torch.no_grad():
        ref = target.get_decoder()(torch.tensor([context[:-1]])).last_hidden_state[0, -1]
    assert torch.allclose(controller._hidden.float(), ref, atol=1e-4)
    assert shared_tap(target) is controller.tap


def make_files(tmp_path: Path, target: torch.nn.Module, drafter: torch.nn.Module) -> tuple[Path, Path, dict]:
    exit_path = tmp_path / "exit.safetensors"
    save_exit_layer(exit_path, new_exit_layer(target, 1), 1)
    prompts = torch.stack([torch.tensor(random_prompt(8, i)) for i in range(16)])
    model, report = train_ldlp(target, drafter, prompts, k_max=4, gen_tokens=12, steps=20, batch=32)
    ldlp_file = tmp_path / "ldlp.safetensors"
    model.save(ldlp_file)
    return exit_path, ldlp_file, report


@pytest.mark.parametrize("drafter", ["eesd", "other", "eagle"])
def test_adaeagle_greedy_equals_hf(tmp_path: Path, drafter: str) -> None:
    from tests.decoding.test_eagle import trained_head

    target = tiny_llama(0)
    other = tiny_llama(99)
    head = trained_head(0)
    labeller = {"eesd": target, "other": other, "eagle": head}[drafter]
    exit_path, ldlp_file, report = make_files(tmp_path, target, labeller)
    assert report["positions"] > 0 and "mae" in report["held_out"]
    proposer = make_proposer("adaeagle", draft_model=other if drafter == "other" else None, target_model=target,
                             eesd=exit_path, ldlp=ldlp_file, head=head,
                             drafter={"eesd": "eesd", "other": None, "eagle": None}[drafter])
    assert proposer.source == "adaeagle" and getattr(proposer, "wants_hidden", False) == (drafter == "eagle")
    decoder = SpeculativeDecoder(target, proposer, sizer=FixedSizer(16))
    accepted = 0
    for length in (1, 7, 40):
        prompt = random_prompt(length, length)
        out = decoder.generate(prompt, max_new_tokens=29)
        assert_greedy_equal(target, prompt, out.token_ids, hf_greedy(target, prompt, 29), f"adaeagle {drafter}")
        accepted += out.stats.accepted_by_source.get("adaeagle", 0)
    if drafter == "eagle":
        assert accepted > 0, "the head's chains were accepted"
    # the same predictor as an engine-level sizing on an ordinary draft-model proposer
    sizer = make_sizer("ldlp", 16, target=target, path=ldlp_file)
    decoder = SpeculativeDecoder(target, make_proposer("draft", other, max_depth=6, min_prob=0.0), sizer=sizer)
    prompt = random_prompt(7, 3)
    out = decoder.generate(prompt, max_new_tokens=25)
    assert_greedy_equal(target, prompt, out.token_ids, hf_greedy(target, prompt, 25), "draft + ldlp sizing")


def test_missing_ldlp_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("RASD_HOME", str(tmp_path))
    save_exit_layer(tmp_path / "eesd" / "default.safetensors", new_exit_layer(tiny_llama(0), 1), 1)
    with pytest.raises(ValueError, match="rasd train ldlp"):
        make_proposer("adaeagle", target_model=tiny_llama(0), model_name="default", drafter="eesd")
    assert main(["generate", "--method", "adaeagle", "--draft-model", "eesd", "--prompt", "hello"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rasd train ldlp" in err[0] and "--drafter eesd" in err[0]


def test_adaeagle_needs_no_training_for_the_embedded_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On an empty $RASD_HOME the embedded model's head and its LDLP come from the package; a predictor
    trained here takes precedence; another drafter's missing predictor is named with its command."""
    from rasd import paths
    from rasd.decoding.proposers.registry import method_spec
    from rasd.decoding.sizing.ldlp import ldlp_path, shipped_ldlp_path

    monkeypatch.setenv("RASD_HOME", str(tmp_path))
    spec = method_spec("adaeagle")
    spec.check("default")
    shipped = shipped_ldlp_path("default", "eagle")
    assert ldlp_path("default", "eagle") == shipped and shipped.stat().st_size < 2_000_000
    predictor = LengthPredictor.load(shipped)
    assert predictor.hidden_size == 576 and predictor.k_max >= 1
    trained = paths.ldlp_path("default", "eagle")
    constant_predictor(576, 2.0).save(trained)
    assert ldlp_path("default", "eagle") == trained
    with pytest.raises(ValueError, match="--drafter PATH"):
        spec.check("default", draft_model="someone/small-model")


def test_train_ldlp_cli_end_to_end(tiny_model_dir: Path, tmp_path: Path,  # noqa: F811
                                   capsys: pytest.CaptureFixture[str]) -> None:
    data = str(prompt_file(tmp_path))
    exit_path = tmp_path / "exit.safetensors"
    common = ["--model", str(tiny_model_dir), "--data", data, "--seqs", "12", "--prompt-tokens", "8",
              "--gen-tokens", "14"]
    assert main(["train", "eesd", *common, "--out", str(exit_path), "--steps", "2", "--batch", "4"]) == 0
    out = tmp_path / "ldlp.safetensors"
    assert main(["train", "ldlp", *common, "--drafter", "eesd", "--eesd", str(exit_path), "--out", str(out),
                 "--k-max", "4", "--steps", "10"]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["k_max"] == 4 and report["positions"] > 0 and out.stat().st_size < 4_000_000   # 256 wide: ~1.7 MB
    assert "held-out MAE" in capsys.readouterr().err
    rc = main(["generate", "--model", str(tiny_model_dir), "--method", "adaeagle", "--draft-model", "eesd",
               "--eesd", str(exit_path),
               "--ldlp", str(out), "--prompt", "the quick brown fox", "--max-new-tokens", "8", "--sizing", "fixed",
               "--json"])
    assert rc == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) >= 1


@pytest.mark.parametrize("method", ["eesd", "adaeagle", "adaeagle-head"])
def test_sampling_with_self_draft_and_ddd_is_exact(tmp_path: Path, method: str) -> None:
    """χ² of the first three sampled tokens against plain sampling's exact joint distribution.

    The exit layer is perturbed so that drafts are sometimes rejected (residuals exercised); adaeagle uses
    k = 1 and DDD, so whether a second token is drafted depends on the first one's probability; over the
    EAGLE head (an untrained one: drafts often rejected) the chain reads the head's own features.
    """
    from dataclasses import replace

    import numpy as np

    from rasd.decoding.proposers.early_exit import (
        HeadLengthProposer,
        LengthControlledProposer,
        ThompsonLength,
        load_early_exit,
    )
    from tests.decoding.test_eagle import random_head
    from tests.decoding.test_eesd import exit_file
    from tests.decoding.test_sampling_exact import PROMPT, SVOCAB, TARGET, WARPED, check_against_exact, exact_joint

    target = tiny_llama(**TARGET)
    length = (ThompsonLength() if method == "eesd"
              else LDLPController(target, constant_predictor(64, 1.0, k_max=3)))
    if method == "adaeagle-head":
        proposer = HeadLengthProposer(random_head(target, 0), length, "adaeagle")
    else:
        proposer = LengthControlledProposer(load_early_exit(target, exit_file(tmp_path, target, noise=0.3)), length,
                                            method)
    decoder = SpeculativeDecoder(target, proposer, sizer=FixedSizer(16))
    counts, accepted = np.zeros((SVOCAB,) * 3), 0
    for i in range(500):
        out = decoder.generate(PROMPT, 3, sampling=replace(WARPED, seed=2 * i))
        counts[tuple(out.token_ids)] += 1
        accepted += out.stats.num_accepted_tokens
    assert 50 < accepted < 950, f"acceptances {accepted}: both outcomes must be exercised"
    check_against_exact(counts, exact_joint(target, PROMPT, WARPED), f"{method} warped")


def test_head_labels_are_the_chains_the_head_drafts_in_decoding() -> None:
    """`rasd train ldlp --drafter eagle` labels a root with the matching prefix of the chain the head really
    drafts there (its own features past depth 1), not of the teacher-forced one-forward argmax."""
    from rasd.decoding.proposers.eagle import EagleProposer
    from rasd.decoding.step.sampling import SamplingParams
    from rasd.train.eagle_head import extract_features, head_chain_labels
    from tests.decoding.test_eagle import own_text, trained_head

    target, head, k_max = tiny_llama(0), trained_head(0), 4
    seq = own_text(target, 1, seed=7)[0]                                                    # [48]
    feats = torch.stack(extract_features(target, [seq.tolist()], None, batch=1, shard=1)["feats"]).float()[0]
    roots = torch.arange(8, len(seq) - k_max)
    labels = head_chain_labels(head, seq[None], feats[None], roots, k_max)[0]
    for i, r in enumerate(roots.tolist()):
        proposer = EagleProposer(head, max_depth=k_max, top_k=1, width=1, min_prob=0.0, window=None)
        context = seq[: r + 1].tolist()
        proposer.start(context, SamplingParams())
        proposer.observe_hidden(0, feats[:r])
        drafted = proposer.propose(context, k_max).tokens[1:]
        want = 0
        while want < len(drafted) and drafted[want] == int(seq[r + 1 + want]):
            want += 1
        assert int(labels[i]) == want, (r, drafted, seq[r + 1: r + 1 + k_max].tolist())
    assert 0 < float(labels.float().mean()) < k_max, "labels of both kinds: the head is right and wrong"


def test_train_ldlp_for_the_head_and_run_adaeagle_over_it(tiny_model_dir: Path, tmp_path: Path,  # noqa: F811
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`rasd train ldlp --drafter eagle` end to end, then `adaeagle` (its default drafter is the head) runs."""
    from rasd.decoding.model.eagle_head import EagleHead, save_head
    from rasd.decoding.model.loading import load_model

    torch.manual_seed(0)
    head_file = tmp_path / "head.safetensors"
    save_head(head_file, EagleHead(load_model(str(tiny_model_dir)).model))
    common = ["--model", str(tiny_model_dir), "--data", str(prompt_file(tmp_path)), "--seqs", "12",
              "--prompt-tokens", "8", "--gen-tokens", "14"]
    out = tmp_path / "ldlp.safetensors"
    assert main(["train", "ldlp", *common, "--drafter", "eagle", "--eagle", str(head_file), "--out", str(out),
                 "--k-max", "4", "--steps", "10"]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["drafter"] == "eagle" and report["positions"] > 0
    capsys.readouterr()
    rc = main(["generate", "--model", str(tiny_model_dir), "--method", "adaeagle", "--eagle", str(head_file),
               "--ldlp", str(out), "--prompt", "the quick brown fox", "--max-new-tokens", "8", "--sizing", "fixed",
               "--json"])
    assert rc == 0
    body = json.loads(capsys.readouterr().out)
    assert len(body["token_ids"]) >= 1 and body["stats"]["method"] == "adaeagle", body.keys()
