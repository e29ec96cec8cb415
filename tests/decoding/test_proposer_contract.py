"""Every registered method honours the proposer contract (as SGLang checks each speculative plug-in).

For each `MethodSpec` in the registry, the proposer is built on tiny random models from what the spec declares
it needs (a draft model, the index, the recycling matrix, a response history, the EAGLE head, the EESD exit
layer, an LDLP), and checked: it subclasses `ProposerBase`, every optional hook keeps the base's signature and
type, and a short greedy decode through it gives `ar`'s tokens. A new method is covered by registering it.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

from rasd.decoding.drafting.history import ResponseHistory
from rasd.decoding.proposers import METHODS, MethodSpec, Proposer, ProposerBase, RecyclingMatrix, make_proposer
from rasd.decoding.proposers.base import OPTIONAL_HOOKS
from rasd.decoding.proposers.early_exit import make_adaeagle, make_eesd
from rasd.decoding.proposers.options import GatedOptions
from rasd.decoding.proposers.rasd import RasdConfig
from rasd.decoding.proposers.registry import HEAD, HEAD_BY_DEFAULT, NO_DRAFT, SELF_DRAFT
from rasd.decoding.runtime.engine import SpeculativeDecoder
from rasd.decoding.sizing.sizers import FixedSizer
from rasd.index.suffix_array import SuffixArray
from tests.helpers import TINY_VOCAB, random_prompt, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [random_prompt(12, 3) * 2, random_prompt(30, 4)]   # one that repeats itself (copying sources match)
NEW_TOKENS = 24


def inputs_for(spec: MethodSpec, target: torch.nn.Module, tmp_path: Path) -> dict[str, Any]:
    """`make_proposer`'s arguments for a method, from what its spec says it needs."""
    from tests.decoding.test_eesd import exit_file

    inputs: dict[str, Any] = {}
    if spec.draft not in (NO_DRAFT, HEAD, SELF_DRAFT, HEAD_BY_DEFAULT):   # a separate draft model (or optional)
        inputs["draft_model"] = tiny_llama(1)
    if spec.uses_index:
        inputs["datastores"] = [SuffixArray.from_documents([PROMPTS[0][4:] + random_prompt(20, 5)])]
    if spec.uses_recycling:
        inputs["recycling"] = RecyclingMatrix(TINY_VOCAB)
    if spec.uses_history:
        inputs["history"] = ResponseHistory()
    if spec.draft in (HEAD, HEAD_BY_DEFAULT, SELF_DRAFT):   # drafts with the target's own layers or head
        inputs["target_model"] = target
    if spec.draft in (HEAD, HEAD_BY_DEFAULT):
        inputs["head"] = head_for(target)
    if spec.draft in (SELF_DRAFT, HEAD_BY_DEFAULT):
        inputs["eesd"] = exit_file(tmp_path, target)
    if spec.needs_ldlp:
        inputs["ldlp"] = ldlp_for(target, inputs["head"], tmp_path)
    return inputs


def head_for(target: torch.nn.Module) -> Any:
    from rasd.decoding.model.eagle_head import EagleHead

    torch.manual_seed(0)
    return EagleHead(target).eval()


def ldlp_for(target: torch.nn.Module, drafter: Any, tmp_path: Path) -> Path:
    from rasd.train.ldlp import train_ldlp

    prompts = torch.stack([torch.tensor(random_prompt(8, i)) for i in range(8)])
    model, _ = train_ldlp(target, drafter, prompts, k_max=4, gen_tokens=8, steps=5, batch=16)
    path = tmp_path / "ldlp.safetensors"
    model.save(path)
    return path


def decode(target: torch.nn.Module, proposer: ProposerBase) -> list[list[int]]:
    decoder = SpeculativeDecoder(target, proposer, sizer=FixedSizer(16))
    return [decoder.generate(p, NEW_TOKENS).token_ids for p in PROMPTS]


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_keeps_the_proposer_contract(method: str, tmp_path: Path) -> None:
    target = tiny_llama(0)
    proposer = make_proposer(method, **inputs_for(METHODS[method], target, tmp_path))
    assert isinstance(proposer, ProposerBase) and isinstance(proposer, Proposer), type(proposer)
    for hook in OPTIONAL_HOOKS:
        base = getattr(ProposerBase, hook)
        if callable(base):
            mine = getattr(type(proposer), hook)
            assert list(inspect.signature(mine).parameters) == list(inspect.signature(base).parameters), \
                f"{method}: {hook}{inspect.signature(mine)} differs from {hook}{inspect.signature(base)}"
    assert proposer.model is None or isinstance(proposer.model, torch.nn.Module)
    assert isinstance(proposer.wants_hidden, bool)
    assert all(isinstance(layer, int) for layer in tuple(proposer.feature_layers))
    assert proposer.history is None or isinstance(proposer.history, ResponseHistory)
    assert decode(target, proposer) == decode(target, make_proposer("ar")), f"{method} differs from ar"


def test_the_base_hooks_do_nothing_and_draft_nothing() -> None:
    """A proposer that overrides nothing is plain decoding: the defaults are safe for any caller."""
    base = ProposerBase()
    base.use_sizer(FixedSizer(4))
    base.set_datastores(None)
    base.scope([[1, 2]])
    base.finish()
    assert base.gate_open([1, 2]) and base.root_probs([1, 2]) is None
    assert base.propose([5, 6], 8).num_draft_tokens == 0
    target = tiny_llama(0)
    assert decode(target, base) == decode(target, make_proposer("ar"))


# Variant options that `build_decoder` or a method's `configure` consumes (the rest reach the proposer).
DECODER_KEYS = {f.name for f in dataclasses.fields(GatedOptions)} | {"single_node", "history", "head", "eagle",
                                                                      "eesd", "ldlp", "drafter"}


BUILT_BY = {"eesd": make_eesd, "adaeagle": make_adaeagle}   # proposers a function builds, with its own defaults


@pytest.mark.parametrize("method", list(METHODS))
def test_every_variant_option_is_a_real_knob_with_the_proposers_default(method: str, tmp_path: Path) -> None:
    """Each option a variant may set reaches the proposer (no TypeError) and declares the default it really has:
    the options class is not a second, drifting list of the proposer's parameters."""
    target = tiny_llama(0)
    spec = METHODS[method]
    options = {k: v for k, v in spec.defaults().items() if k not in DECODER_KEYS}
    proposer = make_proposer(method, **inputs_for(spec, target, tmp_path), **options)
    declared = real_defaults(RasdConfig if method == "rasd" else BUILT_BY.get(method, type(proposer).__init__))
    for key, value in options.items():
        if key in declared and key != "max_depth":   # max_depth: None there means the shape's own cap
            assert declared[key] == value, f"{method}: option {key}={value}, the proposer's default {declared[key]}"


def real_defaults(fn: Any) -> dict[str, Any]:
    return {n: p.default for n, p in inspect.signature(fn).parameters.items() if p.default is not p.empty}
