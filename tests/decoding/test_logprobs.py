"""Log-probabilities of the committed tokens: from the verification forward, equal to plain decoding's."""

from __future__ import annotations

import pytest
import torch

from rasd.decoding.proposers import make_proposer
from rasd.decoding.runtime.engine import SpeculativeDecoder, token_logprobs
from rasd.decoding.sizing.sizers import FixedSizer
from rasd.decoding.step.batch_decoder import BatchDecoder
from rasd.decoding.step.sampling import SamplingParams
from tests.helpers import random_prompt, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


def hf_logprobs(model: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """HF greedy tokens and the raw log-softmax [n, V] of each step's logits."""
    x = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float().log_softmax(-1)


def decoder(model: torch.nn.Module, method: str) -> SpeculativeDecoder:
    draft = model if method == "draft" else None
    options = {"top_k": 2, "width": 3, "min_prob": 0.0} if method == "draft" else {}
    return SpeculativeDecoder(model, make_proposer(method, draft, **options), sizer=FixedSizer(8))


@pytest.mark.parametrize("method", ["ar", "pld", "draft"])
def test_logprobs_equal_hf_generate(method: str) -> None:
    model = tiny_llama(0)
    head = random_prompt(30, 4)
    prompt = head + head[:12]
    tokens, ref = hf_logprobs(model, prompt, 24)
    stream = decoder(model, method).stream(prompt, 24, logprobs=3)
    for _ in stream:
        pass
    out = stream.output
    assert out.token_ids == tokens
    assert out.logprobs is not None and [t.token for t in out.logprobs] == tokens
    got = torch.tensor([t.logprob for t in out.logprobs])
    torch.testing.assert_close(got, ref[torch.arange(len(tokens)), tokens], atol=1e-4, rtol=0)
    for i, entry in enumerate(out.logprobs):
        top = ref[i].topk(3)
        assert [tok for tok, _ in entry.top] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([lp for _, lp in entry.top]), top.values, atol=1e-4, rtol=0)
    if method != "ar":
        assert out.stats.num_accepted_tokens > 0


def test_logprobs_in_a_batch_and_under_sampling_match_the_request_alone() -> None:
    model = tiny_llama(1)
    prompts = [random_prompt(20, 30) * 2, random_prompt(9, 31)]
    params = [SamplingParams(), SamplingParams(temperature=0.9, seed=5, frequency_penalty=0.5)]
    alone = []
    for prompt, p in zip(prompts, params, strict=True):
        stream = decoder(model, "pld").stream(prompt, 16, sampling=p, logprobs=2)
        list(stream)
        alone.append(stream.output.logprobs)
    batch = BatchDecoder(model, slots=2)
    streams = [decoder(model, "pld").stream(prompt, 16, sampling=p, logprobs=2)
               for prompt, p in zip(prompts, params, strict=True)]
    for stream in streams:
        batch.add(stream)
    for _ in range(100):
        if not len(batch):
            break
        batch.step()
    for stream, ref in zip(streams, alone, strict=True):
        assert [t.token for t in stream.output.logprobs] == [t.token for t in ref]
        torch.testing.assert_close(torch.tensor([t.logprob for t in stream.output.logprobs]),
                                   torch.tensor([t.logprob for t in ref]), atol=1e-4, rtol=0)


def test_no_logprobs_unless_asked_and_zero_alternatives() -> None:
    model = tiny_llama(2)
    assert decoder(model, "ar").generate(random_prompt(8, 1), 4).logprobs is None
    rows = token_logprobs(torch.randn(2, 16), [3, 4], 0)
    assert [r.top for r in rows] == [(), ()] and [r.token for r in rows] == [3, 4]
