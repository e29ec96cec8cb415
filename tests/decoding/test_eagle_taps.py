"""A fused EAGLE-3 head (target layers tapped beside the final features) in decoding: the features every
forward path hands it equal a teacher forward's, greedy output equals HF's, and its file round-trips.

Each test builds its own tiny target (`fresh_tiny_llama`): a tap with layers stays on the model it was
installed on, and the cached shared target must keep handing plain heads their final features alone.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch

from rasd.decoding.model.eagle_head import EagleHead, head_taps, load_head, save_head
from rasd.decoding.model.features import shared_tap
from rasd.decoding.model.static_step import StepConfig
from rasd.decoding.proposers import make_proposer
from rasd.decoding.runtime.engine import SpeculativeDecoder
from rasd.decoding.sizing.sizers import FixedSizer
from rasd.decoding.step.batch_decoder import BatchDecoder
from rasd.index.suffix_array import SuffixArray
from rasd.train.eagle_head import extract_features, train_head
from tests.decoding.test_eagle import own_text
from tests.helpers import assert_greedy_equal, fresh_tiny_llama, hf_greedy, random_prompt

pytestmark = pytest.mark.usefixtures("one_thread")

TAPS = (0,)


@cache
def fused_head_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """The weights of a fused head trained for a few seconds on the tiny target's own text (tapped layer 0)."""
    target = fresh_tiny_llama(seed)
    seqs = own_text(target, 64)
    data = extract_features(target, [s.tolist() for s in seqs], None, batch=16, shard=64, taps=TAPS)
    torch.manual_seed(seed)
    head = EagleHead(target, taps=TAPS)
    train_head(head, data["tokens"], data["feats"], 250, batch=8, lr=3e-3, progress=False)
    return {k: v.detach().clone() for k, v in head.state_dict().items()}


def fused_head(target: torch.nn.Module) -> EagleHead:
    """The trained fused head, sharing `target`'s embedding and LM head."""
    head = EagleHead(target, taps=TAPS)
    head.load_state_dict(fused_head_state())
    return head.eval()


def teacher_features(target: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """[n, 2H]: tapped layer 0 and the final features of every position, from one HF forward."""
    return extract_features(target, [tokens], None, batch=1, shard=1, taps=TAPS)["feats"][0].float()


def check_fed(proposer: object, target: torch.nn.Module, context: list[int]) -> None:
    """What the head was handed equals the teacher forward's features of the same positions."""
    feats = proposer.feats
    assert feats is not None and feats.shape[-1] == 2 * target.config.hidden_size
    start = proposer.feat_start
    want = teacher_features(target, context)[start: start + len(feats)]
    torch.testing.assert_close(feats[: len(want)].float(), want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("step", [None, StepConfig(static=True)], ids=["dynamic", "static"])
def test_the_fused_head_is_fed_the_tapped_layers_and_decodes_like_hf(step: StepConfig | None) -> None:
    target = fresh_tiny_llama(0)
    head = fused_head(target)
    decoder = SpeculativeDecoder(target, make_proposer("eagle", head=head, min_prob=0.0), sizer=FixedSizer(16),
                                 step=step)
    accepted = []
    for length in (7, 40):
        prompt = random_prompt(length, length)
        out = decoder.generate(prompt, max_new_tokens=29)
        assert_greedy_equal(target, prompt, out.token_ids, hf_greedy(target, prompt, 29), f"fused eagle {length}")
        check_fed(decoder.proposer, target, prompt + out.token_ids)
        accepted.append(out.stats.mean_accepted_tokens)
    assert max(accepted) > 1.5, f"the trained fused head's drafts get accepted ({accepted})"


def test_the_fused_head_in_a_batch_with_chunked_prefill_is_fed_the_tapped_layers() -> None:
    target = fresh_tiny_llama(0)
    head = fused_head(target)
    batch = BatchDecoder(target, chunk_tokens=8, slots=4)
    prompts = [random_prompt(n, 60 + n) for n in (5, 30, 44)]
    decoders = [SpeculativeDecoder(target, make_proposer("eagle", head=head, min_prob=0.0), sizer=FixedSizer(16))
                for _ in prompts]
    streams = [d.stream(p, 20) for d, p in zip(decoders, prompts, strict=True)]
    outs: dict[int, list[int]] = {i: list(batch.add(streams[i]) or []) for i in range(len(streams))}
    for _ in range(400):
        for stream, block in batch.step():
            outs[streams.index(stream)] += block
        if len(batch) == 0:
            break
    for i, prompt in enumerate(prompts):
        assert_greedy_equal(target, prompt, outs[i], hf_greedy(target, prompt, 20), f"batched fused eagle {i}")
        check_fed(decoders[i].proposer, target, prompt + outs[i])
    assert sum(s.stats.num_accepted_tokens for s in streams) > 0


def test_rasd_with_a_fused_head_equals_hf() -> None:
    target = fresh_tiny_llama(0)
    store = SuffixArray.from_documents([random_prompt(60, 50 + i) for i in range(4)])
    draft = make_proposer("eagle", head=fused_head(target), min_prob=0.0)
    proposer = make_proposer("rasd", datastores=[store], draft_proposer=draft)
    assert proposer.feature_layers == TAPS
    decoder = SpeculativeDecoder(target, proposer, sizer=FixedSizer(16))
    for length in (7, 40):
        prompt = random_prompt(length, length + 1)
        out = decoder.generate(prompt, max_new_tokens=29)
        assert_greedy_equal(target, prompt, out.token_ids, hf_greedy(target, prompt, 29), "rasd + fused head")
    assert out.stats.accepted_by_source.get("eagle", 0) > 0


def test_a_fused_head_file_round_trips_and_a_layer_the_target_lacks_is_refused(tmp_path: Path) -> None:
    target = fresh_tiny_llama(0)
    head = fused_head(target)
    path = tmp_path / "fused.safetensors"
    save_head(path, head, {"note": "test"})
    assert head_taps(path) == TAPS
    loaded = load_head(target, path)
    assert loaded.taps == TAPS
    feats, ids = torch.randn(1, 5, 2 * target.config.hidden_size), torch.tensor([[1, 2, 3, 4, 5]])
    pos = torch.arange(5)[None]
    with torch.no_grad():   # saved in fp16: the same head up to half precision
        torch.testing.assert_close(loaded(feats, ids, pos), head(feats, ids, pos), rtol=2e-2, atol=2e-2)
    far = EagleHead(target, taps=(1,))
    far.taps = (7,)   # as a head trained for a deeper model would say
    save_head(tmp_path / "far.safetensors", far)
    with pytest.raises(ValueError, match=r"reads target layers \(7,\); this model has layers 0..1"):
        load_head(target, tmp_path / "far.safetensors")


def test_one_target_feeds_one_set_of_tapped_layers_and_a_plain_head_reads_the_final_part() -> None:
    target = fresh_tiny_llama(0)
    tap = shared_tap(target)
    assert shared_tap(target, TAPS) is tap and tap.layers == TAPS, "a plain tap grows the layers a head asks for"
    with pytest.raises(ValueError, match="one set of tapped layers"):
        shared_tap(target, (1,))
    with pytest.raises(ValueError, match="decoder layers are 0..1"):
        shared_tap(fresh_tiny_llama(0), (2,))
    torch.manual_seed(1)
    plain = EagleHead(target).eval()
    hidden = target.config.hidden_size
    wide, ids, pos = torch.randn(1, 4, 2 * hidden), torch.tensor([[3, 4, 5, 6]]), torch.arange(4)[None]
    with torch.no_grad():
        torch.testing.assert_close(plain(wide, ids, pos), plain(wide[..., hidden:], ids, pos))
    tap.remove()
