"""Reduced precision is lossless by construction: in bf16 (and int8 / int4 weight-only) every tree node's logits
are the bits plain decoding computes for that token (`kernels.linear.row_exact`, `kernels.quantized`,
`model.exact_attention`), so every method, single and batched, gives exactly `ar`'s tokens in that dtype, with no
near-tie allowance.

Why no allowance: bf16 rounds every layer's output to 8 bits of mantissa, so a last-bit difference grows into
another token within a few dozen (measured before this: every method left `ar` after 14-75 tokens on Spec-Bench).
A tiny random model's logits are nearly flat, so near-ties are everywhere here: a test that would pass by luck
in fp32 fails at once in bf16 unless the computation is exact.
"""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path

import pytest
import torch

from rasd.decoding.model import exact_attention
from rasd.decoding.model.kernels import fast_kernels, install, quantized
from rasd.decoding.model.kernels.forms import onednn_bf16
from rasd.decoding.model.kernels.linear import GATE_UP, LINEARS, QKV, projections, quantize_model, row_exact
from rasd.decoding.proposers import METHODS, make_proposer
from rasd.decoding.runtime.engine import GenerationStream, SpeculativeDecoder
from rasd.decoding.sizing.sizers import FixedSizer
from rasd.decoding.step.batch_decoder import BatchDecoder
from rasd.decoding.step.cache import TreeCache
from rasd.decoding.step.tree import DraftTree
from rasd.decoding.step.verify import tree_forward
from tests.decoding.test_batch import add, drain, repeating
from tests.decoding.test_proposer_contract import inputs_for
from tests.helpers import random_prompt, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

# bf16 products are row-exact through oneDNN's bf16 kernels (one row padded to two); a CPU without them (AVX2
# only) multiplies bf16 by reference code that was never checked, and `auto` never picks bf16 there. The weight-
# only kinds (int8, int4) and the exact attention are checked on every CPU.
NEEDS_BF16_KERNELS = pytest.mark.skipif(not onednn_bf16(), reason="this CPU has no oneDNN bf16 kernels")
BF16 = pytest.param(None, id="bf16", marks=NEEDS_BF16_KERNELS)

NEW_TOKENS = 24
PROMPTS = [random_prompt(12, 3) * 2, random_prompt(30, 4)]


@cache
def bf16_llama(seed: int, bits: int | None = None) -> torch.nn.Module:
    """`tiny_llama(seed)` as bf16 (weight-only quantized to `bits`), its own object (the fp32 one is shared by
    other tests)."""
    with torch.inference_mode(False):
        model = copy.deepcopy(tiny_llama(seed)).to(torch.bfloat16)
    return model if bits is None else quantize_model(model, bits)


@pytest.mark.parametrize("kind", [pytest.param("bf16", marks=NEEDS_BF16_KERNELS),
                                  pytest.param("bf16-packed", marks=NEEDS_BF16_KERNELS), "int8", "int4"])
@pytest.mark.parametrize("shape", [(96, 64), (64, 160), (1536, 576), (576, 1536)])
def test_a_row_exact_product_gives_each_row_the_same_bits_at_every_row_count(shape: tuple[int, int],
                                                                              kind: str) -> None:
    gen = torch.Generator().manual_seed(0)
    module = torch.nn.Linear(shape[1], shape[0], bias=False)
    with torch.no_grad():
        module.weight.copy_(torch.randn(shape, generator=gen) * 0.05)
    module = module.bfloat16()
    x = torch.randn(96, shape[1], generator=gen).bfloat16()
    products = {
        "bf16": lambda rows: row_exact(rows, module.weight, None),
        "bf16-packed": lambda rows: row_exact(rows, module.weight, None, module),
        "int8": lambda rows: quantized.product(quantized.quantize_int8(module.weight), rows, None),
        "int4": lambda rows: quantized.product(quantized.quantize_int4(module.weight), rows, None),
    }
    if kind.startswith("int"):   # quantize once
        q = (quantized.quantize_int8 if kind == "int8" else quantized.quantize_int4)(module.weight)
        products[kind] = lambda rows: quantized.product(q, rows, None)
    run = products[kind]
    with torch.inference_mode():
        alone = torch.cat([run(x[r: r + 1]) for r in range(len(x))])
        for rows in (2, 3, 5, 8, 16, 33):
            together = torch.cat([run(x[r: r + rows]) for r in range(0, len(x), rows)])
            assert torch.equal(together, alone), f"{kind}: {rows} rows at a time differ from one at a time"


@NEEDS_BF16_KERNELS
def test_a_bf16_models_q_k_v_and_gate_up_run_as_one_product_with_the_parts_bits() -> None:
    model = bf16_llama(11)
    install(model)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn in LINEARS.stacks and mlp in LINEARS.stacks    # stacked: fewer calls per step
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.inference_mode(), fast_kernels(True):
        for owner, names in ((attn, QKV), (mlp, GATE_UP)):
            for rows in (x[:1], x):
                stacked = projections(owner, names, rows)
                apart = [getattr(owner, n).forward(rows) for n in names]
                assert all(torch.equal(a, b) for a, b in zip(stacked, apart, strict=True))


def test_exact_attention_plans_paths_from_the_tree_mask() -> None:
    tree = DraftTree(tokens=[5, 6, 7, 8], parents=[-1, 0, 0, 2], sources=["root", "a", "b", "b"], scores=[1.0] * 4)
    from rasd.decoding.step.verify import tree_inputs

    _, _, mask = tree_inputs(tree, 10, torch.bfloat16, "cpu")
    (row,) = exact_attention.plan(mask)
    assert (row.base, row.end) == (10, 14)
    # depth first: 0, 1 (in place), then 2 (to slot 11, over 1) and 3 (to slot 12, over 2's old slot)
    assert [(n.query, n.length, n.write) for n in row.nodes] == [(0, 11, None), (1, 12, None), (2, 12, 2),
                                                                (3, 13, 3)]
    from rasd.decoding.step.verify import batch_inputs

    _, _, mask = batch_inputs([tree, DraftTree.root_only(9)], [10, 7], 10, torch.bfloat16, "cpu")
    _, short = exact_attention.plan(mask)
    assert short.base == 7 and [n.query for n in short.nodes] == [0], "the shorter tree's padding is skipped"


@pytest.mark.parametrize("bits", [BF16, 4], ids=["bf16", "int4"])
@torch.inference_mode()
def test_every_node_of_a_branching_tree_gets_plain_decodings_bits(bits: int | None) -> None:
    model = install(bf16_llama(0, bits))
    prompt = random_prompt(40, 7)
    tree = DraftTree(tokens=[3, 11, 12, 13, 14, 15], parents=[-1, 0, 0, 1, 2, 4],
                     sources=["root"] + ["t"] * 5, scores=[1.0] * 6)

    def prefilled() -> TreeCache:
        from rasd.decoding.model import fast_forward

        cache = TreeCache.for_model(model)
        fast_forward.prefill(model, cache, torch.tensor([prompt]))
        return cache

    with fast_kernels(True):
        logits = tree_forward(model, prefilled(), tree)
        for node in range(len(tree)):
            path = [0, *tree.path_to(node)]   # the root first: it is the newest token, not yet in the cache
            cache = prefilled()
            for step in path:
                plain = tree_forward(model, cache, DraftTree.root_only(tree.tokens[step]))[0]
            assert torch.equal(logits[node], plain), f"node {node} differs from plain decoding of its path"


@pytest.mark.parametrize("bits", [BF16, 8, 4], ids=["bf16", "int8", "int4"])
@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_in_bf16_gives_exactly_ars_tokens(method: str, bits: int | None, tmp_path: Path) -> None:
    target = bf16_llama(0, bits)
    inputs = inputs_for(METHODS[method], target, tmp_path)
    if "draft_model" in inputs:
        inputs["draft_model"] = bf16_llama(1, bits)
    ours = [SpeculativeDecoder(target, make_proposer(method, **inputs), sizer=FixedSizer(16))
            .generate(p, NEW_TOKENS).token_ids for p in PROMPTS]
    ar = [SpeculativeDecoder(target, make_proposer("ar"), sizer=FixedSizer(16)).generate(p, NEW_TOKENS).token_ids
          for p in PROMPTS]
    assert ours == ar, f"{method} differs from ar in bf16"


@pytest.mark.parametrize("bits", [BF16, 4], ids=["bf16", "int4"])
def test_a_bf16_batch_gives_every_request_exactly_its_own_ar_tokens(bits: int | None) -> None:
    """Rows of different lengths (padded cache), a tree per row, chunked prefill riding along."""
    model = bf16_llama(0, bits)
    batch = BatchDecoder(model, chunk_tokens=8)
    requests = [("pld", 40, 0, 29), ("ar", 7, 1, 13), ("draft", 23, 2, 37), ("pld", 35, 3, 20)]
    blocks: dict[int, list[int]] = {}
    streams: list[GenerationStream] = []
    for method, length, seed, max_new in requests:
        draft = model if method == "draft" else None
        options = {"top_k": 2, "width": 3, "min_prob": 0.0} if method == "draft" else {}
        dec = SpeculativeDecoder(model, make_proposer(method, draft, **options), sizer=FixedSizer(8))
        add(batch, dec.stream(repeating(length, seed), max_new), blocks, streams)
    drain(batch, blocks, streams)
    for stream, (_, length, seed, max_new) in zip(streams, requests, strict=True):
        alone = SpeculativeDecoder(model, make_proposer("ar"), sizer=FixedSizer(8)).generate(
            repeating(length, seed), max_new).token_ids
        assert stream.output is not None and stream.output.token_ids == alone == blocks[id(stream)]


def test_int4_puts_a_q4_1_grid_back() -> None:
    """The embedded model's weights are GGUF Q4_1 (per 32: scale d, minimum m, w = d * q + m, q in 0..15):
    int4 with groups of 32 recovers every q, so the weights equal the originals up to rounding d and m to bf16."""
    gen = torch.Generator().manual_seed(1)
    d = (torch.rand(64, 4, 1, generator=gen) * 0.01 + 0.001).bfloat16().float()
    m = (-torch.rand(64, 4, 1, generator=gen) * 0.05).bfloat16().float()
    q = torch.randint(0, 16, (64, 4, 32), generator=gen)
    q[..., 0], q[..., 1] = 0, 15                       # Q4_1 blocks span their grid (min and max are on it)
    weight = (d * q + m).reshape(64, 128)
    packed = quantized.quantize_int4(weight)
    eye = torch.eye(128).bfloat16()
    with torch.inference_mode():
        back = quantized.product(packed, eye, None).float().t()   # [out, in]: the dequantized weights
    assert torch.allclose(back, weight, atol=2e-3, rtol=1e-2), float((back - weight).abs().max())


def test_quantized_weights_stay_close_to_the_originals() -> None:
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(96, 128, generator=gen) * 0.05
    x = torch.randn(16, 128, generator=gen)
    exact = x @ weight.t()
    with torch.inference_mode():
        for bits, tol in ((8, 0.02), (4, 0.12)):
            q = (quantized.quantize_int8 if bits == 8 else quantized.quantize_int4)(weight)
            got = quantized.product(q, x, None).float()
            rel = float((got - exact).norm() / exact.norm())
            assert rel < tol, f"int{bits}: relative error {rel:.3f}"


@pytest.mark.parametrize("bits", [BF16, 4], ids=["bf16", "int4"])
def test_a_prompt_gets_the_same_bits_after_a_prefix_hit_and_in_a_batchs_chunks(bits: int | None) -> None:
    """Prompts longer than the grid: one decoded alone; the same after another request left its prefix in the
    prefix cache (a hit of 129 tokens is cut to 128); and joining a running batch in chunks."""
    from rasd.decoding.runtime.prefix_cache import PrefixCache

    model = bf16_llama(0, bits)
    shared = random_prompt(145, 11)
    first, second = shared + random_prompt(20, 12), shared + random_prompt(25, 13)

    def alone(prompt: list[int]) -> list[int]:
        return SpeculativeDecoder(model, make_proposer("ar"), sizer=FixedSizer(8)).generate(prompt, 24).token_ids

    batch = BatchDecoder(model, chunk_tokens=8, prefix_cache=PrefixCache(64 << 20))
    blocks: dict[int, list[int]] = {}
    streams: list[GenerationStream] = []
    add(batch, SpeculativeDecoder(model, make_proposer("pld"), sizer=FixedSizer(8)).stream(first, 24), blocks,
        streams)
    add(batch, SpeculativeDecoder(model, make_proposer("pld"), sizer=FixedSizer(8)).stream(second, 24), blocks,
        streams)
    drain(batch, blocks, streams)
    later = SpeculativeDecoder(model, make_proposer("pld"), sizer=FixedSizer(8)).stream(second, 24)
    add(batch, later, blocks, streams)
    drain(batch, blocks, streams)
    assert later.output is not None and later.output.stats.cached_prompt_tokens == 128
    for stream, prompt in zip(streams, (first, second, second), strict=True):
        assert stream.output is not None and stream.output.token_ids == alone(prompt) == blocks[id(stream)]


@torch.inference_mode()
def test_a_prompt_prefilled_in_two_parts_holds_the_same_kv_bits_as_at_once() -> None:
    """The mechanism under the test above, bit for bit, on the embedded model in int4 (tiny random models give the
    same bits either way; this one did not before prompts ran on the grid: a 642-token prompt after a 624-token
    hit, as a service saw): its K/V and last logits prefilled at once equal those of its first 624 tokens then
    the rest."""
    import pydoc_data.topics

    from rasd.decoding.model import fast_forward
    from rasd.decoding.model.loading import load_model

    loaded = load_model("default", dtype="int4")
    model = install(loaded.model)
    text = " ".join(list(pydoc_data.topics.topics.values())[:3])
    prompt = torch.tensor([loaded.tokenizer(text)["input_ids"][:642]])
    with fast_kernels(True):
        whole, parts = TreeCache.for_model(model), TreeCache.for_model(model)
        at_once = fast_forward.prefill(model, whole, prompt)
        fast_forward.prefill(model, parts, prompt[:, :624])
        in_two = fast_forward.prefill(model, parts, prompt[:, 624:])
    assert torch.equal(at_once, in_two)
    for a, b in zip(whole.layers, parts.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 2, 16)], ids=["smollm2", "tiny"])
def test_the_attention_rule_gives_a_node_plain_decodings_bits_in_a_call_with_others(
        heads: tuple[int, int, int], threads: int) -> None:
    """Chains of 12 nodes after contexts on both sides of `GRID` cells and the kernel's 512-key blocks: each node
    run with its chain (one group, a call per cell) equals it run as a plain step at its own length."""
    from rasd.decoding.step.verify import tree_inputs

    h, h_kv, d = heads
    gen = torch.Generator().manual_seed(3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for past in (5, 60, 64, 100, 505, 511, 512, 1500):
            width = 12
            span = -(-(past + width) // exact_attention.GRID) * exact_attention.GRID
            keys, values = (torch.randn(1, h_kv, span, d, generator=gen) for _ in range(2))
            query = torch.randn(1, h, width, d, generator=gen)
            _, _, mask = tree_inputs(DraftTree.chain(1, list(range(2, width + 1)), "t"), past, torch.float32, "cpu")
            (chain,) = plans = exact_attention.plan(mask)
            assert len(chain.groups) == 1 and len(chain.groups[0].calls) == len({-(-n.length // 64)
                                                                                for n in chain.nodes})
            together = exact_attention.attend(query, keys, values, plans, None)
            for j in range(width):
                alone = exact_attention.attend(query[:, :, j: j + 1], keys, values,
                                               exact_attention.plain(1, past + j), None)
                assert torch.equal(alone[:, :, 0], together[:, :, j]), f"past {past}, node {j}"
    finally:
        torch.set_num_threads(before)


def test_a_branch_starts_a_new_group_and_a_chain_is_one() -> None:
    from rasd.decoding.step.verify import tree_inputs

    tree = DraftTree(tokens=[5, 6, 7, 8, 9], parents=[-1, 0, 1, 0, 3], sources=["root"] + ["t"] * 4,
                     scores=[1.0] * 5)
    _, _, mask = tree_inputs(tree, 62, torch.bfloat16, "cpu")
    (row,) = exact_attention.plan(mask)
    # 0, 1, 2 lie in place (one group; lengths 63 | 64, 65: two cells); 3 overwrites 1's slot, 4 overwrites 2's
    assert [[n.query for n in g.writes] for g in row.groups] == [[], [3, 4]]
    assert [[c.queries[: c.kept].tolist() for c in g.calls] for g in row.groups] == [[[0, 1], [2]], [[3], [4]]]
    assert all(len(c.queries) >= exact_attention.MIN_QUERIES for g in row.groups for c in g.calls)
