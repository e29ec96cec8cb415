"""The three K/V row stores (`TreeCache`, `BatchCache`, `StaticRows`) implement the `RowStore` API with the same
signatures, and behave the same on one scenario: a prefilled row, a step's tree appended at the shared end, an
accepted path that is not a prefix of the tree kept, a second step cropped back to its root."""

from __future__ import annotations

import inspect

import pytest
import torch

from rasd.decoding.model import fast_forward
from rasd.decoding.model.static_step import StaticRows
from rasd.decoding.step.batch_decoder import BatchCache
from rasd.decoding.step.cache import TreeCache, cache_kwargs
from rasd.decoding.step.row_store import RowStore, SlotStore
from rasd.decoding.step.tree import DraftTree
from rasd.decoding.step.verify import batch_inputs, tree_forward
from tests.helpers import random_prompt, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

STORES = (TreeCache, BatchCache, StaticRows)
SLOTTED = (BatchCache, StaticRows)


def _members(protocol: type) -> list[str]:
    return [name for name in protocol.__dict__ if not name.startswith("_") and name != "row_lengths"]


@pytest.mark.parametrize("store", STORES, ids=lambda c: c.__name__)
def test_every_store_declares_and_conforms_to_the_row_store_signatures(store: type) -> None:
    assert RowStore in store.__mro__, "declared, not only shaped alike"
    protocols = (RowStore, SlotStore) if store in SLOTTED else (RowStore,)
    for protocol in protocols:
        for name in _members(protocol):
            ours, theirs = inspect.getattr_static(store, name), inspect.getattr_static(protocol, name)
            if isinstance(theirs, property):
                assert isinstance(ours, property) and ours is not theirs, f"{store.__name__}.{name}: no property"
                continue
            assert ours is not theirs, f"{store.__name__}.{name} is only the protocol's stub"
            required = list(inspect.signature(theirs).parameters)
            params = list(inspect.signature(ours).parameters.values())
            assert [p.name for p in params[: len(required)]] == required, f"{store.__name__}.{name}"
            assert all(p.default is not p.empty for p in params[len(required):]), f"{store.__name__}.{name}: extra"
    assert (SlotStore in store.__mro__) == (store in SLOTTED)


def _prefilled(model: torch.nn.Module, prompt: list[int]) -> TreeCache:
    cache = TreeCache.for_model(model)
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt]), use_cache=True, **cache_kwargs(model, cache))
    return cache


def _store(kind: type, model: torch.nn.Module, prompt: list[int]) -> RowStore:
    """`kind` holding `prompt` as its one row."""
    if kind is TreeCache:
        return _prefilled(model, prompt)
    store = BatchCache.for_model(model) if kind is BatchCache else StaticRows(model, 1)
    assert store.add_row(_prefilled(model, prompt)) == 0
    return store


@torch.inference_mode()
def _step(model: torch.nn.Module, store: RowStore, tree: DraftTree) -> torch.Tensor:
    """Each store's own verification forward of one row's tree: logits [T, vocab]."""
    if isinstance(store, StaticRows):
        return store.forward([tree])[0, : len(tree)]
    if isinstance(store, BatchCache):
        param = next(model.parameters())
        ids, pos, mask = batch_inputs([tree], store.row_lengths, store.get_seq_length(), param.dtype, param.device)
        return fast_forward.forward(model, store, ids, pos, mask)[0].float()
    return tree_forward(model, store, tree)


@torch.inference_mode()   # as the decoders run it: keep_rows edits the inference tensors a step wrote
def _scenario(model: torch.nn.Module, kind: type, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """The shared scenario on one store: its end after each operation, and the last step's logits."""
    store = _store(kind, model, prompt[:-1])   # the cache holds the context but its last token: the root
    ends = [store.rows, store.get_seq_length()]
    tree = DraftTree.root_only(prompt[-1])
    for parent, token in ((0, 5), (0, 7), (2, 9), (3, 11)):      # root -> 5, root -> 7 -> 9 -> 11
        tree.add(parent, token, "probe")
    start = store.get_seq_length()
    _step(model, store, tree)                                     # the tree appended at the shared end
    store.keep_rows(start, [[0, 2, 3]])                           # root, 7, 9: not a prefix of the nodes
    ends.append(store.get_seq_length())
    chain = DraftTree.root_only(11)
    chain.add(0, 13, "probe")
    start = store.get_seq_length()
    _step(model, store, chain)
    store.keep_rows(start, [[0]])                                 # rejected: the step cropped to its root
    ends.append(store.get_seq_length())
    return ends, _step(model, store, DraftTree.root_only(13))


def test_the_stores_behave_the_same_on_one_scenario() -> None:
    model = tiny_llama(0)
    prompt = random_prompt(20, seed=4)
    results = {kind.__name__: _scenario(model, kind, prompt) for kind in STORES}
    ends, reference = results["TreeCache"]
    assert ends == [1, 19, 22, 23]
    # the sequential reference: the prompt, then the kept path 7, 9, then 11 (cropped step's root), then 13
    expected = _prefilled(model, [*prompt, 7, 9, 11])
    with torch.inference_mode():
        sequential = model(input_ids=torch.tensor([[13]]), use_cache=True,
                           **cache_kwargs(model, expected)).logits[0].float()
    torch.testing.assert_close(reference, sequential, rtol=1e-4, atol=1e-4)
    for name, (their_ends, logits) in results.items():
        assert their_ends == ends, name
        torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4, msg=name)


