"""The static-shape verification path (`static_step`), run uncaptured on the CPU as CI can.

On CUDA the same step is captured as CUDA graphs (`tests/gpu/`, run on a machine with CUDA); here it must give
the dynamic path's logits, HF `generate`'s greedy tokens for every method, single and batched with rows
joining and leaving, and acceptance that bucket padding never changes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rasd.decoding.model import static_step
from rasd.decoding.model.static_step import StaticRows, StepConfig, bucket, shared_rows
from rasd.decoding.proposers import RecyclingMatrix, make_proposer
from rasd.decoding.runtime.engine import GenerationStream, SpeculativeDecoder
from rasd.decoding.sizing.cost import CURVE_VERSION, curve_key, measure_curve
from rasd.decoding.sizing.sizers import FixedSizer
from rasd.decoding.step.batch_decoder import BatchCache, BatchDecoder
from rasd.decoding.step.cache import TreeCache, cache_kwargs
from rasd.decoding.step.sampling import GREEDY, SamplingParams
from rasd.decoding.step.tree import DraftTree
from rasd.decoding.step.verify import accept, batch_inputs, tree_forward, verify
from rasd.index.suffix_array import SuffixArray
from tests.helpers import TINY_VOCAB, assert_greedy_equal, hf_greedy, random_prompt, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

STATIC = StepConfig(static=True)
OTHER_DRAFT_SEED = 99


def prefilled(model: torch.nn.Module, prompt: list[int]) -> TreeCache:
    cache = TreeCache.for_model(model)
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt]), use_cache=True, **cache_kwargs(model, cache))
    return cache


def branchy_tree(root: int, seed: int, size: int) -> DraftTree:
    """A random tree of `size` nodes: every node hangs under a random earlier node, siblings distinct."""
    gen = torch.Generator().manual_seed(seed)
    tree = DraftTree.root_only(root)
    while len(tree) < size:
        parent = int(torch.randint(0, len(tree), (1,), generator=gen))
        token = int(torch.randint(0, TINY_VOCAB, (1,), generator=gen))
        if tree.child_with_token(parent, token) is None:
            tree.add(parent, token, "probe")
    return tree


def test_buckets_and_config() -> None:
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 9, 64, 65)] == [1, 2, 4, 4, 8, 16, 64, 128]
    assert StepConfig.for_device("cpu") == StepConfig(static=False, graphs=False)
    assert StepConfig.for_device("cuda:0") == StepConfig(static=True, graphs=True)
    assert StepConfig.for_device("cuda", graphs=False) == StepConfig(static=False, graphs=False)
    assert StepConfig(static=True).label == "static" and StepConfig().label == "dynamic"
    model = tiny_llama(0)
    assert STATIC.applies(model) and not StepConfig().applies(model)


@pytest.mark.parametrize("size", [1, 2, 3, 6, 9, 17])
def test_static_logits_equal_the_dynamic_forward(size: int) -> None:
    """Same tree on the same context: the static step (padded to its bucket) gives the dynamic logits."""
    model = tiny_llama(0)
    prompt = random_prompt(37, 1)
    tree = branchy_tree(prompt[-1], size, size)
    dynamic = tree_forward(model, prefilled(model, prompt[:-1]), tree)              # [T, vocab]
    rows = StaticRows(model, 1)
    rows.add_row(prefilled(model, prompt[:-1]))
    static = rows.forward([tree])[0]
    assert static.shape == dynamic.shape
    torch.testing.assert_close(static, dynamic, rtol=1e-4, atol=1e-4)
    assert static.argmax(-1).tolist() == dynamic.argmax(-1).tolist()
    assert accept(tree, static, GREEDY, None) == accept(tree, dynamic, GREEDY, None)


def test_batched_static_step_equals_the_batch_cache() -> None:
    """Rows of different lengths and tree sizes (3 rows padded to a bucket of 4): the BatchCache's logits."""
    model = tiny_llama(1)
    prompts = [random_prompt(n, 10 + n) for n in (5, 41, 18)]
    trees = [branchy_tree(p[-1], i, n) for i, (p, n) in enumerate(zip(prompts, (7, 2, 12), strict=True))]
    batch, rows = BatchCache.for_model(model, 3), StaticRows(model, 3)
    for prompt in prompts:
        batch.add_row(prefilled(model, prompt[:-1]))
        rows.add_row(prefilled(model, prompt[:-1]))
    ids, pos, mask = batch_inputs(trees, batch.row_lengths, batch.get_seq_length(), torch.float32, "cpu")
    with torch.inference_mode():
        out = model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                    **cache_kwargs(model, batch))
    static = rows.forward(trees)
    for b, tree in enumerate(trees):
        torch.testing.assert_close(static[b, : len(tree)], out.logits[b, : len(tree)].float(), rtol=1e-4,
                                   atol=1e-4)
    assert torch.isfinite(static).all()


def test_padding_never_changes_acceptance() -> None:
    """A tree verified alone (its own bucket) and beside a wider tree (padded further): same verdict, and
    compaction keeps exactly the accepted path, so the next step sees the same context."""
    model = tiny_llama(2)
    prompt = random_prompt(30, 3)
    ref = hf_greedy(model, prompt, 6)
    tree = DraftTree.chain(prompt[-1], ref[:3] + [5], "probe")       # 3 right tokens, then a wrong one
    tree.add(0, (ref[0] + 1) % TINY_VOCAB, "probe")                   # a wrong sibling
    wide = branchy_tree(prompt[-1], 7, 30)
    verdicts = []
    for trees in ([tree], [tree, wide], [wide, tree]):
        rows = StaticRows(model, len(trees))
        for _ in trees:
            rows.add_row(prefilled(model, prompt[:-1]))
        start = rows.get_seq_length()
        logits = rows.forward(trees)
        b = trees.index(tree)
        verdict = accept(tree, logits[b, : len(tree)], GREEDY, None)
        verdicts.append(verdict)
        rows.keep_rows(start, [[0, *accept(t, logits[i, : len(t)], GREEDY, None).accepted]
                               for i, t in enumerate(trees)])
        nxt = rows.forward([DraftTree.root_only(verdict.bonus) for _ in trees])[b, 0]
        assert int(nxt.argmax()) == ref[4], "the compacted cache continues the greedy sequence"
    assert verdicts[0].accepted == [1, 2, 3] and verdicts[0].bonus == ref[3]
    assert verdicts[0] == verdicts[1] == verdicts[2]


def decoder(model: torch.nn.Module, method: str, step: StepConfig | None = STATIC, **options: Any
            ) -> SpeculativeDecoder:
    """One decoder per method; `draft-other` drafts with an unrelated random model (most drafts rejected)."""
    draft = {"draft": model, "optree": model, "draft-other": tiny_llama(OTHER_DRAFT_SEED)}.get(method)
    name = "draft" if method == "draft-other" else method
    extra: dict[str, Any] = {
        "draft": {"top_k": 2, "width": 4, "min_prob": 0.0}, "draft-other": {"top_k": 2, "width": 4, "min_prob": 0.0},
        "optree": {"delta": 0.0, "max_depth": 4}, "recycling": {"recycling": RecyclingMatrix(TINY_VOCAB)},
        "retrieval": {"datastores": [STORE]}, "rasd": {"datastores": [STORE]}}.get(method, {})
    datastores = extra.pop("datastores", None)
    return SpeculativeDecoder(model, make_proposer(name, draft, datastores=datastores, **extra, **options),
                              sizer=FixedSizer(12), step=step)


STORE = SuffixArray.from_documents([random_prompt(60, 50 + i) for i in range(4)])
ALL = ["ar", "pld", "draft", "draft-other", "optree", "recycling", "retrieval", "rasd"]


def repeating(length: int, seed: int) -> list[int]:
    head = random_prompt(length - 10, seed)
    return head + head[:10]


@pytest.mark.parametrize("method", ALL)
def test_single_request_static_greedy_equals_hf(method: str) -> None:
    model = tiny_llama(0)
    for seed, length in ((0, 25), (1, 12)):
        prompt = repeating(length, seed)
        out = decoder(model, method).generate(prompt, 29)
        assert_greedy_equal(model, prompt, out.token_ids, hf_greedy(model, prompt, 29), label=method)
        assert out.stats.steps == len(out.stats.accept_lengths)
        if method in ("draft", "pld"):
            assert out.stats.mean_accepted_tokens > 1.0, "speculation happens on the static path"


def test_static_and_dynamic_paths_give_the_same_tokens_and_the_store_is_reused() -> None:
    model = tiny_llama(1)
    prompt = repeating(30, 4)
    dynamic = decoder(model, "draft", step=StepConfig()).generate(prompt, 24).token_ids
    static_decoder = decoder(model, "draft")
    assert static_decoder.generate(prompt, 24).token_ids == dynamic
    kept = shared_rows(model, 1, graphs=False)
    assert kept.rows == 0 and not kept.in_use, "a finished request leaves the kept store empty and free"
    assert static_decoder.generate(prompt, 24).token_ids == dynamic


def test_an_abandoned_stream_frees_the_store() -> None:
    model = tiny_llama(2)
    stream = decoder(model, "pld").stream(repeating(20, 1), 40)
    next(stream), next(stream)
    assert static_step._SHARED[model][1].in_use, "the running request holds the kept store"
    assert shared_rows(model, 1, graphs=False) is not static_step._SHARED[model][1], "a second one is fresh"
    stream.close()
    kept = shared_rows(model, 1, graphs=False)
    assert not kept.in_use and kept.rows == 0


def test_seeded_sampling_on_the_static_path_equals_the_dynamic_path() -> None:
    """Same logits, same acceptance code, same generator: the same sampled tokens (exactness follows from
    the dynamic path's statistical tests)."""
    model = tiny_llama(0)
    prompt = repeating(28, 6)
    for seed in (1, 2, 3):
        params = SamplingParams(temperature=0.8, top_p=0.9, seed=seed)
        outs = [decoder(model, "pld", step=step).generate(prompt, 25, sampling=params).token_ids
                for step in (StepConfig(), STATIC)]
        assert outs[0] == outs[1]


def test_one_request_verify_compacts_like_the_dynamic_verify() -> None:
    model = tiny_llama(3)
    prompt = random_prompt(20, 9)
    tree = branchy_tree(prompt[-1], 3, 10)
    cache = prefilled(model, prompt[:-1])
    rows = StaticRows(model, 1)
    rows.add_row(prefilled(model, prompt[:-1]))
    verdict_d, _ = verify(model, cache, tree, GREEDY, None)
    verdict_s, _ = rows.verify(tree, GREEDY, None)
    assert verdict_d == verdict_s
    assert rows.row_lengths == [cache.get_seq_length()]
    kept = cache.layers[0].keys[0]
    torch.testing.assert_close(rows.kv[0, 0, 0, :, : rows.row_lengths[0]], kept, rtol=1e-5, atol=1e-5)


REQUESTS = [("pld", 40, 0, 29), ("ar", 17, 1, 13), ("draft", 23, 2, 37), ("rasd", 31, 3, 20)]


def drain(batch: BatchDecoder, blocks: dict[int, list[int]], max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if not len(batch):
            return
        for stream, block in batch.step():
            blocks[id(stream)] += block
    raise AssertionError("the batch did not finish")


def test_batched_static_greedy_equals_hf_with_rows_joining_and_leaving() -> None:
    model = tiny_llama(0)
    batch = BatchDecoder(model, slots=3, step=STATIC)      # 3 slots: a 4th row makes the store grow
    assert batch.static
    blocks: dict[int, list[int]] = {}
    streams: list[GenerationStream] = []

    def add(method: str, length: int, seed: int, max_new: int) -> GenerationStream:
        stream = decoder(model, method).stream(repeating(length, seed), max_new)
        streams.append(stream)
        blocks[id(stream)] = batch.add(stream) or []
        return stream

    add(*REQUESTS[0]), add(*REQUESTS[1])
    for _ in range(4):
        for stream, block in batch.step():
            blocks[id(stream)] += block
    cancelled = add("pld", 35, 7, 40)
    add(*REQUESTS[2])
    for _ in range(3):
        for stream, block in batch.step():
            blocks[id(stream)] += block
    batch.remove(cancelled)
    add(*REQUESTS[3])
    add("recycling", 90, 8, 25)     # the longest context joins late: the store grows, graphs would be dropped
    drain(batch, blocks)
    assert batch.cache.capacity >= 90
    for stream in streams:
        if stream is cancelled:
            continue
        out = stream.output
        assert out is not None and blocks[id(stream)] == out.token_ids
        ref = hf_greedy(model, stream.prompt_ids, stream.checker.max_new)
        assert_greedy_equal(model, stream.prompt_ids, out.token_ids, ref, label=stream.decoder.method)
    batch.clear()
    assert batch.cache.rows == 0


def test_cost_curve_of_the_static_path_has_its_own_key() -> None:
    model = tiny_llama(0)
    assert curve_key(model, "tiny", "cpu", "float32", 256, STATIC).endswith(f"-static-v{CURVE_VERSION}")
    assert "-static" not in curve_key(model, "tiny", "cpu", "float32", 256, StepConfig())
    curve = measure_curve(model, 64, sizes=(1, 4, 16), repeats=1, progress=False, step=STATIC)
    assert curve.sizes == [1, 4, 16] and all(t > 0 for t in curve.latency_s)
