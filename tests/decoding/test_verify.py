"""Tree verification: mask, position ids, tree logits == sequential logits, KV compaction, greedy acceptance."""

from __future__ import annotations

import json

import pytest
import torch

from rasd.decoding.model.kernels import choices, fast_kernels, install
from rasd.decoding.step.cache import GrowableLayer, TreeCache, cache_kwargs
from rasd.decoding.step.sampling import GREEDY
from rasd.decoding.step.tree import DraftTree
from rasd.decoding.step.verify import Verdict, accept_greedy, tree_forward, tree_inputs, verify
from tests.helpers import random_prompt, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-5


def full_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of a plain, uncached forward (the sequential reference)."""
    with torch.inference_mode():
        return model(torch.tensor([ids], dtype=torch.long)).logits[0].float()


def prefilled(model: torch.nn.Module, context: list[int]) -> TreeCache:
    cache = TreeCache.for_model(model)
    with torch.inference_mode():
        model(input_ids=torch.tensor([context]), use_cache=True, **cache_kwargs(model, cache))
    assert cache.get_seq_length() == len(context)
    return cache


def branching_tree(root: int) -> DraftTree:
    """root ─ a(1) ─ c(3)          node indices in brackets; the second branch is deeper
             └ b(2) ─ d(4) ─ e(5)
                    └ f(6)"""
    tree = DraftTree.root_only(root)
    tree.add(0, 5, "x")    # 1
    tree.add(0, 9, "x")    # 2
    tree.add(1, 17, "x")   # 3
    tree.add(2, 5, "x")    # 4  (same token as node 1, other parent)
    tree.add(4, 33, "x")   # 5
    tree.add(2, 41, "x")   # 6
    return tree


def test_tree_inputs_mask_and_positions() -> None:
    tree = branching_tree(3)
    past = 11
    ids, pos, mask = tree_inputs(tree, past, torch.float32, "cpu")
    T = len(tree)
    assert ids.shape == (1, T) and ids[0].tolist() == tree.tokens
    assert pos.shape == (1, T) and pos[0].tolist() == [past + d for d in tree.depths()]
    assert pos[0].tolist() == [11, 12, 12, 13, 13, 14, 13]
    assert mask.shape == (1, 1, T, past + T) and mask.dtype == torch.float32
    visible = mask[0, 0] == 0
    neg = torch.finfo(torch.float32).min
    assert torch.all((mask[0, 0] == 0) | (mask[0, 0] == neg))
    assert visible[:, :past].all(), "every node sees the whole committed context"
    assert torch.equal(visible[:, past:], tree.ancestor_mask())
    # half precision masks use that dtype's minimum
    _, _, mask16 = tree_inputs(tree, past, torch.bfloat16, "cpu")
    assert mask16.dtype == torch.bfloat16 and float(mask16.min()) == torch.finfo(torch.bfloat16).min


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("context_len", [1, 9, 300])
def test_chain_tree_equals_sequential_logits(fast: bool, context_len: int) -> None:
    """context_len 300 also crosses the cache's initial 256-slot capacity (buffer growth)."""
    model = install(tiny_llama(0))
    context = random_prompt(context_len, seed=context_len)
    chain = [7, 7, 50, 3, 91, 0]
    root = 42
    cache = prefilled(model, context)
    with fast_kernels(fast):
        logits = tree_forward(model, cache, DraftTree.chain(root, chain, "x"))
    assert logits.shape == (len(chain) + 1, model.config.vocab_size) and logits.dtype == torch.float32
    ref = full_logits(model, context + [root] + chain)[context_len:]
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
    assert cache.get_seq_length() == context_len + len(chain) + 1


@pytest.mark.parametrize("fast", [False, True])
def test_branching_tree_gives_each_paths_sequential_logits(fast: bool) -> None:
    model = install(tiny_llama(1))
    context = random_prompt(23, seed=1)
    tree = branching_tree(root=8)
    cache = prefilled(model, context)
    with fast_kernels(fast):
        logits = tree_forward(model, cache, tree)
    for node in range(len(tree)):
        path = [tree.tokens[0]] + [tree.tokens[i] for i in tree.path_to(node)]
        ref = full_logits(model, context + path)[-1]
        torch.testing.assert_close(logits[node], ref, atol=ATOL, rtol=0, msg=f"node {node}")


def next_logits_after_keep(model: torch.nn.Module, context: list[int], tree: DraftTree, kept: list[int],
                           next_token: int) -> tuple[torch.Tensor, TreeCache]:
    cache = prefilled(model, context)
    with torch.inference_mode():   # the engine runs its whole loop in inference mode
        tree_forward(model, cache, tree)
        cache.keep(len(context), kept)
    assert cache.get_seq_length() == len(context) + len(kept)
    pos = torch.tensor([[cache.get_seq_length()]])
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([[next_token]]), position_ids=pos, use_cache=True,
                    **cache_kwargs(model, cache))
    return out.logits[0, -1].float(), cache


@pytest.mark.parametrize("kept", [[0, 2, 4, 5], [0, 2, 6], [0, 1, 3], [0, 1], [0]])
def test_kv_compaction_then_decode_equals_recompute(kept: list[int]) -> None:
    """Keep a path (non-prefix ones move entries), decode one more token: same as recomputing from scratch."""
    model = tiny_llama(2)
    context = random_prompt(17, seed=2)
    tree = branching_tree(root=60)
    logits, cache = next_logits_after_keep(model, context, tree, kept, next_token=77)
    ref = full_logits(model, context + [tree.tokens[i] for i in kept] + [77])[-1]
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
    assert cache.get_seq_length() == len(context) + len(kept) + 1


def test_compaction_of_second_branch_differs_from_truncation() -> None:
    """Guard against a vacuous KV test: keeping the wrong entries must change the next logits."""
    model = tiny_llama(2)
    context = random_prompt(17, seed=2)
    tree = branching_tree(root=60)
    cache = prefilled(model, context)
    tree_forward(model, cache, tree)
    cache.crop(-(cache.get_seq_length() - len(context) - 4))   # naive truncation to nodes 0..3
    with torch.inference_mode():
        wrong = model(input_ids=torch.tensor([[77]]), position_ids=torch.tensor([[len(context) + 4]]),
                      use_cache=True, **cache_kwargs(model, cache)).logits[0, -1]
    ref = full_logits(model, context + [tree.tokens[i] for i in [0, 2, 4, 5]] + [77])[-1]
    assert (wrong - ref).abs().max() > 1e-3


def test_growable_layer_crop_rejects_positive_counts() -> None:
    layer = GrowableLayer()
    layer.lazy_initialization(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    layer.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))
    assert layer.get_seq_length() == 3
    with pytest.raises(ValueError):
        layer.crop(1)
    layer.crop(-2)
    assert layer.get_seq_length() == 1 and layer.keys.shape == (1, 2, 1, 4)


def test_verify_greedy_accepts_the_models_own_path_and_compacts() -> None:
    """Put the model's greedy continuation on the *second* branch: verify accepts it, the cache matches."""
    with torch.inference_mode():   # as in the engine
        _check_verify_second_branch()


def test_verify_outside_inference_mode() -> None:
    """verify() is usable on its own (e.g. from an actor), not only inside the engine's inference mode:
    compaction of a non-prefix path must not fail on inference tensors (a bug found by this test)."""
    _check_verify_second_branch()


def _check_verify_second_branch() -> None:
    model = tiny_llama(3)
    context = random_prompt(12, seed=3)
    full = list(context)
    with torch.inference_mode():
        for _ in range(6):
            full.append(int(full_logits(model, full)[-1].argmax()))
    root, greedy = full[len(context)], full[len(context) + 1:]
    wrong = (greedy[0] + 1) % model.config.vocab_size
    tree = DraftTree.root_only(root)
    tree.add(0, wrong, "x")                                  # 1: a wrong first sibling
    tree.add_path(0, greedy[:3], "y")                       # 2, 3, 4: the right path
    tree.add(2, (greedy[1] + 1) % model.config.vocab_size, "x")   # 5: a wrong sibling deeper
    cache = prefilled(model, context)
    verdict, logits = verify(model, cache, tree, GREEDY, None)
    assert verdict.accepted == [2, 3, 4]
    assert verdict.bonus == greedy[3]
    assert verdict.new_tokens(tree) == greedy[:4]
    assert logits.shape == (len(tree), model.config.vocab_size)
    assert cache.get_seq_length() == len(context) + 4
    with torch.inference_mode():
        nxt = model(input_ids=torch.tensor([[greedy[3]]]), position_ids=torch.tensor([[len(context) + 4]]),
                    use_cache=True, **cache_kwargs(model, cache)).logits[0, -1]
    assert int(nxt.argmax()) == greedy[4]
    torch.testing.assert_close(nxt.float(), full_logits(model, full[:len(context) + 5])[-1], atol=ATOL, rtol=0)


def hand_logits(argmaxes: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), vocab)
    for row, tok in enumerate(argmaxes):
        logits[row, tok] = 5.0
        logits[row, (tok + 1) % vocab] = 4.0
    return logits


def greedy_tree() -> DraftTree:
    """root(0) ─ 3(1)
               └ 5(2) ─ 7(3)
                      └ 8(4) ─ 1(5)"""
    tree = DraftTree.root_only(0)
    tree.add(0, 3, "a")
    tree.add(0, 5, "b")
    tree.add(2, 7, "a")
    tree.add(2, 8, "b")
    tree.add(4, 1, "a")
    return tree


@pytest.mark.parametrize(("argmaxes", "accepted", "bonus"), [
    ([5, 0, 8, 0, 1, 9], [2, 4, 5], 9),    # the whole second branch, then the bonus
    ([5, 0, 8, 0, 2, 9], [2, 4], 2),       # stops where the model disagrees
    ([5, 0, 7, 6, 1, 9], [2, 3], 6),       # other child of node 2
    ([6, 0, 8, 0, 1, 9], [], 6),           # no child matches: bonus only
    ([3, 4, 8, 0, 1, 9], [1], 4),          # first child, which is a leaf
])
def test_accept_greedy_hand_made(argmaxes: list[int], accepted: list[int], bonus: int) -> None:
    tree = greedy_tree()
    verdict = accept_greedy(tree, hand_logits(argmaxes))
    assert verdict == Verdict(accepted=accepted, bonus=bonus)
    assert verdict.new_tokens(tree) == [tree.tokens[i] for i in accepted] + [bonus]


def test_accept_greedy_root_only() -> None:
    assert accept_greedy(DraftTree.root_only(4), hand_logits([2])) == Verdict(accepted=[], bonus=2)


def test_fast_tree_forward_stays_on_the_flash_attention_kernel() -> None:
    """A strided query or a repeated-kv copy sends CPU sdpa to its math path (2x a plain step on SmolLM2)."""
    from torch.profiler import ProfilerActivity, profile

    model = install(tiny_llama(1))
    cache = prefilled(model, random_prompt(40, seed=3))
    with fast_kernels(), profile(activities=[ProfilerActivity.CPU]) as prof:
        tree_forward(model, cache, branching_tree(root=8))
    ops = {event.key for event in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops
    assert "aten::_scaled_dot_product_attention_math" not in ops


def test_grouped_tree_attention_serves_only_the_models_that_opted_in(monkeypatch) -> None:
    """HF's attention of an installed model keeps the kv heads grouped in a masked CPU step inside `fast_kernels()`;
    a model that was never installed keeps HF's stock sdpa there, though the function slot is process-wide."""
    from rasd.decoding.model.kernels import attention
    from tests.helpers import fresh_tiny_llama

    stock, stock_calls = attention._STOCK_SDPA, []

    def counting(module, *args, **kwargs):  # noqa: ANN001, ANN202
        stock_calls.append(module)
        return stock(module, *args, **kwargs)

    monkeypatch.setattr(attention, "_STOCK_SDPA", counting)
    models = {"opted in": install(fresh_tiny_llama(0)), "not": fresh_tiny_llama(0)}
    prompt = random_prompt(12, seed=5)
    tree = branching_tree(root=prompt[-1])
    logits, calls = {}, {}
    for name, model in models.items():
        cache = prefilled(model, prompt[:-1])
        ids, pos, mask = tree_inputs(tree, cache.get_seq_length(), torch.float32, "cpu")
        stock_calls.clear()
        with torch.inference_mode(), fast_kernels():
            logits[name] = model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                                 **cache_kwargs(model, cache)).logits[0]
        calls[name] = len(stock_calls)
    assert calls == {"opted in": 0, "not": len(models["not"].model.layers)}
    torch.testing.assert_close(logits["opted in"], logits["not"], rtol=1e-5, atol=1e-5)


def test_fast_linear_returns_row_major_outputs() -> None:
    layer = install(torch.nn.Sequential(torch.nn.Linear(16, 8)))[0]
    x = torch.randn(1, 5, 16)
    with fast_kernels():
        out = layer(x)
    assert out.is_contiguous()
    torch.testing.assert_close(out, torch.nn.functional.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("form", ["packed", "onednn"])
def test_a_weight_made_in_inference_mode_is_packed_and_multiplied(form: str, monkeypatch) -> None:
    """Inference tensors keep no version counter: packing one (a model built under `torch.inference_mode`, or
    its q/k/v stacked there on a first `install` inside a cost-curve measurement) raised a RuntimeError."""
    from rasd.decoding.model import kernels

    if not (kernels.packing_available() if form == "packed" else kernels.onednn_available()):
        pytest.skip(f"this torch has no {form} GEMM")
    monkeypatch.setenv("RASD_LINEAR", form)              # read once per shape; this shape is this test's own
    inputs = {"packed": 26, "onednn": 27}[form]
    with torch.inference_mode():
        layer = install(torch.nn.Sequential(torch.nn.Linear(inputs, 40)))[0]
        assert layer.weight.is_inference()
        x = torch.randn(1, 5, inputs)
        with fast_kernels():
            out = layer(x)
    assert kernels.linear_choices()[f"40x{inputs}@8"] == form
    torch.testing.assert_close(out, torch.nn.functional.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("form", ["packed", "onednn"])
def test_packed_products_follow_weight_changes_and_leave_the_model_picklable(form: str, monkeypatch) -> None:
    """MKL's and oneDNN's packed forms: a stale packed copy after a weight update, or an unpicklable model, are
    bugs."""
    import copy

    from ray import cloudpickle  # how Ray ships objects to actors

    from rasd.decoding.model import kernels

    if not (kernels.packing_available() if form == "packed" else kernels.onednn_available()):
        pytest.skip(f"this torch has no {form} GEMM")
    monkeypatch.setenv("RASD_LINEAR", form)              # read once per shape; this shape is this test's own
    inputs = {"packed": 24, "onednn": 25}[form]
    layer = install(torch.nn.Sequential(torch.nn.Linear(inputs, 40)))[0]
    assert kernels.linear_choices()[f"40x{inputs}@8"] == form
    x = torch.randn(1, 5, inputs)
    with torch.inference_mode(), fast_kernels():
        before = layer(x)
    torch.testing.assert_close(before, torch.nn.functional.linear(x, layer.weight, layer.bias))
    with torch.no_grad():
        layer.weight.mul_(-2.0)                           # in place: same storage, new version
    with torch.inference_mode(), fast_kernels():
        after = layer(x)
    torch.testing.assert_close(after, torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert not torch.allclose(after, before)
    with fast_kernels():                                  # training: the packed copy has no gradient, F.linear does
        layer(x).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0
    restored = cloudpickle.loads(cloudpickle.dumps(layer))
    torch.testing.assert_close(copy.deepcopy(layer).weight, restored.weight)


@pytest.mark.parametrize("form", ["stock", "transposed", "packed", "padded", "onednn"])
def test_every_forced_form_computes_the_product_for_one_row_and_several(form: str, monkeypatch) -> None:
    """A plain step (one row) is tuned like the trees: each form gives F.linear's product (to float
    rounding), and the padded form, which exists for one and three rows, never serves other counts."""
    from rasd.decoding.model import kernels

    if form == "packed" and not kernels.packing_available():
        pytest.skip("this torch has no MKL packed GEMM")
    if form == "onednn" and not kernels.onednn_available():
        pytest.skip("this torch has no oneDNN linear")
    monkeypatch.setenv("RASD_LINEAR", form)
    out_features = {"stock": 41, "transposed": 42, "packed": 43, "padded": 44, "onednn": 48}[form]   # shapes of its own
    layer = install(torch.nn.Sequential(torch.nn.Linear(24, out_features)))[0]
    for rows in (1, 3, 5):
        x = torch.randn(1, rows, 24)
        with torch.inference_mode(), fast_kernels():
            out = layer(x)
        assert out.shape == (1, rows, out_features) and out.is_contiguous()
        torch.testing.assert_close(out, torch.nn.functional.linear(x, layer.weight, layer.bias))
    choices = kernels.linear_choices()
    assert choices[f"{out_features}x24@1"] == form
    assert choices[f"{out_features}x24@3"] == form
    assert choices[f"{out_features}x24@8"] == ("transposed" if form == "padded" else form)


def test_layer_products_are_timed_in_passes_over_the_whole_model() -> None:
    """Each pass runs one form over every module in model order (as a decoding step reads the weights, each
    once and cold), and a shape's time is its modules' sum, the least over the rounds."""
    from rasd.decoding.model import kernels

    modules = [torch.nn.Linear(24, 40), torch.nn.Linear(40, 24), torch.nn.Linear(24, 40)]
    inputs = {24: torch.zeros(1, 24), 40: torch.zeros(1, 40)}
    now, calls = [0.0], []

    def form(name: str, cost: float):  # noqa: ANN202
        def run(module: torch.nn.Linear, x: torch.Tensor) -> None:
            calls.append((name, modules.index(module)))
            now[0] += cost * (3.0 if len(calls) <= 3 else 1.0)     # the very first pass is slow (cold start)
        return run

    best = kernels.pass_times(modules, inputs, {"stock": form("stock", 2.0), "padded": form("padded", 1.0)},
                              rounds=2, clock=lambda: now[0])
    assert calls[:3] == [("stock", 0), ("stock", 1), ("stock", 2)] and calls[3:6] == [("padded", 0), ("padded", 1),
                                                                                      ("padded", 2)]
    assert calls[6][0] == "padded"                                  # the second round starts with another form
    assert best[(40, 24)] == {"stock": 4.0, "padded": 2.0} and best[(24, 40)] == {"stock": 2.0, "padded": 1.0}


def test_a_weight_no_linear_owns_is_tuned_at_install_and_gives_f_linears_product() -> None:
    """An EAGLE head's rows of the LM head are multiplied outside an nn.Linear (`kernels.product`): `install` times
    their forms up front (none mid-decoding), and every form gives F.linear's product, for one row or several."""
    from rasd.decoding.model import kernels

    class WithBareWeight(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(24, 24)
            self.rows = torch.randn(39, 24)

        def bare_weights(self) -> list[torch.Tensor]:
            return [self.rows]

    model = install(WithBareWeight())
    assert {"39x24@1 head", "39x24@2 head", "39x24@64 head"} <= set(kernels.linear_choices())
    for x in (torch.randn(24), torch.randn(1, 24), torch.randn(3, 24), torch.randn(2, 5, 24)):
        with torch.inference_mode(), fast_kernels():
            out = kernels.product(x, model.rows)
        torch.testing.assert_close(out, torch.nn.functional.linear(x, model.rows))


def test_half_precision_products_serve_only_a_model_that_allows_them(monkeypatch) -> None:
    """`HALF` (a draft head's products from fp16 weights): forced, it serves a model whose `approximate_products`
    is true, to fp16 rounding, and follows its weight's updates; the target's modules never take it, even forced;
    and outside inference (training) the approximate model's products keep their gradients."""
    from rasd.decoding.model import kernels

    class Head(torch.nn.Module):
        approximate_products = True

        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(24, 45)
            self.rows = torch.randn(46, 24)

        def bare_weights(self) -> list[torch.Tensor]:
            return [self.rows]

    monkeypatch.setenv("RASD_LINEAR", "half")
    head = install(Head())
    target = install(torch.nn.Sequential(torch.nn.Linear(24, 47)))[0]
    x = torch.randn(1, 3, 24)
    with torch.inference_mode(), fast_kernels():
        out, rows_out, exact = head.proj(x), kernels.product(x, head.rows, approximate=True), target(x)
    half = torch.nn.functional.linear(x.half(), head.proj.weight.half()).float() + head.proj.bias
    torch.testing.assert_close(out, half)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, head.proj.weight, head.proj.bias),
                               atol=2e-2, rtol=2e-2)
    assert not torch.equal(out, torch.nn.functional.linear(x, head.proj.weight, head.proj.bias))
    torch.testing.assert_close(rows_out, torch.nn.functional.linear(x.half(), head.rows.half()).float())
    assert torch.equal(exact, torch.nn.functional.linear(x, target.weight, target.bias))
    choices = kernels.linear_choices()
    assert choices["45x24@3 approximate"] == "half" and choices["46x24@3 head approximate"] == "half"
    assert choices["47x24@3"] == "stock"
    with torch.no_grad():
        head.proj.weight.mul_(-1.0)                        # in place: the half copy must follow
    with torch.inference_mode(), fast_kernels():
        flipped = head.proj(x)
    torch.testing.assert_close(flipped, torch.nn.functional.linear(x.half(), head.proj.weight.half()).float()
                               + head.proj.bias)
    with fast_kernels():
        loss = head.proj(x).sum()
    loss.backward()
    assert head.proj.weight.grad is not None and head.proj.weight.grad.abs().sum() > 0


def test_an_eagle_head_allows_half_products_and_its_target_does_not() -> None:
    """The flag sits on the head alone: its modules are its own, the target's layers (a self-draft's too) stay
    exact. The target is installed first, as the engine and the service do: the head's layer is then a deep copy
    of an installed layer, and must still get the flag."""
    from rasd.decoding.model.eagle_head import EagleHead
    from rasd.decoding.model.kernels.linear import LINEARS
    from tests.helpers import fresh_tiny_llama

    target = install(fresh_tiny_llama(0))
    head = install(EagleHead(target))
    assert all(LINEARS.approximate(m) for m in head.modules() if isinstance(m, torch.nn.Linear))
    install(target)
    assert not any(LINEARS.approximate(m) for m in target.modules())


def test_measured_forms_are_kept_for_the_machine_and_a_second_process_times_nothing(tmp_path, monkeypatch) -> None:
    """Each process that loads a model used to time every shape again (≈ 9 s); the next one now reads them."""
    from tests.helpers import fresh_tiny_llama

    monkeypatch.setenv("RASD_HOME", str(tmp_path))
    monkeypatch.setenv("RASD_LINEAR", "auto")
    monkeypatch.setattr(choices, "ACTIVE", choices.KernelChoices())   # a new process: nothing in memory
    # a machine as busy at both loads: a real probe on a noisy CI host can read the first tuning as busy and
    # rightly time it again (that rule has its own test below), which is not what this test is about
    monkeypatch.setattr(choices, "machine_probe", lambda: 0.001)
    install(fresh_tiny_llama(0))
    measured = dict(choices.ACTIVE.choices)
    saved = json.loads(choices.choices_file().read_text())
    assert measured and len(saved) == len(measured) and choices.choices_file().parent == tmp_path / "kernels"

    def no_timing(*args, **kwargs):
        raise AssertionError("timed again")

    # a new process: nothing in memory, the machine's file on disk
    monkeypatch.setattr(choices, "ACTIVE", choices.KernelChoices())   # a new process: nothing in memory
    monkeypatch.setattr(choices, "pass_times", no_timing)
    monkeypatch.setattr(choices, "time_forms", no_timing)
    install(fresh_tiny_llama(0))
    assert choices.ACTIVE.choices == measured
    # a corrupt file is never trusted: measured again and rewritten
    choices.choices_file().write_text("{not json")
    monkeypatch.undo()
    monkeypatch.setenv("RASD_HOME", str(tmp_path))
    monkeypatch.setattr(choices, "ACTIVE", choices.KernelChoices())   # a new process: nothing in memory
    install(fresh_tiny_llama(0))
    assert len(json.loads(choices.choices_file().read_text())) == len(measured)
    # a forced form is not a measurement: never written for the next process
    monkeypatch.setenv("RASD_LINEAR", "stock")
    install(torch.nn.Sequential(torch.nn.Linear(24, 45)))
    monkeypatch.setenv("RASD_LINEAR", "auto")
    install(torch.nn.Sequential(torch.nn.Linear(24, 46)))
    shapes = {tuple(key[:2]) for key, _, _ in json.loads(choices.choices_file().read_text())}
    assert (46, 24) in shapes and (45, 24) not in shapes


def test_forms_measured_on_a_busy_machine_are_measured_again(tmp_path, monkeypatch) -> None:
    """Forms tuned while another process held the cores (a training job) were kept for the machine for ever:
    a 4-token verification stayed 7% dearer than with the forms a quiet machine picks. Each form now carries the
    machine probe of its measurement, and one whose probe ran clearly slower than the probe now is re-timed."""
    from tests.helpers import fresh_tiny_llama

    monkeypatch.setenv("RASD_HOME", str(tmp_path))
    monkeypatch.setenv("RASD_LINEAR", "auto")
    monkeypatch.setattr(choices, "ACTIVE", choices.KernelChoices())   # a new process: nothing in memory
    monkeypatch.setattr(choices, "machine_probe", lambda: 0.004)   # tuned while busy: 4 ms
    install(fresh_tiny_llama(0))
    rows = json.loads(choices.choices_file().read_text())
    assert rows and all(probe == 0.004 for _, _, probe in rows)
    measured = len(rows)

    timed: list[int] = []
    real_pass_times = choices.pass_times

    def counting(*args, **kwargs):
        timed.append(1)
        return real_pass_times(*args, **kwargs)

    monkeypatch.setattr(choices, "ACTIVE", choices.KernelChoices())   # a new process on the same machine...
    monkeypatch.setattr(choices, "pass_times", counting)
    monkeypatch.setattr(choices, "machine_probe", lambda: 0.0035)   # ... a little quieter: trusted
    install(fresh_tiny_llama(0))
    assert not timed and len(choices.ACTIVE.choices) == measured

    monkeypatch.setattr(choices, "ACTIVE", choices.KernelChoices())   # a new process: nothing in memory
    monkeypatch.setattr(choices, "machine_probe", lambda: 0.001)    # ... quiet: everything is timed again
    install(fresh_tiny_llama(0))
    rows = json.loads(choices.choices_file().read_text())
    assert timed and len(rows) == measured and all(probe == 0.001 for _, _, probe in rows)


def test_a_choices_file_of_an_older_layout_is_not_trusted(tmp_path, monkeypatch) -> None:
    """Rows without the probe (or malformed) are measured again rather than read."""

    monkeypatch.setenv("RASD_HOME", str(tmp_path))
    monkeypatch.setenv("RASD_LINEAR", "auto")
    monkeypatch.setattr(choices, "ACTIVE", choices.KernelChoices())   # a new process: nothing in memory
    choices.choices_file().parent.mkdir(parents=True, exist_ok=True)
    choices.choices_file().write_text(json.dumps([[[8, 4, 1, "float32", 2, False, False], "packed"],
                                                   [[8, 4, 2, "float32", 2, False, False], "nonsense", 0.001],
                                                   [[8, 4, 3, "float32", 2, False, False], "stock", 0.001]]))
    monkeypatch.setattr(choices, "machine_probe", lambda: 0.001)
    choices.ACTIVE.load()
    assert list(choices.ACTIVE.choices.values()) == ["stock"] and list(choices.ACTIVE.choices)[0][2] == 3


def test_one_form_for_every_shape_where_a_whole_pass_of_it_beats_the_per_shape_mix(monkeypatch) -> None:
    """A form's speed depends on its neighbours: the per-shape choice is kept only when no uniform pass is 3%
    faster than the mix as a whole."""

    chosen = {(8, 4): "packed", (4, 8): "stock"}
    forms = {"stock": None, "packed": None}

    def fake(totals):
        def pass_times(modules, inputs, forms, before_pass=None):   # per shape, per form: half the total each
            return {shape: {name: totals[name] / 2 for name in forms} for shape in chosen}
        return pass_times

    monkeypatch.setattr(choices, "pass_times", fake({"mixed": 24.2, "stock": 28.4, "packed": 22.1}))
    assert choices.uniform_if_faster([], {}, forms, chosen) == {(8, 4): "packed", (4, 8): "packed"}
    monkeypatch.setattr(choices, "pass_times", fake({"mixed": 22.5, "stock": 28.4, "packed": 22.1}))
    assert choices.uniform_if_faster([], {}, forms, chosen) == chosen   # within 3%: the mix stays
    monkeypatch.setattr(choices, "pass_times", fake({"mixed": 20.0, "stock": 28.4, "packed": 22.1}))
    assert choices.uniform_if_faster([], {}, forms, chosen) == chosen
    uniform = {(8, 4): "stock", (4, 8): "stock"}
    assert choices.uniform_if_faster([], {}, forms, uniform) is uniform   # nothing to compare: no passes
