"""The batched answer writer behind `rasd train eagle --regenerate` (`rasd.train.answers`)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from scipy.stats import chisquare

from rasd.cli import main
from rasd.train.answers import answers_with_features
from rasd.train.eagle_head import _answers_chunk, _generate_with_features, _generation_copy, _hf_answers
from tests.helpers import tiny_llama


def _windows(k: int, length: int = 8, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, 96, (k, length), generator=torch.Generator().manual_seed(seed))


def test_greedy_answers_and_features_are_hf_generates() -> None:
    """fp32 greedy: the preallocated-cache loop writes HF `generate`'s tokens and its forwards' features."""
    target = tiny_llama(3)
    windows = _windows(6)
    seq, feats = answers_with_features(target, windows, 10)
    ref_seq, ref_feats = _hf_answers(target, windows, 10, [])
    assert torch.equal(seq, ref_seq)
    assert feats.shape == ref_feats.shape == (6, 8 + 10 - 1, 64) and feats.dtype == torch.float16
    assert torch.allclose(feats.float(), ref_feats.float(), atol=2e-3)


def test_answers_with_tapped_layers_carry_what_a_teacher_forward_taps() -> None:
    """With `taps` (a fused head's data) every position's features are the tapped layers' and the final ones, as
    `extract_features` takes them from one HF forward over the written text; the text itself is unchanged."""
    from rasd.train.eagle_head import extract_features

    target = tiny_llama(3)
    windows = _windows(4)
    plain_seq, plain = answers_with_features(target, windows, 10)
    seq, feats = answers_with_features(target, windows, 10, taps=(0,))
    assert torch.equal(seq, plain_seq) and feats.shape == (4, 8 + 10 - 1, 128)
    torch.testing.assert_close(feats[..., 64:], plain)
    teacher = extract_features(target, [s[:-1].tolist() for s in seq], None, batch=4, shard=4, taps=(0,))["feats"]
    torch.testing.assert_close(feats.float(), torch.stack(teacher).float(), atol=3e-3, rtol=3e-3)


def test_the_loop_stops_once_every_row_wrote_an_eos() -> None:
    target = tiny_llama(3)
    windows = _windows(3)
    full, _ = answers_with_features(target, windows, 12)
    eos = sorted({int(full[i, 8 + 2]) for i in range(3)})    # every row writes one of these by its 3rd token
    seq, feats = answers_with_features(target, windows, 12, eos=eos)
    assert seq.shape[1] <= 8 + 3 and feats.shape[1] == seq.shape[1] - 1
    assert torch.equal(seq, full[:, : seq.shape[1]]), "stopping early changes no token written before"


def test_sampled_answers_follow_the_tempered_distribution() -> None:
    """The first sampled token of 4,000 copies of one prompt against softmax(logits / T): χ² (exact sampling)."""
    target = tiny_llama(4, init=0.2)   # a peaked random model: a few tokens carry the mass
    window = _windows(1)
    temperature = 0.7
    with torch.inference_mode():
        probs = torch.softmax(target(window).logits[0, -1].float() / temperature, -1)
    seq, _ = answers_with_features(target, window.repeat(4000, 1), 1, temperature,
                                   torch.Generator().manual_seed(0))
    counts = torch.bincount(seq[:, -1], minlength=probs.numel()).double()
    expected = probs.double() * 4000
    keep = expected >= 5                           # χ²'s cells; the rest pooled into one
    observed = torch.cat([counts[keep], counts[~keep].sum()[None]])
    wanted = torch.cat([expected[keep], expected[~keep].sum()[None]])
    assert keep.sum() >= 3
    assert chisquare(observed.numpy(), wanted.numpy() * observed.sum().item() / wanted.sum().item()).pvalue > 1e-3
    again, _ = answers_with_features(target, window.repeat(4000, 1), 1, temperature,
                                     torch.Generator().manual_seed(0))
    assert torch.equal(seq, again), "seeded: the same answers again"


def test_a_bf16_copy_writes_its_own_answers_apart_from_the_fp32_cache(tmp_path: Path) -> None:
    """`--gen-dtype bfloat16`: the target stays fp32 (held-out data uses it); the copy's answers are cached under
    another key, and sampled answers under yet another per temperature and seed."""
    target = tiny_llama(3)
    copy = _generation_copy(target, "bfloat16")
    assert next(target.parameters()).dtype == torch.float32 and next(copy.parameters()).dtype == torch.bfloat16
    assert _generation_copy(target, "float32") is target
    windows = _windows(4)
    data = _answers_chunk(copy, windows, 6, [], tmp_path)
    assert [len(t) for t in data["tokens"]] == [13] * 4, "no EOS: the last token is never forwarded, so dropped"
    assert data["feats"][0].shape == (13, 64) and data["feats"][0].dtype == torch.float16
    _answers_chunk(target, windows, 6, [], tmp_path)
    _answers_chunk(target, windows, 6, [], tmp_path, temperature=0.8, seed=1)
    _answers_chunk(target, windows, 6, [], tmp_path, temperature=0.8, seed=2)
    assert len(list(tmp_path.glob("*-features.pt"))) == 4
    greedy = _generate_with_features(target, windows, 6, [])
    assert _answers_chunk(target, windows, 6, [], tmp_path)["tokens"] == greedy["tokens"], "read back"


def test_a_plain_cached_chunk_gets_its_taps_from_one_teacher_forward(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`--taps` over answers cached without them: the same text, the tapped layers taken by one forward of it
    (what writing it with taps records), cached apart; nothing is generated again."""
    import rasd.train.eagle_head as eagle

    target = tiny_llama(3)
    windows = _windows(5)
    plain = _answers_chunk(target, windows, 7, [], tmp_path, temperature=0.9, seed=4)
    written = _generate_with_features(target, windows, 7, [], 0.9, 4, taps=(0, 1))

    def no_generation(*_a: object, **_k: object) -> None:
        raise AssertionError("a cached chunk was generated again")

    monkeypatch.setattr(eagle, "_generate_with_features", no_generation)
    tapped = _answers_chunk(target, windows, 7, [], tmp_path, temperature=0.9, seed=4, taps=(0, 1))
    assert tapped["tokens"] == plain["tokens"] == written["tokens"]
    assert torch.equal(tapped["counts"], plain["counts"])
    for got, want in zip(tapped["feats"], written["feats"], strict=True):
        assert got.shape == want.shape == (len(want), 3 * 64)
        torch.testing.assert_close(got.float(), want.float(), atol=3e-3, rtol=3e-3)
    assert len(list(tmp_path.glob("*-taps0-1-features.pt"))) == 1, "cached apart from the plain chunk"


def tiny_target(folder: Path, init: float = 0.02) -> SimpleNamespace:
    """A tiny Llama with a real (tiny) tokenizer, shaped as `regenerated_data` reads a loaded model."""
    from transformers import AutoTokenizer

    from tests.helpers import make_tiny_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(make_tiny_tokenizer(folder / "tok"))
    return SimpleNamespace(model=tiny_llama(3, vocab=len(tokenizer), init=init), tokenizer=tokenizer,
                           eos_token_ids=[])


def test_max_answers_answers_only_the_first_prompts(tmp_path: Path) -> None:
    """`--max-answers N`: the first N prompts' answers, the chunks a longer run reads back."""
    from rasd.train.eagle_head import regenerated_data

    target = tiny_target(tmp_path)
    rows = [{"conversations": [{"from": "human", "value": f"tell me about glaciers and bridges, part {i} " * 3}]}
            for i in range(6)]
    some = regenerated_data(target, rows, 4, tmp_path / "c", window=8, batch=2, limit=4)
    every = regenerated_data(target, rows, 4, tmp_path / "c", window=8, batch=2)
    assert len(some["tokens"]) == 4 and len(every["tokens"]) == 6
    assert every["tokens"][:4] == some["tokens"]
    assert len(list((tmp_path / "c").glob("*-features.pt"))) == 3, "the first two chunks were read back"


@pytest.mark.parametrize("flags", [["--temperature", "-1"], ["--gen-batch", "0"], ["--samples", "2"],
                                   ["--samples", "0", "--temperature", "0.5"],
                                   ["--max-answers", "0"]])
def test_bad_generation_options_are_refused_in_one_line(tmp_path: Path, flags: list[str],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "eagle", "--data", str(tmp_path / "none.jsonl"), "--regenerate", "8", *flags]) != 0
    err = capsys.readouterr().err
    assert flags[0] in err and "Traceback" not in err, "refused before the data or the model is read"


def test_the_two_level_draw_is_exact_across_blocks() -> None:
    """`_draw` over a vocabulary of two whole blocks (no padding), mass on both sides of the boundary: χ²."""
    from rasd.train.answers import _BLOCK, _draw

    probs = torch.zeros(2 * _BLOCK)
    probs[[0, 5, _BLOCK - 1, _BLOCK, 2 * _BLOCK - 1]] = torch.tensor([0.1, 0.25, 0.15, 0.3, 0.2])
    drawn = _draw(probs[None].repeat(20000, 1), torch.Generator().manual_seed(3))
    counts = torch.bincount(drawn, minlength=2 * _BLOCK).double()
    cells = probs > 0
    assert counts[~cells].sum() == 0, "never an index without mass"
    expected = probs[cells].double() / probs[cells].double().sum() * counts.sum()
    assert chisquare(counts[cells].numpy(), expected.numpy()).pvalue > 1e-3


def test_several_sampled_answers_per_prompt_are_distinct_draws_and_reuse_the_first(tmp_path: Path) -> None:
    """`--samples 2`: every prompt answered twice with other seeds; draw 0 is the single draw's text, read from its
    cache; more than one greedy answer per prompt is refused (it would be the same text)."""
    from rasd.train.eagle_head import regenerated_data

    target = tiny_target(tmp_path, init=0.2)
    rows = [{"conversations": [{"from": "human", "value": f"tell me about glaciers and bridges, part {i} " * 3}]}
            for i in range(3)]
    one = regenerated_data(target, rows, 6, tmp_path / "cache", window=8, temperature=0.9, seed=1)
    files = set((tmp_path / "cache").glob("*.pt"))
    two = regenerated_data(target, rows, 6, tmp_path / "cache", window=8, temperature=0.9, seed=1, samples=2)
    assert len(two["tokens"]) == 2 * len(one["tokens"]) == 6
    assert two["tokens"][:3] == one["tokens"], "draw 0 is the single draw"
    assert files < set((tmp_path / "cache").glob("*.pt")), "the second draw is a chunk of its own"
    assert all(a[:8] == b[:8] and a != b for a, b in zip(two["tokens"][:3], two["tokens"][3:], strict=True))
    with pytest.raises(ValueError, match="--samples 2 needs --temperature"):
        regenerated_data(target, rows, 6, None, window=8, samples=2)
