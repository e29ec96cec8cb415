"""The EAGLE head: greedy equality with HF on every path, exact sampling, rollback, files, training.

Tiny random Llamas with untrained heads (drafts mostly rejected) and with heads trained here for a few
seconds on the tiny target's own greedy text (drafts often accepted): both must give HF `generate`'s tokens.
"""

from __future__ import annotations

import json
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from rasd.cli import main
from rasd.decoding.model.eagle_head import EagleHead, HeadConfig, load_head, read_meta, save_head
from rasd.decoding.model.static_step import StepConfig
from rasd.decoding.proposers import make_proposer
from rasd.decoding.proposers.registry import method_spec
from rasd.decoding.runtime.engine import SpeculativeDecoder
from rasd.decoding.sizing.sizers import FixedSizer
from rasd.decoding.step.batch_decoder import BatchDecoder
from rasd.decoding.step.sampling import SamplingParams
from rasd.index.suffix_array import SuffixArray
from rasd.train.common import greedy_continuations
from rasd.train.eagle_head import _turns, depth_agreement, draft_vocabulary, extract_features, train_head, user_turns
from tests.decoding.test_eesd import WORDS, tiny_model_dir  # noqa: F401 - a fixture
from tests.helpers import assert_greedy_equal, hf_greedy, random_prompt, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

STATIC = StepConfig(static=True)


def own_text(model: torch.nn.Module, n: int, seed: int = 0, vocab: int = 96) -> torch.Tensor:
    """[n, 48] the model's greedy continuations of random 8-token prompts."""
    prompts = torch.tensor([random_prompt(8, seed + s, vocab) for s in range(n)])
    return greedy_continuations(model, prompts, 40, 32, [], None)


@cache
def trained_head(seed: int, vocab_size: int = 96, init: float = 0.02) -> EagleHead:
    """A head trained for a few seconds on the tiny target's own text (shared by the tests; never mutated)."""
    target = tiny_llama(seed, vocab=vocab_size, init=init)
    seqs = own_text(target, 64, vocab=vocab_size)
    data = extract_features(target, [s.tolist() for s in seqs], None, batch=16, shard=64)
    torch.manual_seed(seed)
    head = EagleHead(target)
    train_head(head, data["tokens"], data["feats"], 250, batch=8, lr=3e-3, progress=False)
    return head


def random_head(target: torch.nn.Module, seed: int) -> EagleHead:
    torch.manual_seed(seed)
    return EagleHead(target).eval()


def eagle_decoder(target: torch.nn.Module, head: EagleHead, step: StepConfig | None = None,
                  **options: Any) -> SpeculativeDecoder:
    options = {"min_prob": 0.0, **options}
    return SpeculativeDecoder(target, make_proposer("eagle", head=head, **options), sizer=FixedSizer(16), step=step)


@pytest.mark.parametrize("trained", [False, True])
@pytest.mark.parametrize("step", [None, STATIC], ids=["dynamic", "static"])
def test_eagle_greedy_equals_hf(trained: bool, step: StepConfig | None) -> None:
    target = tiny_llama(0)
    head = trained_head(0) if trained else random_head(target, 1)
    decoder = eagle_decoder(target, head, step)
    accepted = []
    for length in (1, 7, 40):
        prompt = random_prompt(length, length)
        out = decoder.generate(prompt, max_new_tokens=29)
        assert_greedy_equal(target, prompt, out.token_ids, hf_greedy(target, prompt, 29), f"eagle {length}")
        accepted.append(out.stats.mean_accepted_tokens)
    if trained:
        assert max(accepted) > 1.5, f"a trained head's drafts get accepted ({accepted})"


def test_trained_head_agrees_with_the_target_on_text_it_never_saw() -> None:
    target = tiny_llama(0)
    held_out = own_text(target, 16, seed=500)
    feats = torch.stack(extract_features(target, [s.tolist() for s in held_out], None, batch=16, shard=16)["feats"])
    valid = torch.ones_like(held_out, dtype=torch.bool)
    before = depth_agreement(random_head(target, 1), held_out, feats, valid, 8)
    after = depth_agreement(trained_head(0), held_out, feats, valid, 8)
    assert len(after["top1"]) == 4 and after["positions"][0] > 0
    assert after["top1"][0] > before["top1"][0] + 0.2, (before, after)
    assert all(a >= b for a, b in zip(after["top4"], after["top1"], strict=True))


def test_head_cache_rolls_back_to_the_accepted_path() -> None:
    """After steps with partial acceptance, the head's state equals a fresh head fed the whole context."""
    target = tiny_llama(0)
    head = trained_head(0)
    decoder = eagle_decoder(target, head)
    prompt = random_prompt(20, 3)
    stream = decoder.stream(prompt, 24)
    partial = 0
    for _ in stream:
        proposer = decoder.proposer
        context = stream.context
        if stream.reason is not None or len(context) - len(prompt) < 3:
            continue
        tree = proposer.propose(context, 16)
        if tree.num_draft_tokens == 0:
            continue
        fresh = make_proposer("eagle", head=head, min_prob=0.0)
        fresh.start(prompt, SamplingParams())
        fresh.observe_hidden(proposer.feat_start, proposer.feats)
        fresh.offset = proposer.offset
        ours, theirs = proposer.root_probs(context), fresh.root_probs(context)
        assert proposer.cache.get_seq_length() == len(proposer.cached) == len(context) - proposer.offset
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)
        partial += 1
    assert partial > 3
    assert stream.stats.num_accepted_tokens < stream.stats.num_draft_tokens, "some drafts were rejected"


def test_the_features_buffer_holds_what_appending_would_and_restarts_on_a_gap() -> None:
    """`observe_hidden` writes into a buffer that doubles (no copy of every feature at every step): what it holds
    is what concatenation held, after appends, an overwrite of the last positions and a gap (a fresh start)."""
    proposer = make_proposer("eagle", head=trained_head(0))
    proposer.start([1, 2, 3], SamplingParams())
    rows = torch.randn(40, 64, generator=torch.Generator().manual_seed(0))
    want = rows[:10].clone()
    proposer.observe_hidden(0, rows[:10])
    for start, n in [(10, 1), (11, 3), (14, 2), (13, 5), (18, 9), (27, 13)]:   # (13, 5): positions 13-15 again
        proposer.observe_hidden(start, rows[start: start + n])
        want = torch.cat([want[:start], rows[start: start + n]])
        assert proposer.feat_start == 0 and torch.equal(proposer.feats, want)
    assert proposer._known_until() == 40
    proposer.observe_hidden(45, rows[:2])
    assert proposer.feat_start == 45 and torch.equal(proposer.feats, rows[:2]), "a gap: begin again there"


def test_eagle_in_a_batch_with_rows_joining_and_chunked_prefill() -> None:
    target = tiny_llama(0)
    head = trained_head(0)
    batch = BatchDecoder(target, chunk_tokens=8, slots=4)
    prompts = [random_prompt(n, 40 + n) for n in (5, 30, 17, 44)]
    streams = [eagle_decoder(target, head).stream(p, 20) for p in prompts]
    outs: dict[int, list[int]] = {i: [] for i in range(len(streams))}
    first = batch.add(streams[0])
    outs[0] += first or []
    pending = list(range(1, len(streams)))
    for _ in range(400):
        if pending and len(batch) < 3:
            i = pending.pop(0)
            outs[i] += batch.add(streams[i]) or []
        for stream, block in batch.step():
            outs[streams.index(stream)] += block
        if not pending and len(batch) == 0:
            break
    for i, prompt in enumerate(prompts):
        assert_greedy_equal(target, prompt, outs[i], hf_greedy(target, prompt, 20), f"batched eagle {i}")
    assert sum(s.stats.num_accepted_tokens for s in streams) > 0


def test_rasd_with_the_head_as_its_draft_equals_hf() -> None:
    target = tiny_llama(0)
    head = trained_head(0)
    store = SuffixArray.from_documents([random_prompt(60, 50 + i) for i in range(4)])
    draft = make_proposer("eagle", head=head, min_prob=0.0)
    proposer = make_proposer("rasd", datastores=[store], draft_proposer=draft)
    decoder = SpeculativeDecoder(target, proposer, sizer=FixedSizer(16))
    for length in (7, 40):
        prompt = random_prompt(length, length + 1)
        out = decoder.generate(prompt, max_new_tokens=29)
        assert_greedy_equal(target, prompt, out.token_ids, hf_greedy(target, prompt, 29), "rasd+eagle")
    assert decoder.proposer.draft.feats is not None, "the engine fed the head inside rasd"


def test_optree_over_the_head_equals_hf() -> None:
    target = tiny_llama(0)
    proposer = make_proposer("eagle", head=trained_head(0), shape="optree", delta=0.0, max_depth=4)
    decoder = SpeculativeDecoder(target, proposer, sizer=FixedSizer(16))
    prompt = random_prompt(12, 9)
    out = decoder.generate(prompt, max_new_tokens=29)
    assert_greedy_equal(target, prompt, out.token_ids, hf_greedy(target, prompt, 29), "optree+eagle")


def test_eagle_sampling_is_exact() -> None:
    from tests.decoding.test_sampling_exact import PROMPT, SVOCAB, TARGET, WARPED, check_against_exact, exact_joint

    target = tiny_llama(**TARGET)
    head = random_head(target, 2)
    decoder = eagle_decoder(target, head, max_depth=2)
    joint = exact_joint(target, PROMPT, WARPED)
    counts = torch.zeros((SVOCAB,) * 3, dtype=torch.float64)
    accepted = 0
    for i in range(800):
        out = decoder.generate(PROMPT, 3, sampling=replace(WARPED, seed=2 * i))
        a, b, c = out.token_ids
        counts[a, b, c] += 1
        accepted += out.stats.num_accepted_tokens
    assert 50 < accepted < 1500, f"acceptances {accepted}: both outcomes must be exercised"
    check_against_exact(counts.numpy(), joint, "eagle warped")


def test_head_file_round_trip_and_refusals(tmp_path: Path) -> None:
    target = tiny_llama(0)
    head = trained_head(0)
    vocab = draft_vocabulary(torch.arange(96), 40, always={3})
    assert vocab is not None and 3 in vocab.tolist() and len(vocab) == 40
    head_v = EagleHead(target, vocab)
    head_v.load_state_dict(head.state_dict())
    path = tmp_path / "head.safetensors"
    save_head(path, head_v, {"agreement": {"top1": [0.5]}})
    assert read_meta(path)["report"]["agreement"]["top1"] == [0.5]
    loaded = load_head(target, path)
    assert loaded.vocab is not None and loaded.vocab.tolist() == vocab.tolist()
    prompt = random_prompt(9, 4)
    out = eagle_decoder(target, loaded).generate(prompt, 20)
    assert_greedy_equal(target, prompt, out.token_ids, hf_greedy(target, prompt, 20), "restricted vocabulary")
    other = tiny_llama(1, vocab=64)
    with pytest.raises(ValueError, match="trained for another model .*vocab_size"):
        load_head(other, path)
    (tmp_path / "junk.safetensors").write_bytes(b"not a head")
    with pytest.raises(ValueError, match="not a readable EAGLE head"):
        load_head(target, tmp_path / "junk.safetensors")
    with pytest.raises(ValueError, match="rasd train eagle"):
        method_spec("eagle").check("some/model-without-a-head")


def conversations_file(tmp_path: Path, n: int = 24) -> Path:
    """ShareGPT-style rows: a user turn, an assistant turn and a second user turn of random words."""
    gen = torch.Generator().manual_seed(0)

    def words(k: int) -> str:
        return " ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (k,), generator=gen))

    rows = [{"conversations": [{"from": "human", "value": words(40)}, {"from": "gpt", "value": words(30)},
                               {"from": "human", "value": words(36)}]} for _ in range(n)]
    path = tmp_path / "conversations.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_train_eagle_cli_end_to_end(tiny_model_dir: Path, tmp_path: Path,  # noqa: F811
                                    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RASD_HOME", str(tmp_path / "home"))
    out = tmp_path / "head.safetensors"
    args = ["train", "eagle", "--model", str(tiny_model_dir), "--data", str(conversations_file(tmp_path)),
            "--out", str(out), "--steps", "30", "--seqs", "16", "--seq-len", "64", "--batch", "4",
            "--draft-vocab", "40", "--eval-seqs", "4"]
    assert main(args) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["sequences"] == 16 and report["draft_vocab"] == 40 and report["steps"] == 30
    from rasd.train.config import EagleConfig

    recorded = EagleConfig(model=str(tiny_model_dir), data=str(conversations_file(tmp_path)), out=out, steps=30,
                           seqs=16, seq_len=64, batch=4, draft_vocab=40, eval_seqs=4).record()
    resolved = {"steps", "order_seed", "turns", "taps", "draft_vocab"}     # recorded as they were resolved
    assert {k: report[k] for k in recorded if k not in resolved} == \
        {k: v for k, v in recorded.items() if k not in resolved}, "the report records the config it trained with"
    assert len(report["agreement"]["top1"]) == 4 and report["agreement"]["positions"][0] > 0
    assert "held-out top-1 agreement" in capsys.readouterr().err
    shards = list((tmp_path / "home" / "eagle-features").rglob("shard-*.pt"))
    assert shards and list((tmp_path / "home" / "eagle-features").rglob("checkpoint-*.pt"))
    first = load_file(str(out))
    assert main(args) == 0, "a second run reads the stored features and the finished checkpoint"
    again = load_file(str(out))
    assert all(torch.equal(first[k], again[k]) for k in first), "deterministic: the same head again"
    assert main(["generate", "--model", str(tiny_model_dir), "--method", "eagle", "--eagle", str(out), "--prompt",
                 "the quick brown fox", "--max-new-tokens", "8", "--sizing", "fixed", "--json"]) == 0
    tokens = json.loads(capsys.readouterr().out)["token_ids"]
    assert len(tokens) >= 1
    # `rasd` drafts with the head file it is given (it once passed the path on to its retrieval source and failed)
    assert main(["generate", "--model", str(tiny_model_dir), "--method", "rasd", "--eagle", str(out), "--prompt",
                 "the quick brown fox", "--max-new-tokens", "8", "--sizing", "fixed", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == tokens
    # continued on the target's own answers with the training-time test: same vocabulary, a report that says so
    more = tmp_path / "head2.safetensors"
    assert main([*args[:-2], "--eval-seqs", "4", "--out", str(more), "--init", str(out), "--regenerate", "12",
                 "--ttt", "--steps", "10", "--turns", "1,2"]) == 0
    report2 = json.loads(more.with_suffix(".json").read_text())
    assert report2["regenerate"] == 12 and report2["ttt"] and report2["init"] == str(out)
    assert report2["turns"] == [1, 2] and report2["sequences"] == 32, "each conversation's two user turns"
    assert torch.equal(load_file(str(more))["draft_vocab"], first["draft_vocab"])
    answers = sorted((tmp_path / "home" / "selfgen").rglob("*.pt"))
    assert answers, "the regenerated answers are cached"
    # a new --order-seed draws other batches from the same cached answers (keyed by --seed, not written again)
    other = tmp_path / "head3.safetensors"
    assert main([*args[:-2], "--eval-seqs", "4", "--out", str(other), "--init", str(out), "--regenerate", "12",
                 "--ttt", "--steps", "10", "--turns", "1,2", "--order-seed", "7"]) == 0
    report3 = json.loads(other.with_suffix(".json").read_text())
    assert (report2["order_seed"], report3["order_seed"]) == (0, 7) and report3["seed"] == 0
    assert report3["train_tokens"] == report2["train_tokens"]
    assert sorted((tmp_path / "home" / "selfgen").rglob("*.pt")) == answers
    assert not torch.equal(load_file(str(other))["fc.weight"], load_file(str(more))["fc.weight"])
    # EAGLE-3's fused features: the plain head continued with layer 0 tapped, on answers cached apart
    fused = tmp_path / "fused.safetensors"
    assert main([*args[:-2], "--eval-seqs", "4", "--out", str(fused), "--init", str(out), "--regenerate", "12",
                 "--ttt", "--steps", "10", "--turns", "1,2", "--taps", "0"]) == 0
    report4 = json.loads(fused.with_suffix(".json").read_text())
    assert report4["taps"] == [0] and report4["agreement_before"] == report2["agreement_before"], \
        "the fused head starts as its plain parent"
    assert read_meta(fused)["taps"] == [0] and "fc_taps.weight" in load_file(str(fused))
    assert len(sorted((tmp_path / "home" / "selfgen").rglob("*.pt"))) > len(answers), "tapped answers cached apart"
    assert main(["generate", "--model", str(tiny_model_dir), "--method", "rasd", "--eagle", str(fused), "--prompt",
                 "the quick brown fox", "--max-new-tokens", "8", "--sizing", "fixed", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == tokens
    for bad, why in (("9", "layers are 0..2"), ("a", "layer numbers"), ("0,0", "distinct")):
        assert main([*args[:-2], "--out", str(tmp_path / "x.safetensors"), "--taps", bad]) == 2
        assert why in capsys.readouterr().err


def test_later_user_turns_are_prompts_of_their_own_and_bad_turn_lists_are_refused(tmp_path: Path,
                                                                                 capsys: pytest.CaptureFixture[str]
                                                                                 ) -> None:
    row = {"conversations": [{"from": "human", "value": "first"}, {"from": "gpt", "value": "answer"},
                             {"from": "human", "value": "second"}, {"from": "gpt", "value": "more"},
                             {"from": "user", "value": "third"}]}
    assert user_turns(row) == ["first"]
    assert user_turns(row, (2,)) == ["second"] and user_turns(row, (1, 3)) == ["first", "third"]
    assert user_turns(row, (4,)) == [], "a conversation without that turn gives no prompt"
    assert user_turns({"prompt": "plain"}, (1,)) == ["plain"] and user_turns({"prompt": "plain"}, (2,)) == []
    assert _turns("2") == (2,) and _turns("1, 2") == (1, 2)
    for bad in ("0", "x", "", "-1"):
        with pytest.raises(ValueError, match="--turns"):
            _turns(bad)
    assert main(["train", "eagle", "--data", str(tmp_path / "none.jsonl"), "--turns", "0"]) != 0
    assert "--turns" in capsys.readouterr().err, "refused before the data or the model is read"


def test_a_sizer_that_says_no_layer_pays_stops_the_tree_at_depth_one_and_output_is_unchanged() -> None:
    """`grow_pays` (cost sizing) decides whether a next layer is drafted; asked and refused, the head runs no
    node forward, and decoding still gives HF's tokens."""
    target, head = tiny_llama(0), trained_head(0)
    asked: list[int] = []

    def never(tree: Any, frontier: list[int], context_len: int, forward_s: float) -> bool:
        asked.append(len(frontier))
        return False

    proposer = make_proposer("eagle", head=head, top_k=2, width=4, min_prob=0.0)
    proposer.grow_pays = never
    prompt = random_prompt(12, 5)
    dec = SpeculativeDecoder(target, proposer, sizer=FixedSizer(16))
    out = dec.generate(prompt, 24)
    assert asked, "the sizer was asked before a layer was grown"
    assert out.stats.steps > 0 and len(out.stats.accepted_per_position) <= 1   # nothing accepted past depth 1
    assert_greedy_equal(target, prompt, out.token_ids, hf_greedy(target, prompt, 24), "eagle, depth-1 trees")


@pytest.mark.parametrize("budget", [1, 2, 3, 5])
def test_a_tree_that_fills_its_budget_stops_cleanly(budget: int) -> None:
    """Regression: when a layer filled the budget, the next layer read the previous frontier's logits
    (IndexError whenever the new frontier was wider); found by `rasd` drafting with the head."""
    target = tiny_llama(0)
    for proposer in (make_proposer("eagle", head=trained_head(0), top_k=2, width=4, min_prob=0.0),
                     make_proposer("draft", draft_model=tiny_llama(0, init=0.03), top_k=2, width=4, min_prob=0.0)):
        prompt = random_prompt(12, 5)
        proposer.start(prompt, SamplingParams())
        if getattr(proposer, "wants_hidden", False):
            SpeculativeDecoder(target, proposer).stream(prompt, 2).__next__()   # the prefill feeds the head
        tree = proposer.propose(prompt, budget)
        assert 1 <= tree.num_draft_tokens <= budget


def test_training_time_test_pass_sees_what_a_depth_two_node_sees() -> None:
    """The second training pass (EAGLE-3's test) computes exactly the depth-2 chain node of decoding."""
    from rasd.decoding.step.cache import GrowableLayer
    from rasd.train.eagle_head import _second_pass_mask, _StepCache

    target = tiny_llama(3, vocab=96, init=0.02)
    seq = own_text(target, 1, seed=3)                                         # [1, 48]
    feats = torch.stack(extract_features(target, [seq[0].tolist()], None)["feats"]).float()
    head = random_head(target, 3)
    for p in (head.layer.self_attn.o_proj.weight, head.layer.mlp.down_proj.weight):
        torch.nn.init.normal_(p, std=0.05)                                    # not a pass-through: attention matters
    t = seq.shape[1]
    pos = torch.arange(1, t)[None]
    with torch.no_grad():
        kv = _StepCache()
        pred = head(feats[:, :-1], seq[:, 1:], pos, kv=kv)
        pred2 = head(pred[:, :-1], seq[:, 2:], pos[:, 1:] + 1, kv=kv, mask=_second_pass_mask(t - 1, t - 2))
        for j in (0, 5, t - 3):
            cache = GrowableLayer()
            first = head(feats[:, : j + 1], seq[:, 1: j + 2], pos[:, : j + 1], kv=cache)
            node = head(first[:, -1:], seq[:, j + 2: j + 3], torch.tensor([[j + 2]]), kv=cache)
            torch.testing.assert_close(node[0, 0], pred2[0, j], rtol=1e-3, atol=1e-3)   # a wrong mask: off by ~1


def test_training_time_test_lowers_the_depth_two_loss() -> None:
    """With the second pass trained, drafting on its own features gets better than without (tiny target)."""
    from rasd.train.eagle_head import head_loss

    target = tiny_llama(0, vocab=96, init=0.02)
    seqs = own_text(target, 64)
    data = extract_features(target, [s.tolist() for s in seqs], None, batch=16, shard=64)
    losses = {}
    for ttt in (False, True):
        torch.manual_seed(0)
        head = EagleHead(target)
        train_head(head, data["tokens"], data["feats"], 120, batch=8, lr=3e-3, progress=False, ttt=ttt)
        with torch.no_grad():
            ids, feats = seqs[:16], torch.stack(data["feats"][:16]).float()
            _, parts = head_loss(head, ids, feats, torch.ones_like(ids, dtype=torch.bool), ttt=True)
        losses[ttt] = parts["ce2"]
    assert losses[True] < losses[False]


def test_answers_with_features_match_a_teacher_forward_and_stop_after_eos() -> None:
    """The regenerated training data takes its features from the generation's own forwards (no second
    pass): they must be the teacher forward's features, every answer cut after its first EOS."""
    from rasd.decoding.model.features import FinalNormTap
    from rasd.train.eagle_head import _generate_with_features, _shard_features

    target = tiny_llama(3)
    windows = torch.randint(0, 96, (5, 8), generator=torch.Generator().manual_seed(5))
    plain = target.generate(windows, attention_mask=torch.ones_like(windows), max_new_tokens=12, do_sample=False)
    eos = int(plain[1, 8 + 3])            # row 1 writes it at its 4th new token (others may too, earlier or later)
    data = _generate_with_features(target, windows, 12, [eos])
    tap = FinalNormTap(target)
    try:
        ref = _shard_features(target, tap, data["tokens"], 8, 96)
    finally:
        tap.remove()
    for toks, feats, want in zip(data["tokens"], data["feats"], ref["feats"], strict=True):
        assert feats.shape == (len(toks), 64) and torch.allclose(feats.float(), want.float(), atol=2e-3)
        assert eos not in toks[8:-1], "nothing after the first EOS"
    assert len(data["tokens"][1]) <= 8 + 4 and data["tokens"][1][-1] == eos
    assert int(data["counts"].sum()) == sum(len(t) - 1 for t in data["tokens"])


def test_a_head_reading_tapped_layers_starts_as_the_plain_head_and_trains() -> None:
    """EAGLE-3's fused features: taps of earlier layers beside f_t; at the start the head ignores them (so a
    fused head begins where a plain one does), its targets stay f_{t+1}, and training uses them."""
    from rasd.decoding.model.features import FinalNormTap
    from rasd.train.eagle_head import head_loss

    target = tiny_llama(0, vocab=96, init=0.02)
    seqs = own_text(target, 32)
    plain = extract_features(target, [s.tolist() for s in seqs], None, batch=16, shard=32)
    fused = extract_features(target, [s.tolist() for s in seqs], None, batch=16, shard=32, taps=(0,))
    hidden = target.config.hidden_size
    assert fused["feats"][0].shape == (seqs.shape[1], 2 * hidden)
    torch.testing.assert_close(fused["feats"][3][:, hidden:], plain["feats"][3])          # final part unchanged
    assert torch.allclose(fused["feats"][3][:, :hidden].float().pow(2).mean(-1), torch.ones(1), atol=0.05)
    torch.manual_seed(0)
    one = EagleHead(target).eval()
    torch.manual_seed(0)
    two = EagleHead(target, taps=(0,)).eval()
    ids, valid = seqs[:4], torch.ones_like(seqs[:4], dtype=torch.bool)
    with torch.no_grad():
        a = head_loss(one, ids, torch.stack(plain["feats"][:4]).float(), valid, ttt=True)[1]
        b = head_loss(two, ids, torch.stack(fused["feats"][:4]).float(), valid, ttt=True)[1]
    assert a == pytest.approx(b, rel=1e-4)
    train_head(two, fused["tokens"], fused["feats"], 30, batch=8, lr=3e-3, progress=False, ttt=True)
    assert two.fc_taps.weight[:, :hidden].abs().sum() > 0, "the tapped layer's weights were trained"
    taps = FinalNormTap(target, (0,))
    taps.remove()
    with torch.no_grad():
        target(seqs[:1])
    assert taps.last is None and not taps.kept, "a removed tap keeps nothing"


def test_the_first_forward_is_charged_what_a_whole_draft_step_costs() -> None:
    """`root_pays` is asked with `root_s` (a drafting `propose`'s time less its later layers), not with one layer's
    forward: an EAGLE-head try cost 12 ms where a forward was timed at 5, and the head tried at 7% acceptance.
    `root_s` covers at least the root's own forward, and only tries whose catch-up was short are sampled."""
    target = tiny_llama(0)
    proposer = make_proposer("eagle", head=random_head(target, 1), min_prob=0.0)
    charged: list[float] = []

    def root_pays(root: int, source: str, context_len: int, forward_s: float, beside: Any = None) -> bool:
        charged.append(forward_s)
        return True

    proposer.root_pays = root_pays
    decoder = SpeculativeDecoder(target, proposer, sizer=FixedSizer(8))
    decoder.generate(random_prompt(12, 3), max_new_tokens=24)
    assert proposer.root_s is not None and proposer.forward_s is not None
    assert charged
    assert proposer.root_s >= 0.5 * proposer.forward_s   # the root's forward and its logits are in it
    proposer.root_s = 123.0
    proposer.start(random_prompt(12, 4), SamplingParams())
    proposer.observe_hidden(0, torch.zeros(12, target.config.hidden_size))
    proposer.propose(random_prompt(12, 4) + [5], 8)
    assert charged[-1] == 123.0


def test_a_catch_up_after_a_long_past_attends_as_one_token_does() -> None:
    """A few tokens run on top of many cached ones (the head catching up after a verification) take an explicit
    mask, not the prefill's padded queries (past + T rows: 14 ms against 5 for one token at 600 cached), and give
    the same features as running them one at a time."""
    from rasd.decoding.step.cache import GrowableLayer

    target = tiny_llama(0)
    head = random_head(target, 2)
    hidden = target.config.hidden_size
    torch.manual_seed(0)
    feats, ids = torch.randn(1, 40, hidden), torch.randint(0, 96, (1, 40))
    together, alone = GrowableLayer(), GrowableLayer()
    with torch.inference_mode():
        head(feats[:, :37], ids[:, :37], torch.arange(37)[None], kv=together)
        head(feats[:, :37], ids[:, :37], torch.arange(37)[None], kv=alone)
        batch = head(feats[:, 37:], ids[:, 37:], torch.arange(37, 40)[None], kv=together)    # 3 on top of 37
        single = torch.cat([head(feats[:, i:i + 1], ids[:, i:i + 1], torch.tensor([[i]]), kv=alone)
                            for i in range(37, 40)], dim=1)
        calls: list[int] = []
        original = torch.nn.functional.scaled_dot_product_attention

        def spy(q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            calls.append(q.shape[2])
            return original(q, *args, **kwargs)

        torch.nn.functional.scaled_dot_product_attention = spy
        try:
            head(feats[:, 37:], ids[:, 37:], torch.arange(37, 40)[None], kv=together.__class__())  # no past: causal
            together.crop(-3)
            head(feats[:, 37:], ids[:, 37:], torch.arange(37, 40)[None], kv=together)
        finally:
            torch.nn.functional.scaled_dot_product_attention = original
    torch.testing.assert_close(batch, single, atol=1e-5, rtol=1e-5)
    assert calls == [3, 3]   # three query rows each time, never past + 3


def test_rasd_refuses_a_head_file_it_would_not_draft_with(tmp_path: Path) -> None:
    """`eagle=PATH` with `head=off`: an error, not a head silently left unused."""
    from rasd.decoding.model.loading import LoadedModel
    from rasd.decoding.runtime.engine import build_decoder

    target = tiny_llama(0)
    path = tmp_path / "head.safetensors"
    save_head(path, random_head(target, 0))
    loaded = LoadedModel(model=target, tokenizer=None, name="tiny", device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="drafts with no head"):
        build_decoder(loaded, "rasd", sizing="fixed", eagle=str(path), head="off")
    decoder = build_decoder(loaded, "rasd", sizing="fixed", max_nodes=8, eagle=str(path))
    assert decoder.proposer.draft is not None and decoder.proposer.draft.head.config == HeadConfig.of(target)
