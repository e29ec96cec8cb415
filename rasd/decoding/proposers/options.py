"""What a method variant (`rasd:history=off`, `eagle:sizing=fixed;max_nodes=1`) may set: one dataclass a method.

Why: the bench runs a method with options changed beside the plain one, and those options reach
`build_decoder` and the proposer. Declared here with their types and defaults, a typo (`rasd:histroy=off`) or a
bad value (`pld:max_ngram=many`) fails when the names are parsed, in one line that lists the valid keys,
instead of as a TypeError after the model has loaded, or not at all. A method's `MethodSpec.options` names its
class; a field's default is what the method does when the variant leaves it out.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

from rasd.decoding.proposers.draft import DEFAULT_WINDOW

_FLAGS = {"on": True, "true": True, "off": False, "false": False}


@dataclass
class MethodOptions:
    """Options every method takes (they go to `build_decoder`)."""

    sizing: str = "cost"     # the tree-size policy (`sizing.sizers.SIZINGS`)
    max_nodes: int = 64      # the most draft nodes a step, whatever the policy

    def validate(self) -> None:
        """Checks a type alone cannot make (called by `parse_variant` after the values were converted)."""
        from rasd.decoding.sizing.sizers import SIZINGS

        if self.sizing not in SIZINGS:
            raise ValueError(f"sizing={self.sizing!r} is not one of {', '.join(SIZINGS)}")
        if self.max_nodes < 0:
            raise ValueError(f"max_nodes={self.max_nodes} must be >= 0")


@dataclass
class GatedOptions(MethodOptions):
    """A method that runs a draft model: its per-step draft gate (`sizing.gate.DraftGate`) can be forced."""

    gate: bool | None = None   # None: a gate with cost sizing where the method has one; off/on force it


@dataclass
class PldOptions(MethodOptions):
    """`pld` (`PromptLookupProposer`)."""

    max_ngram: int = 4      # the longest n-gram of the context's end looked up
    min_ngram: int = 1      # the shortest
    max_len: int = 10       # tokens copied after a match
    max_matches: int = 8    # matches kept, most recent first


@dataclass
class DraftOptions(GatedOptions):
    """`draft` and `optree` (`DraftModelProposer`)."""

    max_depth: int | None = None   # the tree's deepest layer (none: 6, optree's own cap for `optree`)
    top_k: int = 1                 # children tried per node
    width: int = 1                 # nodes expanded per layer
    min_prob: float | None = 0.05  # a branch stops below this draft probability (None: the sizer decides)
    seed: int = 0                  # the sampling chain's seed
    window: int | None = DEFAULT_WINDOW   # prompt tokens the draft reads (none: all)


@dataclass
class OptreeOptions(DraftOptions):
    """`optree`: a draft model's tree under OPT-Tree's objective; without a draft model, the self-draft."""

    eesd: str | None = None   # the self-draft's exit-layer file (default: the trained one)


@dataclass
class RetrievalOptions(MethodOptions):
    """`retrieval` (`RetrievalProposer`)."""

    max_continuations: int = 16   # continuations read from the datastores per step
    length: int = 8               # tokens read after a datastore match
    max_match: int = 16           # the longest suffix of the context matched in the datastores
    min_match: int = 2            # the shortest
    use_context: bool = True      # also copy from the request's own text (as `pld`)
    context_max_ngram: int = 4
    context_min_ngram: int = 1
    context_matches: int = 8
    context_length: int = 10


@dataclass
class RecyclingOptions(MethodOptions):
    """`recycling` (`RecyclingProposer`)."""

    shape: Literal["optree", "template"] = "optree"   # the tree grown from the matrix
    max_depth: int = 8


@dataclass
class RasdOptions(GatedOptions):
    """`rasd` (`RasdProposer`, `RasdConfig`)."""

    history: bool = True     # draft from earlier responses too (SuffixDecoding)
    head: Literal["auto", "off"] = "auto"   # without --draft-model: the target's EAGLE head when it has one
    eagle: str | None = None                # an EAGLE head file (default: the trained or shipped one)
    short_copies: bool = True               # one-token copies of the request's text, scored per request
    context_min_ngram: int | None = None    # the shortest own-text match copied (None: 2 with a drafter, else 1)
    prune_with: Literal["auto", "draft", "recycling", "counts"] = "auto"   # what prunes retrieval branches


@dataclass
class SuffixOptions(MethodOptions):
    """`suffix` (`SuffixProposer`)."""

    max_spec_factor: float = 1.0   # SuffixDecoding's tree size: factor × match length + offset
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1    # a node's least estimated probability
    max_match: int = 24
    min_match: int = 1
    max_continuations: int = 32
    max_len: int = 32
    use_context: bool = True       # also copy from the request's own text
    history: bool = True           # off: an empty history per decoder (nothing is shared)


@dataclass
class EagleOptions(GatedOptions):
    """`eagle` (`EagleProposer`)."""

    single_node: bool = True        # with cost sizing, measured speed picks per block: trees or one node a step
    max_depth: int | None = 6
    top_k: int = 8
    width: int = 8
    min_prob: float | None = 0.02   # None: the cost sizer decides (the default with cost sizing)
    seed: int = 0
    window: int | None = DEFAULT_WINDOW   # prompt tokens the head reads (none: all)
    eagle: str | None = None        # an EAGLE head file (default: the trained or shipped one)


@dataclass
class EesdOptions(GatedOptions):
    """`eesd` (`make_eesd`)."""

    max_depth: int = 10   # the Thompson-sampled length's cap
    seed: int = 0
    siblings: int = 2     # greedy: the chain's runner-up tokens as extra leaves
    eesd: str | None = None


@dataclass
class AdaeagleOptions(GatedOptions):
    """`adaeagle` (`make_adaeagle`)."""

    seed: int = 0
    drafter: Literal["eagle", "eesd", "draft-model"] | None = None   # None: from --draft-model
    ldlp: str | None = None    # the trained length predictor's file
    eesd: str | None = None
    eagle: str | None = None


def parse_variant(name: str, options_for: Any) -> tuple[str, dict[str, Any]]:
    """`rasd:history=off;max_nodes=8` -> ("rasd", {"history": False, "max_nodes": 8}), checked against the
    method's options class (`options_for(method)`); only the keys given are returned, converted to their
    field's type. A ValueError of one line names a bad key (with the valid ones) or a bad value."""
    method, _, rest = name.partition(":")
    cls = options_for(method)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    options: dict[str, Any] = {}
    for pair in filter(None, rest.split(";")):
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"method {name!r}: options are KEY=VALUE, e.g. rasd:history=off")
        if key not in fields:
            raise ValueError(f"method {method!r} has no option {key!r}; valid: {', '.join(sorted(fields))}")
        try:
            options[key] = convert(text, hints[key])
        except ValueError as exc:
            raise ValueError(f"method {method!r}: {key}={text!r}: {exc}") from None
    try:
        cls(**options).validate()
    except ValueError as exc:
        raise ValueError(f"method {method!r}: {exc}") from None
    return method, options


def convert(text: str, kind: Any) -> Any:
    """`text` as a value of the type `kind` (bool: on/off/true/false; X | None: also `none`; a Literal: one of
    its values); ValueError saying what was expected."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        if type(None) in args and text.lower() == "none":
            return None
        inner = [a for a in args if a is not type(None)]
        return convert(text, inner[0]) if len(inner) == 1 else text
    if typing.get_origin(kind) is Literal:
        if text not in args:
            raise ValueError(f"expected one of {', '.join(map(str, args))}")
        return text
    if kind is bool:
        if text.lower() not in _FLAGS:
            raise ValueError("expected on or off")
        return _FLAGS[text.lower()]
    if kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            raise ValueError(f"expected {'an integer' if kind is int else 'a number'}") from None
    return text
