"""`fast_forward.forward` computes exactly what the HF forward computes, for every call shape the engine makes."""

from __future__ import annotations

import pytest
import torch

from rasd.decoding.model import fast_forward
from rasd.decoding.model.kernels import fast_kernels, install
from rasd.decoding.proposers import make_proposer
from rasd.decoding.runtime.engine import SpeculativeDecoder
from rasd.decoding.step.cache import TreeCache, cache_kwargs
from rasd.decoding.step.tree import DraftTree
from rasd.decoding.step.verify import tree_inputs
from tests.helpers import hf_greedy, random_prompt, tiny_llama


def _qwen2(seed: int) -> torch.nn.Module:
    """A 2-layer random Qwen2 (biased q/k/v projections, unlike Llama)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256)
    model = Qwen2ForCausalLM(config).eval()
    for layer in model.model.layers:   # random init leaves biases at zero: make them matter
        torch.nn.init.normal_(layer.self_attn.q_proj.bias, std=0.5)
    return model


def _prefilled(model: torch.nn.Module, prompt: list[int]) -> TreeCache:
    cache = TreeCache.for_model(model)
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt]), use_cache=True, **cache_kwargs(model, cache))
    return cache


def _both(model: torch.nn.Module, prompt: list[int], ids: torch.Tensor, pos: torch.Tensor,
          mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, TreeCache, TreeCache]:
    """(HF logits, lean logits, HF's cache, lean's cache) for the same step on two identical caches."""
    hf_cache, lean_cache = _prefilled(model, prompt), _prefilled(model, prompt)
    with torch.inference_mode(), fast_kernels():
        ref = model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                    **cache_kwargs(model, hf_cache)).logits
        got = fast_forward.forward(model, lean_cache, ids, pos, mask)
    return ref, got, hf_cache, lean_cache


@pytest.mark.parametrize("make", [lambda: tiny_llama(0), lambda: _qwen2(1)], ids=["llama", "qwen2"])
def test_one_token_and_tree_steps_equal_hf_bit_for_bit(make, one_thread) -> None:
    model = install(make())
    assert fast_forward.supports(model)
    prompt = random_prompt(40, 3)
    past = len(prompt)
    # a plain step: one token, no mask
    ref, got, hf_cache, lean_cache = _both(model, prompt, torch.tensor([[7]]), torch.tensor([[past]]), None)
    assert torch.equal(ref, got)
    assert torch.equal(hf_cache.layers[1].keys, lean_cache.layers[1].keys)
    # a tree step: branching tree, explicit ancestor mask, positions by depth
    tree = DraftTree.root_only(7)
    a = tree.add(0, 11, "x")
    tree.add(0, 12, "x")
    tree.add(a, 13, "x")
    tree.add(a, 14, "x")
    ids, pos, mask = tree_inputs(tree, past, torch.float32, "cpu")
    ref, got, hf_cache, lean_cache = _both(model, prompt, ids, pos, mask)
    assert torch.equal(ref, got)
    assert torch.equal(hf_cache.layers[0].values, lean_cache.layers[0].values)


def test_unmasked_multi_token_step_is_causal(one_thread) -> None:
    """A catch-up forward of several new tokens with no mask (the draft's `_sync`) attends causally."""
    model = install(tiny_llama(0))
    prompt = random_prompt(30, 4)
    ids, pos = torch.tensor([[5, 6, 7, 8]]), torch.arange(30, 34)[None]
    ref, got, _, _ = _both(model, prompt, ids, pos, None)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)   # HF builds its causal mask another way
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    with torch.inference_mode(), fast_kernels():
        last = fast_forward.forward(model, _prefilled(model, prompt), ids, pos, last_only=True)
    assert last.shape == (1, 1, ref.shape[-1])
    torch.testing.assert_close(last[0, 0], ref[0, -1], rtol=1e-5, atol=1e-5)


def test_a_whole_prompt_runs_on_the_causal_kernel_like_hf(one_thread) -> None:
    """A prefill (empty cache, no mask) takes the causal kernel, as HF does: same logits and cache bit for bit
    (an explicit mask would compute the masked half of every product and sum in another order)."""
    from torch.profiler import ProfilerActivity, profile

    model = install(tiny_llama(0))
    prompt = random_prompt(40, 5)
    ids, pos = torch.tensor([prompt]), torch.arange(len(prompt))[None]
    hf_cache, lean_cache = TreeCache.for_model(model), TreeCache.for_model(model)
    with torch.inference_mode(), fast_kernels():
        ref = model(input_ids=ids, use_cache=True, **cache_kwargs(model, hf_cache)).logits
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            got = fast_forward.forward(model, lean_cache, ids, pos)
    assert torch.equal(ref, got)
    assert torch.equal(hf_cache.layers[1].keys, lean_cache.layers[1].keys)
    assert not any("masked_fill" in event.key for event in prof.key_averages()), "no mask was built"


def test_outside_fast_kernels_and_for_other_models_hf_runs(one_thread) -> None:
    """No bypass outside `fast_kernels()`, and none for eager attention (its numerics differ from sdpa)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = install(tiny_llama(0))
    prompt = random_prompt(20, 5)
    calls = []
    handle = model.register_forward_hook(lambda *_: calls.append(1))
    try:
        with torch.inference_mode():
            fast_forward.forward(model, _prefilled(model, prompt), torch.tensor([[3]]), torch.tensor([[20]]))
        assert calls == [1, 1]            # the prefill and the step both went through HF's module
        with torch.inference_mode(), fast_kernels():
            fast_forward.forward(model, _prefilled(model, prompt), torch.tensor([[3]]), torch.tensor([[20]]))
        assert calls == [1, 1, 1]         # only the prefill did
    finally:
        handle.remove()
    config = LlamaConfig(vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64, attn_implementation="eager")
    assert not fast_forward.supports(LlamaForCausalLM(config))


def test_final_norm_hook_still_fires(one_thread) -> None:
    """AdaEAGLE's LDLP reads the final-norm output through a forward hook: the lean path must keep it."""
    model = install(tiny_llama(0))
    cache = _prefilled(model, [1, 2, 3])
    seen = []
    handle = model.model.norm.register_forward_hook(lambda _m, _i, out: seen.append(out.shape))
    try:
        with torch.inference_mode(), fast_kernels():
            fast_forward.forward(model, cache, torch.tensor([[4]]), torch.tensor([[3]]))
    finally:
        handle.remove()
    assert seen == [torch.Size([1, 1, 64])]


def test_engine_on_lean_path_equals_hf_generate(one_thread) -> None:
    """End to end: plain and prompt-lookup decoding through the lean forward give HF greedy's tokens."""
    model = tiny_llama(2)
    for method in ("ar", "pld"):
        decoder = SpeculativeDecoder(model, make_proposer(method))
        for seed in range(3):
            prompt = random_prompt(24, seed) * 2
            assert decoder.generate(prompt, max_new_tokens=24).token_ids == hf_greedy(model, prompt, 24)


def test_a_step_with_a_prompt_chunk_stacked_on_it_gives_both_their_own_results(one_thread) -> None:
    """`forward_mixed`: the rows' tree logits as a batched step alone, the chunk's as a plain prefill."""
    from rasd.decoding.step.batch_decoder import BatchCache, batch_inputs

    model = install(tiny_llama(0))
    rows = [random_prompt(n, seed) for n, seed in ((20, 1), (13, 2))]
    prompt = random_prompt(30, 3)
    trees = [DraftTree.chain(5, [6, 7], "x"), DraftTree.chain(9, [10, 11], "x")]

    def batch_cache() -> BatchCache:
        cache = BatchCache.for_model(model, slots=2)
        for row in rows:
            cache.add_row(_prefilled(model, row))
        return cache

    with torch.inference_mode(), fast_kernels():
        alone, mixed = batch_cache(), batch_cache()
        ids, pos, mask = batch_inputs(trees, alone.row_lengths, alone.get_seq_length(), torch.float32, "cpu")
        ref_rows = fast_forward.forward(model, alone, ids, pos, mask)                         # [2, 3, vocab]
        ref_chunk = model(input_ids=torch.tensor([prompt])).logits[0, -1]
        chunk_cache = TreeCache.for_model(model)
        first = fast_forward.forward_mixed(model, mixed, ids, pos, mask, chunk_cache,
                                           torch.tensor([prompt[:18]]), False)
        mixed._sync_length()
        second = fast_forward.forward_mixed(model, mixed, ids, pos, mask, chunk_cache,
                                            torch.tensor([prompt[18:]]), True)
    assert first.shape == (6, ref_rows.shape[-1]) and second.shape == (7, ref_rows.shape[-1])
    torch.testing.assert_close(second[:6].view(2, 3, -1), ref_rows, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second[6], ref_chunk, rtol=1e-5, atol=1e-5)
    assert chunk_cache.get_seq_length() == len(prompt)


@pytest.mark.parametrize("make", [tiny_llama, _qwen2])
def test_stacked_projections_follow_their_parts_and_leave_the_model_as_it_was(make) -> None:
    """q/k/v and gate/up run as one product each in tree steps (`kernels.stack_products`): same results as the
    parts (Qwen2's biases too), no new module or key, no copy of the weights, and a part changed in place or
    replaced afterwards is what gets multiplied."""
    import copy

    from ray import cloudpickle  # how Ray ships objects to actors

    from rasd.decoding.model.kernels import QKV, prefill_products, projections

    model = getattr(make, "__wrapped__", make)(0)   # a fresh one: this test changes weights (`tiny_llama` is shared)
    keys = list(model.state_dict())
    install(model)
    assert list(model.state_dict()) == keys and not any("stack" in k for k in keys)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.q_proj.weight.untyped_storage().data_ptr()
    x = torch.randn(1, 5, model.config.hidden_size)

    def both(owner, names):
        with torch.inference_mode(), fast_kernels():
            fused = projections(owner, names, x)
        return fused, [torch.nn.functional.linear(x, getattr(owner, n).weight, getattr(owner, n).bias) for n in names]

    for owner, names in ((attn, QKV), (mlp, ("gate_proj", "up_proj"))):
        fused, parts = both(owner, names)
        assert [t.shape for t in fused] == [t.shape for t in parts]
        for a, b in zip(fused, parts, strict=True):
            torch.testing.assert_close(a, b)
    with torch.no_grad():
        attn.k_proj.weight.mul_(-2.0)                     # in place: the stacked weight is the same memory
    before = both(attn, QKV)
    torch.testing.assert_close(before[0][1], before[1][1])
    attn.v_proj.weight = torch.nn.Parameter(torch.randn_like(attn.v_proj.weight))   # replaced: parts again
    after = both(attn, QKV)
    assert torch.equal(after[0][2], after[1][2])
    with torch.inference_mode(), fast_kernels(), prefill_products():   # a prompt's forward never stacks
        assert all(torch.equal(a, b) for a, b in zip(projections(mlp, ("gate_proj", "up_proj"), x), both(mlp, (
            "gate_proj", "up_proj"))[1], strict=True))
    layer = model.model.layers[0]   # its parts are views of the stacked weights: they still pickle and copy
    restored = cloudpickle.loads(cloudpickle.dumps(layer))
    torch.testing.assert_close(copy.deepcopy(layer).self_attn.q_proj.weight, restored.self_attn.q_proj.weight)


def test_stacked_projections_leave_gradients_to_the_parts() -> None:
    """Training through the lean layer (fast kernels on, gradients on): each part gets its own gradient."""
    from rasd.decoding.model.kernels import QKV, projections

    model = install(tiny_llama(0))
    attn = model.model.layers[0].self_attn
    with fast_kernels():
        sum(t.sum() for t in projections(attn, QKV, torch.randn(1, 3, model.config.hidden_size))).backward()
    assert all(getattr(attn, n).weight.grad is not None for n in QKV)
